"""What loss scaling was asked for: the mode and its numbers, checked.

Standard library only, so the CLI refuses a bad or conflicting loss-scale option before
TensorFlow is imported; :mod:`amp_rewrite.training` does the scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import InputError

DEFAULTS = {"start": 2.0 ** 15, "interval": 2000, "factor": 2.0}
#: loss-scale options that are hints for finding the backward pass, not numbers
HINTS = ("loss", "grads")
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class ScaleConfig:
    """How to scale: ``mode`` is ``"dynamic"`` or ``"static"`` (``start`` is the fixed scale)."""

    mode: str
    start: float = DEFAULTS["start"]
    interval: int = DEFAULTS["interval"]
    factor: float = DEFAULTS["factor"]


def scale_config(loss_scale, target: str, options: dict) -> ScaleConfig | None:
    """The requested scaling, or None for ``none`` (the default for bfloat16).

    ``loss_scale`` is ``"dynamic"``, ``"none"``, a number (a static scale) or None (by target);
    ``options`` holds ``start``, ``interval``, ``factor`` and the hints ``loss`` and ``grads``.
    """
    asked = loss_scale
    if loss_scale is None:
        loss_scale = "dynamic" if target == "float16" else "none"
    text = str(loss_scale).strip().lower()
    unknown = set(options) - set(DEFAULTS) - set(HINTS)
    if unknown:
        raise InputError(f"unknown loss-scale option {sorted(unknown)[0]!r}")
    _refuse_conflicts(asked, text, target, options)
    start = _number(options.get("start", DEFAULTS["start"]), "--loss-scale-start", minimum=0.0)
    interval = options.get("interval", DEFAULTS["interval"])
    factor = _number(options.get("factor", DEFAULTS["factor"]), "--loss-scale-factor", minimum=1.0)
    if not isinstance(interval, int) or interval < 1:
        raise InputError(f"--loss-scale-interval must be a whole number of steps >= 1, not {interval!r}")
    if text == "none":
        return None
    if text == "dynamic":
        return ScaleConfig("dynamic", start, interval, factor)
    return ScaleConfig("static", _number(text, "--loss-scale", minimum=0.0))


_FLAGS = {"start": "--loss-scale-start", "interval": "--loss-scale-interval",
          "factor": "--loss-scale-factor", "loss": "--loss", "grads": "--grad"}


def _refuse_conflicts(asked, text: str, target: str, options: dict) -> None:
    """Options that the chosen mode would ignore are a usage error, not silently dropped."""
    dynamic_only = sorted(k for k in DEFAULTS if k in options)
    given = sorted(k for k in options if options[k] not in (None, [], ()))
    if text == "none" and given:
        why = ("--loss-scale none" if asked is not None else
               f"--target {target}, which needs no loss scaling (default --loss-scale none)")
        raise InputError(f"{_FLAGS[given[0]]} has no effect with {why}; drop it, or ask for "
                         "loss scaling with --loss-scale dynamic or a number")
    if text not in ("none", "dynamic") and dynamic_only:
        raise InputError(f"{_FLAGS[dynamic_only[0]]} applies to --loss-scale dynamic; "
                         f"--loss-scale {asked} is a static scale")


def _number(value, flag: str, minimum: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{flag} must be 'dynamic', 'none' or a number, not {value!r}"
                         if flag == "--loss-scale" else f"{flag} must be a number, not {value!r}") from None
    if not math.isfinite(number) or number <= minimum:
        raise InputError(f"{flag} must be a finite number above {minimum:g}, not {value!r}")
    if number > _FLOAT32_MAX:  # the scale is a float32 variable: it would be inf, every step skipped
        raise InputError(f"{flag} must fit in float32 (at most {_FLOAT32_MAX:.4g}), not {value!r}")
    return number
