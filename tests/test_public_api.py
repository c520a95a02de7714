"""The public API is what the package promises, however much of it has been imported: each
name of ``amp_rewrite.__all__`` is the object its module defines, never a subpackage that
happens to share its name (Python binds an imported subpackage as its parent's attribute)."""

import importlib
import inspect
import pkgutil

import pytest

import amp_rewrite

pytestmark = pytest.mark.fast


def test_public_names_survive_importing_every_module():
    for info in pkgutil.walk_packages(amp_rewrite.__path__, prefix="amp_rewrite."):
        if info.name != "amp_rewrite.__main__":   # that one runs the command
            importlib.import_module(info.name)
    for name in amp_rewrite.__all__:
        value = getattr(amp_rewrite, name)
        assert not inspect.ismodule(value), f"amp_rewrite.{name} is a module"
        assert getattr(value, "__name__", name) == name
    from amp_rewrite import convert, convert_file, tune
    assert all(inspect.isfunction(f) for f in (convert, convert_file, tune))


def test_no_folder_is_named_like_a_public_name():
    folders = {info.name for info in pkgutil.iter_modules(amp_rewrite.__path__)}
    assert folders & set(amp_rewrite.__all__) == set()
