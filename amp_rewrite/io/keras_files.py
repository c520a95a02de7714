"""Keras model files (``.keras``, legacy ``.h5``) as SavedModels: loaded with Keras, their
serving function exported into a temporary folder, which is then converted like any SavedModel
and removed afterwards (:func:`exported`, :func:`saved_models`).

What the export holds is Keras' ``model.export()``: the forward pass (``call`` in inference
mode) as the ``serve`` method and the ``serve`` and ``serving_default`` signatures, with one
input per ``keras.Input`` (keyed by its name) and outputs ``output_0``, ``output_1`` ... (the
keys of a model's output dict), and the weights as variables. Optimizer state, losses and
metrics are not in it: the file is loaded with ``compile=False``, so a custom loss does not
keep a model from loading.

Keras runs the file's configuration, so this is the one loader that deserializes Python
objects: it loads in Keras' safe mode (a ``Lambda`` layer's marshalled code is refused, as
are classes Keras cannot find among its own and those registered in the process), and what
Keras raises for a file it cannot read or a model it cannot export is an :class:`InputError`
in one line; anything else (a failure to write the export into our folder) is ours. The temporary folder lives in the system's
temporary directory, never beside the user's file, and goes when the ``with`` block ends,
error or not.

``keras`` is imported at the top: ``import tensorflow`` (2.21) imports Keras 3 itself (some 500
``keras`` modules), so this costs nothing on top of TensorFlow, which every importer of this
module loads anyway (measured: ``import keras`` after ``import tensorflow`` takes about a
microsecond).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import keras

from ..core.errors import AmpRewriteError, InputError
from .files import KERAS_SUFFIXES, is_keras_file, keras_file

log = logging.getLogger(__name__)

#: what to do about a model amp-rewrite cannot load or export itself
HOW = ("Load it where its code is and you trust it, export it with model.export('model_dir') "
       "and convert that directory (docs/savedmodels.md \"Keras files\")")


@contextlib.contextmanager
def exported(path: str | os.PathLike) -> Iterator[Path]:
    """The SavedModel of the Keras file ``path``: a folder in a new temporary directory that is
    removed when the block ends. An :class:`AmpRewriteError` raised inside the block names
    ``path`` where it named the folder."""
    path = Path(path)
    _check_name(path)
    model = _load(path)
    scratch = Path(tempfile.mkdtemp(prefix="amp-rewrite-keras-"))
    try:
        folder = scratch / path.stem
        _export(model, folder, path)
        del model   # the Keras model's memory is not needed while the export converts
        try:
            yield folder
        except AmpRewriteError as exc:
            exc.args = tuple(a.replace(str(folder), str(path)) if isinstance(a, str) else a
                             for a in exc.args)
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def saved_models(paths: Sequence[str | os.PathLike]) -> Iterator[list]:
    """``paths`` with each Keras file among them replaced by its export (:func:`exported`), the
    others as they are; the exports are removed when the block ends."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(exported(p)) if is_keras_file(p) else p for p in paths]


def _check_name(path: Path) -> None:
    """Keras picks its reader by the file's name; refuse a name that does not match the bytes,
    which Keras would answer with a message about the name alone."""
    try:
        with open(path, "rb") as fh:
            kind = keras_file(fh.read(8))
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    named = KERAS_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise InputError(f"{path}: named like {named}, but its first bytes are not one's "
                         "(another format renamed, or damaged?)")
    if named != kind:
        want = ".keras" if kind.startswith("a Keras") else ".h5"
        raise InputError(f"{path}: {kind} by its bytes; Keras loads it only under a name "
                         f"ending in {want}: rename it")


def _load(path: Path) -> keras.Model:
    path = os.fspath(path)   # a path of another type is our bug, not a file Keras refuses
    try:
        model = keras.models.load_model(path, compile=False, safe_mode=True)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        # what Keras raises for a file it cannot read: ValueError (a Lambda refused in safe
        # mode, an unknown layer in an .h5, a damaged zip or config: JSONDecodeError),
        # TypeError (a class it cannot deserialize), KeyError (a config without a key it
        # needs), OSError (h5py's damaged file); anything else is not known to be the file's
        raise InputError(f"{path}: Keras could not load it in safe mode: {_reason(exc)} {HOW}") from None
    if not isinstance(model, keras.Model):
        raise InputError(f"{path}: holds a {type(model).__name__}, not a Keras model. {HOW}")
    return model


def _export(model: keras.Model, folder: Path, path: Path) -> None:
    try:
        model.export(str(folder), format="tf_saved_model", verbose=False)
    except (ValueError, TypeError, NotImplementedError) as exc:
        # tracing the model's call fails on what it cannot trace (shapes, dtypes, a layer
        # without a graph form); writing the export to our folder failing (an OpError,
        # an OSError) is not the file's
        raise InputError(f"{path}: Keras could not export the model's serving function: "
                         f"{_reason(exc)} {HOW}") from None
    inputs = [getattr(t, "name", "?") for t in getattr(model, "inputs", None) or []]
    log.info("%s: exported its serving function with Keras (inputs %s) to convert it",
             path, ", ".join(inputs) or "as its call takes them")


def _reason(exc: Exception) -> str:
    """The first sentence of what Keras said, on one line (its messages run to paragraphs and
    quote the whole config; a nested failure's own words follow "Exception encountered:")."""
    text = str(exc).rsplit("Exception encountered:", 1)[-1]
    text = " ".join(text.split())
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    sentence = (sentence if len(sentence) <= 300 else sentence[:300] + " ...") or type(exc).__name__
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."
