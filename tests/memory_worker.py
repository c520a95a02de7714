"""Run as a script by test_bad_input: the memory one conversion takes above a fresh baseline.

    python memory_worker.py WARM_UP_GRAPH GRAPH OUT_DIR

Converts WARM_UP_GRAPH first (a tiny graph: TensorFlow, the OpDefs and every first-use cache
loaded), then resets the process's peak RSS to what it holds now (``/proc/self/clear_refs``;
the import's own peak is higher than many conversions and would hide them), converts GRAPH file
to file as the CLI does (parse, convert, serialize, write) and prints, as JSON, the RSS before
(``base_kib``) and the peak during the conversion (``peak_kib``).

RSS, not tracemalloc: protobuf's messages live in its own C++ arenas, which tracemalloc does not
see (on the 64 MiB graph it saw 64 MiB of the 191 MiB the process grew by).
"""

import gc
import json
import sys
from pathlib import Path

from amp_rewrite import convert_file


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key))


def main(warm_up: str, graph: str, out_dir: str) -> None:
    out = Path(out_dir)
    convert_file(warm_up, out / "warm_up.pb", force=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")   # VmHWM := VmRSS
    base = _status_kib("VmRSS:")
    convert_file(graph, out / "converted.pb", force=True)
    print(json.dumps({"base_kib": base, "peak_kib": _status_kib("VmHWM:")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
