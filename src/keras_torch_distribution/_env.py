"""The package's KTD_* settings, read from the environment in one place.

Each reader parses its variable when called (tests and launchers change the
environment between calls) and refuses a bad value with an error naming the
variable, the value and what is accepted:

- KTD_TIMEOUT_SECONDS: how long the rendezvous and every collective wait for
  a peer, in (0, MAX_TIMEOUT_SECONDS]; default 300.
- KTD_DEVICE: "cpu" runs on CPU processes (gloo) even where CUDA exists;
  "gpu" (or "cuda") requires CUDA (an error where it is not available);
  unset uses CUDA when it is available.
- KTD_LOG_LEVEL: the package logger's level (a `logging` level name);
  default WARNING.
- KTD_LOG_ALL_RANKS: "1" lets every rank log and warn (the package's
  logger, Python warnings, other libraries' logging), not only rank 0.
- KTD_FULL_TRACEBACKS: "1" has every failing rank print its whole
  traceback (and torchrun its failure table) instead of the first failure's
  traceback once, without the launcher's frames.
- KTD_PREEMPTION_SIGNALS: the signals that preempt a multi-process `fit`
  (every rank saves its backup at one agreed step and exits with 128 + the
  signal), comma-separated names; default "SIGTERM,SIGUSR1"; "none" leaves
  every signal's own action.
- KTD_PREEMPTION_WAIT: seconds a signalled rank waits for the next step
  boundary before it exits without saving (a peer is gone, a step is
  stuck); default 20 (below torchrun's 30 s shutdown timeout); 0 waits
  forever.
- KTD_SLURM_REQUEUE: "auto" (default) requeues a SLURM job
  (`scontrol requeue`) after a preemption by SIGUSR1; "1" after any
  preemption signal; "0" never.
- KTD_FSDP_GROUP: what one FSDP gather covers: "block" (default) the
  outermost layers below the models (a keras_hub decoder block, a Dense of
  a Sequential), "layer" each layer's own variables.
- KTD_FSDP_PREFETCH: how many FSDP groups' gathers may be in flight ahead
  of the one in use, in forward and in backward; 0 turns prefetch off;
  default 1 on CUDA, 0 on CPU (the caller's default).
- KTD_FAST_OPS: "1" (default) runs the package's faster versions of
  Keras' own torch ops and steps (no copy from the host for a Python
  number, einsum as a matrix product, the cross-entropy on rows; each
  gives Keras' numbers); "0" leaves Keras' own everywhere.
- KTD_FLOAT8_MATMUL: Keras' float8 `Dense` / `EinsumDense` matrix
  products: "auto" (default) as `torch._scaled_mm` on float8 operands where
  the GPU has float8 (CUDA compute capability 8.9 or more; Keras'
  fake-quantized float matmul elsewhere); "0" Keras' fake-quantized matmul
  everywhere; "1" `torch._scaled_mm` wherever torch offers it (the CPU of
  torch>=2.13 too: tests).
- KTD_MAX_RESTARTS: how many times the local processes `initialize()`
  starts are started again after one of them fails (torchrun's
  --max-restarts for them), an integer >= 0; default 0.

A KTD_* variable that names no setting but is close to one (KTD_LOG_LEVL)
is named, with the setting meant (`misspelled`): `ktd run`, `ktd env` and
the package's logger say so once.

Imports nothing from the package, so every module may use it.
"""

import difflib
import logging
import math
import os
import signal

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


def device_request():
    """KTD_DEVICE: "cpu", "cuda" (for gpu or cuda: CUDA is required), or
    None when it is unset (CUDA when it is available)."""
    text = os.environ.get("KTD_DEVICE", "")
    choice = text.strip().lower()
    if choice not in ("", "cpu", "gpu", "cuda"):
        raise ValueError(
            f"KTD_DEVICE={text!r} is not a device choice: set KTD_DEVICE=cpu "
            "to run on CPU processes (gloo) even where CUDA exists, gpu (or "
            "cuda) to require CUDA, or unset it to use CUDA when it is "
            "available."
        )
    return {"": None, "gpu": "cuda"}.get(choice, choice)


def forces_cpu():
    """True when KTD_DEVICE=cpu asks for CPU processes where CUDA exists."""
    return device_request() == "cpu"


def log_level():
    """KTD_LOG_LEVEL as a `logging` level name (default WARNING)."""
    text = os.environ.get("KTD_LOG_LEVEL", "WARNING")
    if text.upper() not in _LOG_LEVELS:
        raise ValueError(
            f"KTD_LOG_LEVEL={text!r} is not a logging level: set one of "
            f"{', '.join(_LOG_LEVELS)} (default WARNING), or unset it."
        )
    return getattr(logging, text.upper())


def _flag(name):
    """A "0"/"1" setting as a bool (unset: False)."""
    text = os.environ.get(name)
    if text is None or text.strip() in ("", "0"):
        return False
    if text.strip() == "1":
        return True
    raise ValueError(
        f"{name}={text!r} is neither 1 (on) nor 0 (off, the default): set one "
        "of those, or unset it."
    )


def log_all_ranks():
    """True when KTD_LOG_ALL_RANKS=1 lets every rank log and warn."""
    return _flag("KTD_LOG_ALL_RANKS")


def full_tracebacks():
    """True when KTD_FULL_TRACEBACKS=1 prints every rank's whole traceback."""
    return _flag("KTD_FULL_TRACEBACKS")


DEFAULT_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
DEFAULT_PREEMPTION_WAIT = 20.0
SLURM_REQUEUE_CHOICES = ("auto", "0", "1")


def preemption_signals():
    """KTD_PREEMPTION_SIGNALS as signal numbers (empty for "none")."""
    text = os.environ.get("KTD_PREEMPTION_SIGNALS")
    if text is None:
        names = DEFAULT_PREEMPTION_SIGNALS
    elif text.strip().lower() == "none":
        return ()
    else:
        names = [n.strip().upper() for n in text.split(",") if n.strip()]
    numbers = []
    for name in names:
        full = name if name.startswith("SIG") else "SIG" + name
        number = getattr(signal, full, None)
        if not isinstance(number, signal.Signals) or full in (
            "SIGKILL",
            "SIGSTOP",
        ):
            raise ValueError(
                f"KTD_PREEMPTION_SIGNALS={text!r}: {name!r} is not a signal a "
                "process can catch. Set comma-separated names such as "
                "SIGTERM,SIGUSR1 (the default), or none to leave every "
                "signal's own action."
            )
        numbers.append(int(number))
    return tuple(numbers)


def preemption_wait():
    """KTD_PREEMPTION_WAIT in seconds (0: wait forever)."""
    text, value = _number("KTD_PREEMPTION_WAIT", float, DEFAULT_PREEMPTION_WAIT)
    if value is None or not 0 <= value <= MAX_TIMEOUT_SECONDS:
        raise ValueError(
            f"KTD_PREEMPTION_WAIT={text!r} is not a number of seconds in "
            f"[0, {MAX_TIMEOUT_SECONDS:.0f}]: it sets how long a signalled "
            "rank waits for the next step boundary before it exits without "
            "saving. Set e.g. 20 (the default), 0 to wait forever, or unset it."
        )
    return value


def slurm_requeue():
    """KTD_SLURM_REQUEUE: "auto" (default), "0" or "1"."""
    text = os.environ.get("KTD_SLURM_REQUEUE", "auto").strip().lower()
    if text not in SLURM_REQUEUE_CHOICES:
        raise ValueError(
            f"KTD_SLURM_REQUEUE={text!r} is not a requeue choice: set auto "
            "(the default: requeue the SLURM job after a preemption by "
            "SIGUSR1), 1 (after any preemption signal) or 0 (never)."
        )
    return text


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


def fast_ops():
    """KTD_FAST_OPS as a bool; True when it is unset."""
    text = os.environ.get("KTD_FAST_OPS")
    if text is None:
        return True
    if text.strip() not in ("0", "1"):
        raise ValueError(
            f"KTD_FAST_OPS={text!r} is neither '1' (the package's faster "
            "versions of Keras' torch ops, with Keras' numbers: the default) "
            "nor '0' (Keras' own ops everywhere). Set one of those, or unset "
            "it."
        )
    return text.strip() == "1"


FLOAT8_MATMUL_CHOICES = ("auto", "0", "1")


def float8_matmul():
    """KTD_FLOAT8_MATMUL: "auto" (default), "0" or "1"."""
    text = os.environ.get("KTD_FLOAT8_MATMUL", "auto")
    if text.strip().lower() not in FLOAT8_MATMUL_CHOICES:
        raise ValueError(
            f"KTD_FLOAT8_MATMUL={text!r} is not a float8 matmul choice: set "
            "auto (the default: torch._scaled_mm on float8 operands where the "
            "GPU has float8, Keras' fake-quantized matmul elsewhere), 0 "
            "(Keras' fake-quantized matmul everywhere) or 1 (torch._scaled_mm "
            "wherever torch offers it), or unset it."
        )
    return text.strip().lower()


def max_restarts():
    """KTD_MAX_RESTARTS as an int >= 0 (default 0)."""
    text, value = _number("KTD_MAX_RESTARTS", int, 0)
    if text is None:
        return value
    if value is None or value < 0:
        raise ValueError(
            f"KTD_MAX_RESTARTS={text!r} is not a number of restarts: set a "
            "whole number >= 0 (how many times the processes that "
            "initialize() starts are started again after one fails or is "
            "preempted; a restart runs the script again, and with "
            "keras.callbacks.BackupAndRestore resumes from its newest backup), "
            "e.g. KTD_MAX_RESTARTS=3, or unset it (0, the default: none)."
        )
    return value


# Every KTD_* setting read here, with its default as `ktd env` shows it.
# (KTD_CLUSTER and KTD_SPAWN are read by `_processes`, which checks them.)
SETTINGS = (
    ("KTD_TIMEOUT_SECONDS", f"{DEFAULT_TIMEOUT_SECONDS:g}", timeout_seconds),
    ("KTD_DEVICE", "CUDA if available", device_request),
    ("KTD_LOG_LEVEL", "WARNING", log_level),
    ("KTD_LOG_ALL_RANKS", "0", log_all_ranks),
    ("KTD_FULL_TRACEBACKS", "0", full_tracebacks),
    ("KTD_MAX_RESTARTS", "0", max_restarts),
    ("KTD_PREEMPTION_SIGNALS", "SIGTERM,SIGUSR1", preemption_signals),
    ("KTD_PREEMPTION_WAIT", f"{DEFAULT_PREEMPTION_WAIT:g}", preemption_wait),
    ("KTD_SLURM_REQUEUE", "auto", slurm_requeue),
    ("KTD_FSDP_GROUP", "block", fsdp_group),
    ("KTD_FSDP_PREFETCH", "1 on CUDA, 0 on CPU", lambda: fsdp_prefetch(0)),
    ("KTD_FAST_OPS", "1", fast_ops),
    ("KTD_FLOAT8_MATMUL", "auto", float8_matmul),
)


# Read elsewhere in the package (`_processes`) and by its tools: not
# misspellings.
OTHER_VARIABLES = (
    "KTD_CLUSTER",
    "KTD_SPAWN",
    "KTD_LAUNCHED",  # set in the processes initialize() starts
    "KTD_PARENT_PID",  # set in every process a launcher starts
    "KTD_TEST_DEVICE",  # tests/
    "KTD_KERAS",  # tools/test-torch
    "KTD_KERAS_HUB",
    "KTD_TORCH_CACHE",
)


def misspelled(environ=None):
    """[(name, the setting it most likely means)] for each KTD_* variable
    of `environ` (default: this process's) that is no setting but close to
    one, e.g. ("KTD_LOG_LEVL", "KTD_LOG_LEVEL")."""
    environ = os.environ if environ is None else environ
    known = [name for name, _, _ in SETTINGS] + list(OTHER_VARIABLES)
    found = []
    for name in sorted(environ):
        if not name.startswith("KTD_") or name in known:
            continue
        if name.startswith("KTD_GPU_CHECK_"):  # tools/gpu-check's own
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            found.append((name, close[0]))
    return found


def misspelled_text(pairs):
    """One sentence naming `misspelled()`'s pairs and the fix."""
    said = ", ".join(f"{name} (did you mean {meant}?)" for name, meant in pairs)
    one = len(pairs) == 1
    return (
        f"{said} {'is' if one else 'are'} no KTD_* setting and "
        f"{'is' if one else 'are'} ignored: rename or unset "
        f"{'it' if one else 'them'} (`ktd env` lists every setting)."
    )


def setting_errors():
    """[(name, error message)] for each setting of `SETTINGS` whose value
    is refused."""
    errors = []
    for name, _, read in SETTINGS:
        try:
            read()
        except ValueError as error:
            errors.append((name, str(error)))
    return errors
