"""SavedModel directories: load, convert every reachable function, save (see README)."""

from __future__ import annotations

from pathlib import Path

from .errors import InputError


def load_saved_model(path: Path):
    if not (path / "saved_model.pb").is_file() and not (path / "saved_model.pbtxt").is_file():
        raise InputError(f"{path}: a directory, but not a SavedModel (no saved_model.pb in it)")
    raise InputError(f"{path}: SavedModel conversion is not available in this build yet")


def convert_saved_model(model, options):
    raise InputError(f"{model.path}: SavedModel conversion is not available in this build yet")


def save_saved_model(model, out_path, *, force=False):
    raise InputError(f"{out_path}: SavedModel conversion is not available in this build yet")
