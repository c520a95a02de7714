"""Run as a script by test_freeze_at_scale: the memory one ``--freeze`` conversion takes above
a warmed-up process.

    python freeze_memory_worker.py WARM_UP_SAVEDMODEL SAVEDMODEL OUT_DIR REPORT_JSON

Converts WARM_UP_SAVEDMODEL with --freeze first (TensorFlow, the OpDefs, the loader and every
first-use cache loaded), then resets the process's peak RSS to what it holds now
(``/proc/self/clear_refs``, as memory_worker.py does), converts SAVEDMODEL with ``--freeze
--target bfloat16 --device cpu`` to OUT_DIR (its report to REPORT_JSON) and prints, as JSON,
the RSS before (``base_kib``) and the peak during the conversion (``peak_kib``).
"""

import gc
import json
import sys
import tempfile
from pathlib import Path

from amp_rewrite import convert_file


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key))


def main(warm_up: str, model: str, out: str, report: str) -> None:
    options = dict(target="bfloat16", device="cpu", freeze=True)
    with tempfile.TemporaryDirectory() as tmp:
        convert_file(warm_up, Path(tmp) / "warm_up", **options)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")   # VmHWM := VmRSS
    base = _status_kib("VmRSS:")
    result = convert_file(model, out, **options)
    Path(report).write_text(result.to_json())
    print(json.dumps({"base_kib": base, "peak_kib": _status_kib("VmHWM:")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
