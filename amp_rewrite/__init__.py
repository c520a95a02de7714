"""amp-rewrite: turn an FP32 TensorFlow graph into a float16/bfloat16 mixed-precision one, offline.

Public API::

    from amp_rewrite import convert, convert_file
    new_graph_def, report = convert(graph_def, target="float16")
    report = convert_file("model.pb", "model_amp.pb", target="bfloat16", device="cpu")

Names are imported on first use, so ``import amp_rewrite`` (and the CLI's start-up) does not
pay for importing TensorFlow until something needs it.
"""

from __future__ import annotations

import importlib

from .version import __version__ as __version__  # the one place it is written

_EXPORTS = {
    "Options": "conversion.graph", "convert": "conversion.pipeline", "convert_file": "conversion.pipeline",
    "convert_model": "conversion.pipeline",
    "AmpRewriteError": "core.errors", "InputError": "core.errors", "IRError": "core.errors",
    "LintError": "core.errors", "RuleError": "core.errors", "UnsupportedGraphError": "core.errors",
    "Report": "report.decisions", "RuleSet": "rules.loader", "load_rules": "rules.loader",
    "tune": "tools.tuning", "TuneResult": "tools.tuning",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'amp_rewrite' has no attribute {name!r}")
