"""The TensorBoard export (``--tensorboard``): the converted graph as an event file for the
Graphs tab, staged with the command's other outputs (:class:`~amp_rewrite.io.files.OutputSet`)
so that it is written with them or not at all."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from ..core.errors import InputError
from ..io.files import OutputSet


def stage_tensorboard(outputs: OutputSet, logdir, graph_def) -> Path:
    """Write ``graph_def`` into a new event file (TensorBoard's Graphs tab) staged for
    ``logdir``: committing ``outputs`` moves it into ``logdir``, or makes ``logdir`` holding
    it where there is none yet (its parent must exist). Returns the event file's final path."""
    logdir = Path(logdir)
    if logdir.exists() and not logdir.is_dir():
        raise InputError(f"{logdir}: a file, not a TensorBoard folder")
    # staged inside an existing logdir (its parent may be anyone's), else beside it
    staging = outputs.temporary_folder(logdir / "events" if logdir.is_dir() else logdir)
    writer = tf.summary.create_file_writer(str(staging))
    with writer.as_default():
        tf.summary.graph(graph_def)
    writer.flush()
    writer.close()
    (event,) = staging.glob("events.out.tfevents.*")
    if logdir.is_dir():
        outputs.add(event, logdir / event.name)
    else:
        outputs.add(staging, logdir)
    return logdir / event.name
