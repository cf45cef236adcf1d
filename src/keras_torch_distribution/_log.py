"""One rank-aware logger for the package: rank 0 speaks, others stay quiet.

Set KTD_LOG_ALL_RANKS=1 to hear every rank; KTD_LOG_LEVEL (default WARNING)
sets the level.
"""

import atexit
import logging
import os
import re
import sys

import torch.distributed as dist

from keras_torch_distribution import _env


def _rank():
    """This process's rank: the running group's, else the launcher's RANK
    (so that messages from before the group starts are not said N times)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    text = os.environ.get("RANK", "0")
    return int(text) if text.isdigit() else 0


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = _rank()
        return (
            record.rank == 0
            or getattr(record, "ktd_every_rank", False)
            or every_rank()
        )


def every_rank():
    """KTD_LOG_ALL_RANKS=1: every rank logs and warns (a bad value, which
    `ktd env` flags and `ktd run` refuses, counts as unset)."""
    try:
        return _env.log_all_ranks()
    except ValueError:
        return False


class _UntilConfigured(logging.StreamHandler):
    """Prints the package's records to stderr while the application has not
    configured logging (the root logger has no handler). Once it has, the
    records reach the application's handlers only: the logger propagates.
    Writes to the `sys.stderr` of the moment, as Python's last-resort
    handler does."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr

    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


logger = logging.getLogger("keras_torch_distribution")
if not logger.filters:
    # On the logger, not a handler: other ranks' records are dropped before
    # any handler sees them, the application's included.
    logger.addFilter(_RankFilter())
    _handler = _UntilConfigured()
    _handler.setFormatter(
        logging.Formatter("[ktd rank %(rank)s] %(levelname)s: %(message)s")
    )
    logger.addHandler(_handler)
    try:
        logger.setLevel(_env.log_level())
    except ValueError as _error:  # `ktd env` flags it; `ktd run` refuses it
        logger.setLevel(logging.WARNING)
        logger.warning("%s Using WARNING.", _error)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KERAS_CALL_CONTEXT = "Exception encountered when calling "


def first_line(message, limit=400):
    """The first line of an exception's message, colours removed. A Keras
    layer error's first line only names the layer that was called; the
    error itself is the next line, which is added. Cut at `limit`
    characters."""
    lines = [
        line.strip()
        for line in _ANSI.sub("", str(message)).splitlines()
        if line.strip()
    ]
    if not lines:
        return ""
    text = lines[0]
    if _KERAS_CALL_CONTEXT in text and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return text if len(text) <= limit else text[:limit] + "..."


def innermost(error):
    """The exception at the end of `error`'s chain of causes (torch and
    Keras wrap the model's own error in theirs)."""
    seen = [error]
    while True:
        inner = seen[-1].__cause__ or seen[-1].__context__
        if inner is None or inner in seen:
            return seen[-1]
        seen.append(inner)


def warn_on_every_rank(message, *args):
    """A warning every rank logs (each rank's view of an event that
    concerns all of them, such as which rank stopped training)."""
    logger.warning(message, *args, extra={"ktd_every_rank": True})


def warn_once(key, message, *args):
    """Warn once per `key` for the life of the process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message, *args)


_warned = set()


# A level just above WARNING, so that notes show at the default level
# (WARNING) and KTD_LOG_LEVEL=ERROR hides them: events a user wants to see
# (a checkpoint saved or restored), which are no warnings.
NOTE = logging.WARNING + 1
logging.addLevelName(NOTE, "NOTE")


def note(message, *args):
    """An event shown at the default level (rank 0): a checkpoint saved or
    restored, with its path, size and seconds."""
    logger.log(NOTE, message, *args)


def human_bytes(n):
    """Bytes with a binary unit: 512 B, 1.50 KiB, 577.3 MiB, 2.00 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def ranks_text(ranks):
    """Ranks as ranges: [0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def grouped(values_by_rank):
    """{rank: value} as [(ranks, value)] of the ranks with equal values,
    in order of their first rank."""
    groups = {}
    for rank in sorted(values_by_rank):
        groups.setdefault(repr(values_by_rank[rank]), []).append(rank)
    return [(ranks, values_by_rank[ranks[0]]) for ranks in groups.values()]


# Findings said once for many variables: key -> [message, args, subjects],
# said at `say_grouped()` (a step's update, evaluate / predict, `ktd plan`'s
# end, the interpreter's exit).
_grouped = {}
_GROUPED_SHOWN = 3  # subjects named in the line; the rest are counted


def warn_grouped(key, subject, message, *args):
    """A warning about `subject` (a variable's path) that many variables
    share: one line for every subject of `key` (`say_grouped`), naming a
    few and counting the rest, optimizer slots apart. Once per (key,
    subject) for the life of the process."""
    if (key, subject) in _warned:
        return
    _warned.add((key, subject))
    if not _grouped:
        atexit.register(say_grouped)
    _grouped.setdefault(key, [message, args, []])[2].append(subject)


def say_grouped():
    """Say the pending grouped warnings, one line per key."""
    while _grouped:
        message, args, subjects = _grouped.pop(next(iter(_grouped)))
        logger.warning("%s: " + message, subjects_text(subjects), *args)


def subjects_text(paths):
    """ "variable 'a/kernel'", or "14 variables ('b0/kernel', 'b1/kernel',
    'b2/kernel', ... 11 more) and their 28 optimizer slots". A slot is a
    path whose last part is another path's, "/" made "_", then "_<slot>"
    (Keras' names for optimizer variables)."""
    flat = {p.replace("/", "_") + "_" for p in paths}
    slots = [
        p for p in paths if any(p.split("/")[-1].startswith(f) for f in flat)
    ]
    variables = [p for p in paths if p not in slots] or slots
    if len(paths) == 1:
        return f"variable {paths[0]!r}"
    named = ", ".join(repr(p) for p in variables[:_GROUPED_SHOWN])
    if len(variables) > _GROUPED_SHOWN:
        named += f", ... {len(variables) - _GROUPED_SHOWN} more"
    plural = "s" if len(variables) > 1 else ""
    text = f"{len(variables)} variable{plural} ({named})"
    if variables is not slots and slots:
        text += f" and their {len(slots)} optimizer slots"
    return text
