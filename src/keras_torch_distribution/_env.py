"""The package's KTD_* settings, read from the environment in one place.

Each reader parses its variable when called (tests and launchers change the
environment between calls) and refuses a bad value with an error naming the
variable, the value and what is accepted:

- KTD_TIMEOUT_SECONDS: how long the rendezvous and every collective wait for
  a peer, in (0, MAX_TIMEOUT_SECONDS]; default 300.
- KTD_DEVICE: "cpu" runs on CPU processes (gloo) even where CUDA exists;
  unset (or "gpu") uses CUDA when it is available.
- KTD_LOG_LEVEL: the package logger's level (a `logging` level name);
  default WARNING.
- KTD_LOG_ALL_RANKS: "1" lets every rank log, not only rank 0.
- KTD_FSDP_GROUP: what one FSDP gather covers: "block" (default) the
  outermost layers below the models (a keras_hub decoder block, a Dense of
  a Sequential), "layer" each layer's own variables.
- KTD_FSDP_PREFETCH: how many FSDP groups' gathers may be in flight ahead
  of the one in use, in forward and in backward; 0 turns prefetch off;
  default 1 on CUDA, 0 on CPU (the caller's default).

Imports nothing from the package, so every module may use it.
"""

import logging
import math
import os

DEFAULT_TIMEOUT_SECONDS = 300.0
# One week. A peer that has not answered in a week is hung; larger values are
# almost always typos (1e30) and overflow torch's millisecond timeouts.
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _number(name, parse, default):
    """(text, value) of the variable `name`: (None, `default`) when it is
    unset; value None when `parse` refuses the text."""
    text = os.environ.get(name)
    if text is None:
        return None, default
    try:
        return text, parse(text)
    except ValueError:
        return text, None


def timeout_seconds():
    """KTD_TIMEOUT_SECONDS as a float, or the default when it is unset."""
    text, value = _number("KTD_TIMEOUT_SECONDS", float, DEFAULT_TIMEOUT_SECONDS)
    if text is None:
        return value
    if value is None:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_SECONDS:  # also refuses nan and inf
        raise ValueError(
            f"KTD_TIMEOUT_SECONDS={text!r} is not a positive number of seconds "
            f"up to {MAX_TIMEOUT_SECONDS:.0f} (one week): it sets how long the "
            "rendezvous and each collective wait for a peer. Set it to a "
            f"number in (0, {MAX_TIMEOUT_SECONDS:.0f}], e.g. 300 (the "
            "default), or unset it."
        )
    return value


def forces_cpu():
    """True when KTD_DEVICE=cpu asks for CPU processes where CUDA exists."""
    text = os.environ.get("KTD_DEVICE", "")
    if text.lower() not in ("", "cpu", "gpu", "cuda"):
        raise ValueError(
            f"KTD_DEVICE={text!r} is not a device choice: set KTD_DEVICE=cpu "
            "to run on CPU processes (gloo) even where CUDA exists; unset it "
            "(or set gpu) to use CUDA when it is available."
        )
    return text.lower() == "cpu"


def log_level():
    """KTD_LOG_LEVEL as a `logging` level name (default WARNING)."""
    text = os.environ.get("KTD_LOG_LEVEL", "WARNING")
    if text.upper() not in _LOG_LEVELS:
        raise ValueError(
            f"KTD_LOG_LEVEL={text!r} is not a logging level: set one of "
            f"{', '.join(_LOG_LEVELS)} (default WARNING), or unset it."
        )
    return getattr(logging, text.upper())


def log_all_ranks():
    """True when KTD_LOG_ALL_RANKS=1 lets every rank log."""
    return os.environ.get("KTD_LOG_ALL_RANKS") == "1"


FSDP_GROUPS = ("block", "layer")


def fsdp_group():
    """KTD_FSDP_GROUP: "block" (default) or "layer"."""
    text = os.environ.get("KTD_FSDP_GROUP", "block")
    if text.lower() not in FSDP_GROUPS:
        raise ValueError(
            f"KTD_FSDP_GROUP={text!r} is not an FSDP group policy: set block "
            "(one gather per outermost layer below the models, e.g. a decoder "
            "block; the default) or layer (one per layer's own variables), or "
            "unset it."
        )
    return text.lower()


def fsdp_prefetch(default):
    """KTD_FSDP_PREFETCH as an int >= 0; `default` when it is unset."""
    text, value = _number("KTD_FSDP_PREFETCH", int, default)
    if text is None:
        return value
    if value is None or value < 0:
        raise ValueError(
            f"KTD_FSDP_PREFETCH={text!r} is not a count of FSDP groups: set "
            "an integer >= 0 (how many groups' gathers may be in flight ahead "
            "of the one in use; 0 turns prefetch off), or unset it (1 on "
            "CUDA, 0 on CPU)."
        )
    return value
