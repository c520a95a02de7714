"""Files: safe writes, path identity and what a path holds, as far as its name and first bytes
tell. Standard library only, so the CLI can check paths before TensorFlow is imported.

A write goes to a temporary file in the target's own folder, is flushed to disk and renamed
over the target: a crash leaves at most a hidden ``.NAME.*.tmp`` beside it, never a
half-written output. A command with several outputs writes them as one :class:`OutputSet`:
all of them, or none.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InputError, option

#: the file that makes a directory a SavedModel
SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
#: names of protobuf text files
TEXT_SUFFIXES = (".pbtxt", ".pbtext", ".txt", ".prototxt")
#: names a GraphDef or MetaGraphDef file is written under
GRAPH_FILE_SUFFIXES = (".pb", ".meta") + TEXT_SUFFIXES
# first bytes of model files that are not TensorFlow graphs
_KERAS_MAGIC = {b"PK\x03\x04": "a Keras .keras archive", b"\x89HDF\r\n\x1a\n": "an HDF5 (.h5) file"}
#: the names Keras loads a model file under, by kind (``keras.models.load_model`` picks its
#: reader by the name, not by the bytes)
KERAS_SUFFIXES = {".keras": "a Keras .keras archive", ".h5": "an HDF5 (.h5) file",
                  ".hdf5": "an HDF5 (.h5) file"}


def is_saved_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a SavedModel directory or its saved_model.pb(txt)."""
    path = Path(path)
    if path.name in SAVED_MODEL_FILES:
        return path.is_file()
    return path.is_dir() and any((path / name).is_file() for name in SAVED_MODEL_FILES)


def is_keras_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file named like a Keras model file (``.keras``, ``.h5``,
    ``.hdf5``) or starting with the bytes of one (a zip archive, HDF5)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() in KERAS_SUFFIXES:
        return True
    try:
        with open(path, "rb") as fh:
            return keras_file(fh.read(8)) is not None
    except OSError:
        return False   # loading says why it cannot be read


def check_container(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A SavedModel, and a Keras file (its serving function exported), convert to a SavedModel
    directory: refuse an output named like a graph file (``model_dir/saved_model.pb -o
    model.pb`` would write a directory called model.pb), and for a Keras file an output named
    like one or that is a file."""
    dst = Path(dst)
    if is_keras_file(src) and (dst.suffix.lower() in GRAPH_FILE_SUFFIXES + tuple(KERAS_SUFFIXES)
                               or (dst.exists() and not dst.is_dir())):
        raise InputError(f"{dst}: the input is a Keras file, which converts to a SavedModel "
                         f"directory (its serving function); name the output as a directory "
                         f"(e.g. {dst.with_suffix('') if dst.suffix else dst.name + '_amp'})")
    if is_saved_model(src) and dst.suffix.lower() in GRAPH_FILE_SUFFIXES and not dst.is_dir():
        raise InputError(f"{dst}: the input is a SavedModel, which converts to a SavedModel "
                         f"directory; name the output as a directory (e.g. {dst.with_suffix('')}), "
                         "or freeze a signature to a GraphDef first (docs/savedmodels.md: \"Frozen graphs "
                         "from a SavedModel\") and convert that")


# why --loss and --grad do not apply to a SavedModel
_FOUND_ITSELF = ("it names a node of the graph, and a SavedModel's train steps are functions "
                 "whose seeds amp-rewrite finds itself")
#: convert options only a graph file (GraphDef, MetaGraph) takes, by the name
#: ``conversion.graph.Options`` gives each (``loss``, ``grads``: its ``loss_scale_options``
#: hints): the flag, the Python keyword, and why a SavedModel (or a Keras file, converted as
#: one) has no use for it. Given there, they would be ignored: they are refused instead
GRAPH_FILE_OPTIONS = {
    "loss": ("--loss", "loss_scale_options['loss']", _FOUND_ITSELF),
    "grads": ("--grad", "loss_scale_options['grads']", _FOUND_ITSELF),
    "fold_constants": ("--fold-constants", "fold_constants=True",
                       "a SavedModel's weights are variables, and there is nothing to fold"),
    "lowp_io": ("--lowp-io", "lowp_io=True", "a SavedModel's signatures keep their dtypes"),
}


def refuse_graph_file_options(path: str | os.PathLike, given: dict) -> None:
    """Refuse, as an :class:`InputError`, the first option of ``given`` (``Options`` names ->
    values; set when truthy) that :data:`GRAPH_FILE_OPTIONS` lists, for ``path``, a SavedModel
    or a Keras file."""
    for name, (flag, keyword, why) in GRAPH_FILE_OPTIONS.items():
        if given.get(name):
            raise InputError(f"{path}: {option(flag, keyword)} applies to graph files (.pb, "
                             f".pbtxt, .meta), not to a SavedModel or Keras file: {why}; drop it")


def not_freezable(path: str | os.PathLike) -> str:
    """Why ``--freeze`` does not apply to ``path``, a graph file (the message of its refusal)."""
    freeze, fold = option("--freeze", "freeze=True"), option("--fold-constants", "fold_constants=True")
    return (f"{path}: {freeze} freezes the signatures of a SavedModel or Keras file; a graph "
            f"file is converted as it is (its Consts folded with {fold}): drop {freeze}")


def keras_file(data: bytes) -> str | None:
    """What kind of Keras model file ``data`` starts like, or None."""
    return next((kind for magic, kind in _KERAS_MAGIC.items() if data.startswith(magic)), None)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file (through symlinks, ``..`` and hard links)."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def tune_rules_path(output: str | os.PathLike) -> Path:
    """Where ``tune`` writes its rules file by default: beside the output,
    ``<output>.tune.toml`` (the CLI checks it before TensorFlow loads, the library writes it)."""
    output = Path(output)
    return output.with_name(output.name + ".tune.toml")


def already_exists(path: str | os.PathLike) -> str:
    """The message for an existing output given without force (the flag or the keyword:
    :func:`~amp_rewrite.core.errors.option`)."""
    return f"{path}: already exists; pass {option('--force', 'force=True')} to replace it"


def check_file_destination(path: Path, *, force: bool = False) -> Path:
    """The InputError :func:`atomic_write` would raise for ``path`` (it exists and ``force``
    is not set, it is a directory, its folder is missing); returns the folder."""
    if path.exists() and not force:
        raise InputError(already_exists(path))
    if path.is_dir():
        raise InputError(f"{path}: is a directory")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{path}: folder {folder} does not exist")
    return folder


def atomic_write(path: Path, data: bytes, *, force: bool = False) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    with OutputSet() as outputs:
        outputs.add_file(path, data, force=force)
        outputs.commit()


def _cannot_write(path, exc: OSError) -> InputError:
    return InputError(f"{path}: cannot write: {exc.strerror or exc}")


@dataclass
class _Staged:
    tmp: Path        # written in full, in the target's folder
    target: Path
    replace: bool    # whether an existing target may be replaced


class OutputSet:
    """Files and folders a command writes as one set: all of them, or none.

    Each output is first written in full under a hidden temporary name in its target's own
    folder (:meth:`add_file`; a folder the caller fills, from :meth:`temporary_folder`, is
    handed over with :meth:`add`); :meth:`commit` then renames them into place, in the order
    they were added. Running out of space or permission happens while writing, before the first
    rename; should a rename still fail (the folder changed under us), the renames before it are
    undone and what they replaced is put back. Leaving the ``with`` block without a commit
    removes every temporary. Only a crash during the renames themselves (a few system calls)
    can leave part of the set in place, and what it replaced as hidden ``.NAME.*.old`` files.
    """

    def __init__(self) -> None:
        self._staged: list[_Staged] = []
        self._temporaries: list[Path] = []

    def __enter__(self) -> "OutputSet":
        return self

    def __exit__(self, *exc) -> None:
        self._remove_temporaries()

    def add_file(self, path: str | os.PathLike, data: bytes, *, force: bool = False) -> None:
        """Stage ``data`` for the file ``path`` (an InputError where :func:`check_file_destination`
        finds one, or the temporary cannot be written)."""
        path = Path(path)
        folder = check_file_destination(path, force=force)
        try:
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        except OSError as exc:
            raise _cannot_write(path, exc) from None
        self._temporaries.append(Path(name))
        try:
            # mkstemp makes the file private (0600); give it the mode a plain open() would, or
            # the mode of the file it replaces
            os.fchmod(fd, _mode_for(path))
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise _cannot_write(path, exc) from None
        self._staged.append(_Staged(Path(name), path, force))

    def temporary_folder(self, target: str | os.PathLike) -> Path:
        """A new hidden folder beside ``target``, removed with the set unless it was renamed
        into place (:meth:`add`)."""
        target = Path(target)
        parent = target.parent if str(target.parent) else Path(".")
        try:
            folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
        except OSError as exc:
            raise _cannot_write(target, exc) from None
        self._temporaries.append(folder)
        return folder

    def add(self, tmp: Path, target: str | os.PathLike, *, replace: bool = False) -> None:
        """Stage ``tmp`` (a file or folder written in full, on ``target``'s file system) to be
        renamed to ``target``; an existing target is replaced only with ``replace``."""
        self._staged.append(_Staged(Path(tmp), Path(target), replace))

    def commit(self) -> None:
        """Rename every staged output into place, or (an InputError) none."""
        done: list[tuple[_Staged, Path | None]] = []
        try:
            for staged in self._staged:
                done.append((staged, _put(staged)))
        except BaseException as exc:
            for placed, backup in reversed(done):
                _undo(placed.target, backup)
            if isinstance(exc, OSError):
                raise _cannot_write(staged.target, exc) from None
            raise
        self._staged = []
        for _, backup in done:
            if backup is not None:
                _remove(backup)
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        for path in self._temporaries:
            _remove(path)
        self._temporaries = []


def _put(staged: _Staged) -> Path | None:
    """Rename ``staged`` into place; returns where the output it replaced now is, if any."""
    target = staged.target
    if not os.path.lexists(target):
        os.rename(staged.tmp, target)
        return None
    if not staged.replace:
        raise FileExistsError(errno.EEXIST, "it appeared while the command ran")
    if target.is_dir() != staged.tmp.is_dir():   # a file never replaces a folder, nor the reverse
        raise FileExistsError(errno.EEXIST, "a " + ("folder" if target.is_dir() else "file")
                              + " appeared there while the command ran")
    backup = target.with_name(f".{target.name}.{secrets.token_hex(4)}.old")
    if target.is_file() and staged.tmp.is_file():
        try:
            os.link(target, backup)   # the old file stays whole under a second name ...
        except OSError:
            pass                      # (a file system without hard links: move it aside)
        else:
            os.replace(staged.tmp, target)   # ... and the target is never missing
            return backup
    os.rename(target, backup)
    try:
        os.rename(staged.tmp, target)
    except OSError:
        os.rename(backup, target)
        raise
    return backup


def _undo(target: Path, backup: Path | None) -> None:
    """Take a committed output back out, and put what it replaced back (best effort: this runs
    while another error is on its way to the user)."""
    try:
        if backup is not None:
            if target.is_dir() and not target.is_symlink():
                _remove(target)
            os.replace(backup, target)
        else:
            _remove(target)
    except OSError:
        pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass
