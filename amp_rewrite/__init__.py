"""amp-rewrite: turn an FP32 TensorFlow graph into a float16/bfloat16 mixed-precision one, offline.

Public API::

    from amp_rewrite import convert, convert_file
    new_graph_def, report = convert(graph_def, target="float16")
    report = convert_file("model.pb", "model_amp.pb", target="bfloat16", device="cpu")
"""

from .convert import Options, convert, convert_file, convert_model
from .errors import AmpRewriteError, InputError, LintError, RuleError, UnsupportedGraphError
from .load import load
from .report import Report
from .rules import RuleSet, load_rules
from .save import save

__all__ = [
    "AmpRewriteError", "InputError", "LintError", "Options", "Report", "RuleError", "RuleSet",
    "UnsupportedGraphError", "convert", "convert_file", "convert_model", "load", "load_rules",
    "save",
]
__version__ = "0.1.0"
