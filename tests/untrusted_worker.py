"""Run as a script by test_bad_input: convert models in a fresh process and report, as JSON,
what Python code-loading events happened.

    python untrusted_worker.py OUT_DIR MODEL...

A warm-up round over every model imports everything a conversion needs, so in the recorded
round that follows any ``exec``, ``compile``, ``marshal.loads`` or ``pickle.find_class`` event
can only come from running code carried by a model. (The memory a conversion takes is
tests/memory_worker.py's.)
"""

import json
import sys
from pathlib import Path

from amp_rewrite import convert_file
from amp_rewrite.core.errors import InputError

CODE_EVENTS = {"exec", "compile", "marshal.loads", "marshal.load", "pickle.find_class",
               "os.system", "subprocess.Popen"}
_seen: list[str] = []
_recording = [False]


def _hook(event, args):
    if _recording[0] and event in CODE_EVENTS:
        _seen.append(event)


def _convert_all(out: Path, models: list[str], tag: str) -> list[str]:
    outcomes = []
    for path in models:
        try:
            convert_file(path, out / f"{Path(path).name}.{tag}", force=True)
            outcomes.append("converted")
        except InputError:
            outcomes.append("refused")
    return outcomes


def main(out_dir: str, *models: str) -> None:
    out = Path(out_dir)
    _convert_all(out, list(models), "warmup")
    sys.addaudithook(_hook)
    _recording[0] = True
    outcomes = _convert_all(out, list(models), "again")
    _recording[0] = False
    print(json.dumps({"events": _seen, "outcomes": outcomes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
