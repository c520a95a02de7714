"""Run as a script by test_bad_input: convert models in a fresh process and report, as JSON,
what Python code-loading events happened and how much memory the conversion took.

    python untrusted_worker.py OUT_DIR SMALL_GRAPH BIG_GRAPH SAVED_MODEL REFUSED_FILE...

A warm-up round (every model but the big one) imports everything a conversion needs, so in
the measured round that follows any ``exec``,
``compile``, ``marshal.loads`` or ``pickle.find_class`` event can only come from running code
carried by a model. Peak RSS growth is measured over the conversion of ``BIG_MODEL``.
"""

import json
import os
import resource
import sys
from pathlib import Path

from amp_rewrite import convert_file
from amp_rewrite.errors import InputError

CODE_EVENTS = {"exec", "compile", "marshal.loads", "marshal.load", "pickle.find_class",
               "os.system", "subprocess.Popen"}
_seen: list[str] = []
_recording = [False]


def _hook(event, args):
    if _recording[0] and event in CODE_EVENTS:
        _seen.append(event)


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _convert_all(out: Path, models: list[str], tag: str) -> list[str]:
    outcomes = []
    for path in models:
        try:
            convert_file(path, out / f"{Path(path).name}.{tag}", force=True)
            outcomes.append("converted")
        except InputError:
            outcomes.append("refused")
    return outcomes


def main(out_dir: str, small: str, big: str, *others: str) -> None:
    out = Path(out_dir)
    _convert_all(out, [small, *others], "warmup")
    sys.addaudithook(_hook)
    before = _peak()
    _recording[0] = True
    _convert_all(out, [big], "big")
    growth = _peak() - before
    outcomes = _convert_all(out, [small, *others], "again")
    _recording[0] = False
    print(json.dumps({"events": _seen, "growth": growth, "size": os.path.getsize(big),
                      "outcomes": outcomes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
