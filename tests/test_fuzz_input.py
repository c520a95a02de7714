"""Fuzz: corrupted real graphs are refused in one line, or convert into files TensorFlow imports.

Real graphs (the bundled example CNN, a v1 while loop, a functional While with its function
library) are damaged as a corrupted file or a careless generator would damage them
(``corrupt.py``: inputs renamed, dropped or pointed elsewhere, control inputs, colocation
attrs, device strings, op types, deleted nodes, dtypes and attrs, function names) and given to
the command line. Exit 2 with one line and no output file; or exit 0 and an output that
``tf.graph_util.import_graph_def`` takes in a fresh graph. Never anything else (70 would be an
internal error on the user's bad file). And exit 0 only where TensorFlow imports the input
too: what its importer refuses, the converter refuses. Graphs with ops TensorFlow does not
register (custom ops, calls of missing functions) are converted and left as they are, and the
importer refuses such a file in any case: that refusal alone is not held against the output.

Hypothesis runs derandomized, so CI sees the same graphs every run. ``AMP_REWRITE_FUZZ=N``
runs N examples instead of the default, and ``AMP_REWRITE_FUZZ_SEED=S`` other examples than
CI's (a larger run, for a person to start by hand).
"""

import contextlib
import io
import logging
import os
import tempfile
from pathlib import Path

import corrupt
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from amp_rewrite import cli

EXAMPLES = int(os.environ.get("AMP_REWRITE_FUZZ", "2000"))
SEED = os.environ.get("AMP_REWRITE_FUZZ_SEED")
EDITS = st.lists(st.tuples(st.integers(0, len(corrupt.KINDS) - 1), st.integers(0, 10**4),
                           st.integers(0, 10**4), st.integers(0, 10**4)),
                 min_size=1, max_size=4)
TARGETS = [("float16", "gpu"), ("bfloat16", "cpu")]


def _run(argv: list[str]) -> tuple[int, str]:
    """``amp-rewrite argv`` in this process: exit code and stderr."""
    logger = logging.getLogger("amp_rewrite")
    saved = logger.handlers[:], logger.level, logger.propagate
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    return code, err.getvalue()


@pytest.mark.filterwarnings("ignore")
@(seed(int(SEED)) if SEED else lambda test: test)
@settings(max_examples=EXAMPLES, derandomize=SEED is None, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(source=st.integers(0, len(corrupt.SOURCES) - 1), edits=EDITS,
       target=st.sampled_from(TARGETS))
def test_corrupted_graphs_are_refused_or_convert_into_what_tensorflow_imports(source, edits,
                                                                             target):
    graph_def = corrupt.source(source)
    for edit in edits:
        corrupt.apply(graph_def, edit)
    data = graph_def.SerializeToString()
    with tempfile.TemporaryDirectory() as folder:
        src, dst = Path(folder) / "in.pb", Path(folder) / "out.pb"
        src.write_bytes(data)
        code, err = _run([str(src), "-o", str(dst), "--target", target[0], "--device", target[1],
                          "--min-matrix-intensity", "0", "-q"])
        assert src.read_bytes() == data
        assert code in (0, 2), err
        lines = err.strip().splitlines()
        if code == 2:
            event("refused")
            assert len(lines) == 1 and "in.pb" in lines[0] and not dst.exists(), err
            return
        event("converted")
        written = type(graph_def).FromString(dst.read_bytes())
    refused = corrupt.import_error(written)
    assert refused is None or corrupt.refused_only_for_custom_ops(refused, graph_def), refused
    refused = corrupt.import_error(graph_def)
    assert refused is None or corrupt.refused_only_for_custom_ops(refused, graph_def), (
        f"converted a graph TensorFlow refuses: {refused}")
