"""Rank 0 speaks for the job: the package's rank-aware logger, Python
warnings, other libraries' logging and `rank_zero_print`.

- The package's logger: rank 0 only; records propagate to the
  application's handlers, and keep their `[ktd rank N]` prefix there too
  (`_RankPrefix`), even after another library's `logging.basicConfig`.
- Python warnings: shown by rank 0 only, and a warning raised inside the
  package (a Keras warning under the patch table's frames) is shown at the
  user's line (`_show_warning`).
- Other libraries' logging: on the other ranks the root logger's level is
  ERROR while nobody configured it (`quiet_other_ranks`).

KTD_LOG_ALL_RANKS=1 hears every rank; KTD_LOG_LEVEL (default WARNING) sets
the package logger's level.
"""

import atexit
import builtins
import logging
import os
import re
import sys
import warnings

from keras_torch_distribution import _env


def _rank():
    """This process's rank: the running group's, else the launcher's RANK
    (so that messages from before the group starts are not said N times).
    (torch.distributed is not imported here: `ktd run` uses this module
    before torch is imported, and no group runs before it is.)"""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
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
        handlers = logging.getLogger().handlers
        if not handlers:
            super().emit(record)
        for handler in handlers:  # the application's: they print the record
            if not isinstance(handler.formatter, _RankPrefix):
                handler.setFormatter(_RankPrefix(handler.formatter))


class _RankPrefix(logging.Formatter):
    """An application's formatter, with `[ktd rank N] ` before the package
    logger's records (and nothing changed for any other record)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record):
        ours = record.name.startswith(logger.name) and hasattr(record, "rank")
        if ours and getattr(self.inner, "_fmt", None) == logging.BASIC_FORMAT:
            # `logging.basicConfig()`'s "WARNING:name:" (a library's, absl's
            # or grain's, more often than the application's): the package's
            # own format instead of a second prefix.
            return _OWN_FORMAT.format(record)
        text = self.inner.format(record)
        return f"[ktd rank {record.rank}] {text}" if ours else text

    def __getattr__(self, name):  # the inner formatter's own attributes
        if name == "inner":  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)


_OWN_FORMAT = logging.Formatter(
    "[ktd rank %(rank)s] %(levelname)s: %(message)s"
)
logger = logging.getLogger("keras_torch_distribution")
if not logger.filters:
    # On the logger, not a handler: other ranks' records are dropped before
    # any handler sees them, the application's included.
    logger.addFilter(_RankFilter())
    _handler = _UntilConfigured()
    _handler.setFormatter(_OWN_FORMAT)
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


def warn_misspelled_settings():
    """Once: KTD_* variables that look like a setting but are none
    (KTD_LOG_LEVL), said when a job starts in processes that torchrun or
    Python started; a launcher of the package (KTD_PARENT_PID set) said it
    already, once for the job."""
    found = _env.misspelled()
    if found and "KTD_PARENT_PID" not in os.environ:
        warn_once(
            ("misspelled", tuple(found)), "%s", _env.misspelled_text(found)
        )


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


def rank_ranges(ranks):
    """Ordered ranks as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def ranks_text(ranks):
    """Ranks as ranges: [0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


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
_said_at_exit = []  # say_grouped, once registered with atexit
_GROUPED_SHOWN = 3  # subjects named in the line; the rest are counted


def warn_grouped(key, subject, message, *args):
    """A warning about `subject` (a variable's path) that many variables
    share: one line for every subject of `key` (`say_grouped`), naming a
    few and counting the rest, optimizer slots apart. Once per (key,
    subject) for the life of the process."""
    if (key, subject) in _warned:
        return
    _warned.add((key, subject))
    if not _said_at_exit:
        _said_at_exit.append(atexit.register(say_grouped))
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


# ---------------------------------------------------------------------------
# Python warnings, other libraries' logging, print: once per job
# ---------------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_KERAS_SRC = os.path.join("keras", "src") + os.sep


def _user_frame():
    """(filename, line number) of the innermost frame outside this package,
    Keras, torch and the warnings machinery: the user's line."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (
            name.startswith(_PACKAGE_DIR)
            or _KERAS_SRC in name
            or os.sep + "torch" + os.sep in name
            or name.endswith("warnings.py")
            or name.startswith("<frozen")
        ):
            return name, frame.f_lineno
        frame = frame.f_back
    return None


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """`warnings.showwarning` for the package: other ranks show nothing
    (unless KTD_LOG_ALL_RANKS=1), and a warning attributed to a line of
    this package is shown at the user's line instead."""
    if _rank() != 0 and not every_rank():
        return
    if filename.startswith(_PACKAGE_DIR):
        found = _user_frame()
        if found is not None:
            filename, lineno = found
            line = None
    _shown_by(message, category, filename, lineno, file, line)


_shown_by = warnings.showwarning
if getattr(warnings.showwarning, "__name__", "") != _show_warning.__name__:
    warnings.showwarning = _show_warning


def hide_expected_warnings():
    """Filter out warnings about what the package does on purpose: torch's
    when a one-element plain tensor meets a DTensor (a Dense(1)'s bias
    beside a row-parallel output), which the package treats as replicated
    (DTensor's implicit replication)."""
    warnings.filterwarnings(
        "ignore",
        message="Found a non-scalar tensor with numel=1 and ndim!=0, we are "
        "implicitly creating a replicated DTensor",
        category=UserWarning,
    )


hide_expected_warnings()


# Loggers that print through handlers of their own instead of the root
# logger's (torch sets up "torch" so): quieted on the other ranks as the
# root logger is, while they keep torch's default level.
_OWN_HANDLER_LOGGERS = ("torch",)


def quiet_other_ranks():
    """On a rank other than 0, raise the root logger's level to ERROR while
    nobody has configured it (no handler, level WARNING), and torch's
    logger's (it prints through a handler of its own) while it keeps its
    default level: other libraries' warnings and info, torch's notices
    ("CPU process group does not support alltoall yet") among them, are then
    said once per job, by rank 0. Nothing with KTD_LOG_ALL_RANKS=1."""
    root = logging.getLogger()
    if _rank() == 0 or every_rank():
        return
    if not root.handlers and root.level == logging.WARNING:
        root.setLevel(logging.ERROR)
    for name in _OWN_HANDLER_LOGGERS:
        own = logging.getLogger(name)
        if own.level in (logging.NOTSET, logging.WARNING):
            own.setLevel(logging.ERROR)


def rank_zero_print(*args, **kwargs):
    """`print`, on rank 0 only: said once per job however many processes
    run it (the other ranks print nothing), as Lightning's
    `rank_zero_info` and Accelerate's `accelerator.print`. Takes `print`'s
    arguments. Rank 0 is the process group's, or torchrun's RANK before
    the group starts."""
    if _rank() == 0:
        builtins.print(*args, **kwargs)
