"""Why a launch failed, said once for the job (`failure_report`): the
traceback of the process that failed first (without the launcher's frames),
one line for each other process, and the one line naming the process that
failed first (or was preempted: it exited with 128 + SIGTERM or SIGUSR1,
resumable). Every process's whole traceback goes to a file.

Used by `ktd run` and by the local processes `initialize()` starts (both
run torch's elastic agent, whose `ChildFailedError.failures` this reads;
each process records its exception as `launch._record` writes it).
"""

import contextlib
import logging
import os
import re
import signal
import tempfile
import time

from keras_torch_distribution._log import first_line

# Words of errors a rank raises when a peer went away, not a cause of its own
# (gloo, NCCL, and the TCP store).
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"remote process exited|ECONNRESET|EPIPE|failed to recv, got 0 bytes",
    re.IGNORECASE,
)
# Signals sent from outside the process (a person, a scheduler, the kernel's
# out-of-memory killer), as opposed to a crash in native code.
_KILL_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Signals that name their own cause: what it was and what to do.
_SIGNAL_CAUSES = {
    "SIGXFSZ": (
        "The file-size limit (`ulimit -f`) was hit while it wrote a file (a "
        "checkpoint, a log): raise or lift that limit, or write less, e.g. to "
        "another directory."
    ),
    "SIGXCPU": (
        "Its CPU-time limit (`ulimit -t`, or a scheduler's) ran out: raise the "
        "limit."
    ),
    "SIGBUS": (
        "Memory it had mapped went away: shared memory or a memory-mapped file "
        "was full or truncated, most often /dev/shm (a container's small "
        "--shm-size; see `df -h /dev/shm`)."
    ),
    "SIGABRT": (
        "Native code aborted it (a failed C++ check, or `terminate called "
        "...`); its last output above says why."
    ),
    "SIGILL": (
        "It ran an instruction this CPU lacks (a library built for another "
        "CPU) or hit a failed native check."
    ),
    "SIGUSR1": (
        "SIGUSR1 is SLURM's warning before a job's end (`--signal=USR1@N`) or "
        "a `kill -USR1`; nothing in the rank handled it, so it ended."
    ),
}
# A rank that stops on one of these signals exits with 128 + its number (as
# a shell reports a signal's end): 143, 138. Its job is resumable.
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
# How each launcher restarts its processes after one fails.
_RESTARTS = {
    "ktd run": "`ktd run --max-restarts N`",
    "keras.distribution.initialize()": "KTD_MAX_RESTARTS=N",
}
_NO_ERROR_FILE = "<N/A>"  # torchrun's ProcessFailure.error_file without one
_MAX_CAUSE_CHARS = 400


def first_failure(failures):
    """(rank, failure) of the rank that most likely failed first.

    torchrun orders failures by whole seconds (a tie goes to the rank it
    saw first) and also lists the ranks it stopped itself (by SIGTERM, after
    the first failure). So a rank that failed only because its peer died (a
    broken connection) can look first. Order: ranks that failed for a
    reason of their own (an exception, a signal) before ranks that lost a
    peer; then the earliest second; in a tie, ranks that torchrun may have
    stopped (SIGTERM, nothing recorded) last, then the earliest by the time
    `launch._record` wrote (to the microsecond).
    """

    def order(rank):
        failure = failures[rank]
        exception = _exception(failure)
        lost_peer = bool(exception and _LOST_PEER.search(exception))
        maybe_stopped = exception is None and failure.exitcode in (
            -signal.SIGTERM,
            128 + signal.SIGTERM,  # stopped, by a rank that handles SIGTERM
        )
        at = _failed_at(failure)
        return (lost_peer, int(at), maybe_stopped, at, rank)

    rank = min(failures, key=order)
    return rank, failures[rank]


def failure_summary(failures, launcher="ktd run"):
    """The last line `ktd run` (or `launcher`) prints when ranks failed:
    which rank failed first, and its exception's type and first line (or
    its signal and what that signal means)."""
    rank, failure = first_failure(failures)
    who = f"{launcher}: rank {rank} (local rank {failure.local_rank})"
    exception = _exception(failure)
    exitcode = exit_code(failure)
    if _exited(failure):
        said = _exit_words(failure)
        ends = _others(failures, rank, "did the same")
        return (
            f"{who} exited first with code {exitcode} ({said}). {ends}".rstrip()
        )
    preempted_by = preemption_signal(exitcode)
    if preempted_by is not None:
        return _preempted(who, exitcode, preempted_by, exception, launcher)
    if exception is None and exitcode < 0:
        signal_name = failure.signal_name()
        return (
            f"{who} died first, by signal {signal_name} (exit code "
            f"{exitcode}). {signal_meaning(signal_name)} torchrun "
            "stopped the other processes."
        )
    if exception is None:
        return (
            f"{who} failed first, exit code {exitcode}, without a "
            "Python exception on record (it called sys.exit or os._exit, or a "
            "library ended the process); its output is above. torchrun stopped "
            "the other processes."
        )
    lost_peer = (
        " It lost its connection to another rank, which most likely died "
        "without a record (killed, or out of memory)."
        if _LOST_PEER.search(exception)
        else ""
    )
    return (
        f"{who} failed first, {_exit_code_words(failure, exitcode)}: "
        f"{_cause(exception)}{lost_peer} "
        + _others(failures, rank, "raised the same error", traceback=True)
    )


def _others(failures, first_rank, same, traceback=False):
    """The end of the summary: what the other ranks did (every other failed
    rank as the first one did: `same`, not torchrun's stop; none failed:
    nothing), and with `traceback`, whose traceback is above."""
    others = [r for r in failures if r != first_rank]
    if others and all(_same(failures[r], failures[first_rank]) for r in others):
        said = f"Every other rank ({_rank_list(others)}) {same}"
        return said + (
            f"; the traceback above is rank {first_rank}'s."
            if traceback
            else "."
        )
    if not others:  # the other ranks had ended (or there are none)
        return "Its traceback is above." if traceback else ""
    return "torchrun stopped the other processes" + (
        "; that rank's traceback is above." if traceback else "."
    )


def _rank_list(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(
        map(str, ranks)
    )


def _same(failure, first):
    """Whether a rank failed as the first one did: the same exception, or
    the same `sys.exit` code."""
    exception = _exception(failure)
    return exception is not None and exception == _exception(first)


def _exited(failure):
    """Whether the rank ended by `sys.exit` with a code that is not 0
    (`launch._record.record_exit`)."""
    return "ktd_exit_at" in _extra(failure)


def _exit_words(failure):
    where = _extra(failure).get("ktd_exit_at")
    return f"sys.exit at {where}" if where else "sys.exit"


def launcher_exit_code(failures):
    """The exit status a launcher gives for these failed ranks: the code
    the first one chose (sys.exit(3) gives 3), or 1 (a signal, or an
    unknown code)."""
    code = exit_code(first_failure(failures)[1])
    return code if code > 0 else 1


def exit_code(failure):
    """The exit code a failed rank chose: the one `launch._record` wrote
    beside its exception, else the one torchrun saw. (torchrun stops the
    other ranks once one has exited; a rank stopped while it was still
    exiting after it raised shows torchrun's signal, which is no cause.)"""
    recorded = _extra(failure).get("ktd_exitcode")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    return failure.exitcode


def _exit_code_words(failure, exitcode):
    """ "exit code 1", or why it is unknown: a rank that raised without
    saying its code (an error file torch's own `record` wrote) and was
    stopped by torchrun before it exited."""
    if exitcode > 0:
        return f"exit code {exitcode}"
    how = f"by {failure.signal_name()}" if exitcode < 0 else f"({exitcode})"
    return f"exit code unknown (torchrun stopped it {how} after it raised)"


def preemption_signal(exitcode):
    """ "SIGTERM" or "SIGUSR1" for a rank that exited with 128 + that
    signal's number (143, 138: it stopped on a preemption signal), else
    None."""
    for name in _PREEMPTION_SIGNALS:
        if exitcode == 128 + getattr(signal, name):
            return name
    return None


def _preempted(who, exitcode, signal_name, exception, launcher):
    """The summary for a rank that stopped on a preemption signal."""
    said = f": {_cause(exception)}" if exception else "."
    restarts = _RESTARTS.get(launcher, "torchrun's --max-restarts N")
    return (
        f"{who} was preempted by {signal_name} (exit code "
        f"{exitcode}){said} It is resumable: relaunch the job, or "
        f"use {restarts} to restart it in place (keras.callbacks."
        "BackupAndRestore resumes from its newest backup)."
    )


def signal_meaning(signal_name):
    """What a process killed by `signal_name` ("SIGKILL") most likely met."""
    if signal_name in _SIGNAL_CAUSES:
        return f"{_SIGNAL_CAUSES[signal_name]} It left no traceback."
    if signal_name in _KILL_SIGNALS:
        return (
            "It was killed from outside Python (the kernel's out-of-memory "
            "killer: see `dmesg`; a scheduler's time or memory limit; or "
            "`kill`), so it left no traceback."
        )
    return (
        "That is a crash in native code, not a Python exception, so it left no "
        "Python traceback; its last output above may say why."
    )


def failure_report(failures, launcher="ktd run", full_tracebacks=False):
    """What a launcher prints when ranks failed: the first failure's short
    traceback, one line per other rank, where every rank's whole traceback
    was written, and last `failure_summary`. With `full_tracebacks`, every
    rank printed its own whole traceback already: the summary alone."""
    summary = failure_summary(failures, launcher)
    if full_tracebacks:
        return summary
    first_rank, first = first_failure(failures)
    lines = []
    short = _extra(first).get("ktd_traceback")
    if short:
        lines.append(f"rank {first_rank}: {short.rstrip()}")
    for rank in sorted(failures):
        if rank != first_rank:
            lines.append(
                f"rank {rank}: {_other(failures[rank], first_rank, first)}"
            )
    path = _write_tracebacks(failures)
    if path is not None:
        lines.append(
            f"{launcher}: every rank's whole traceback is in {path} "
            "(KTD_FULL_TRACEBACKS=1 prints them instead)."
        )
    lines.append(summary)
    return "\n".join(lines)


@contextlib.contextmanager
def quiet_agent_logs(quiet=True):
    """Hide torch's elastic agent's own log lines ("Sending process ...
    closing signal SIGTERM", "failed (exitcode: 1)", its failure table's
    notes) while it runs, unless `quiet` is False: `failure_report` says
    what they say, once. torch sets each of its loggers' level itself, so
    each is set here (and restored)."""
    if not quiet:
        yield
        return
    import torch.distributed.elastic.agent.server.api  # noqa: F401
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
    import torch.distributed.run  # noqa: F401

    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(
            ("torch.distributed.elastic", "torch.distributed.run")
        )
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _other(failure, first_rank, first):
    """The line for a rank that did not fail first."""
    exception = _exception(failure)
    stopped = (-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM)
    if exception is None:
        if failure.exitcode in stopped:  # 143: it handled the SIGTERM
            return f"stopped by the launcher after rank {first_rank} failed."
        if failure.exitcode < 0:
            return (
                f"died by signal {failure.signal_name()}. "
                f"{signal_meaning(failure.signal_name())}"
            )
        return f"exit code {failure.exitcode}, no Python exception on record."
    if exception == _exception(first):
        return "same exit." if _exited(failure) else "same error."
    if _exited(failure):
        code, said = exit_code(failure), _exit_words(failure)
        return f"exited with code {code} ({said})."
    if _LOST_PEER.search(exception):
        return f"lost its connection to a failed rank: {_cause(exception)}"
    return _cause(exception)


def _write_tracebacks(failures):
    """Write every failed rank's whole traceback to a file; its path, or
    None when no rank recorded one."""
    parts = []
    for rank in sorted(failures):
        callstack = _extra(failures[rank]).get("py_callstack")
        if callstack:
            parts.append(f"=== rank {rank} ===\n{callstack.rstrip()}\n")
    if not parts:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    handle, path = tempfile.mkstemp(
        prefix=f"{_FAILURE_FILE_PREFIX}{stamp}-", suffix=".txt", text=True
    )
    with os.fdopen(handle, "w") as file:
        file.write("\n".join(parts))
    _remove_old_failure_files(os.path.dirname(path))
    return path


_FAILURE_FILE_PREFIX = "ktd-failure-"
# Failure files kept in the temporary directory: the newest, this user's.
KEPT_FAILURE_FILES = 10


def _remove_old_failure_files(directory):
    """Remove this user's failure files in `directory` but the newest
    KEPT_FAILURE_FILES (a file another process removes meanwhile is no
    error)."""
    ours = []
    for entry in os.scandir(directory):
        if not (
            entry.name.startswith(_FAILURE_FILE_PREFIX)
            and entry.name.endswith(".txt")
        ):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if entry.is_file(follow_symlinks=False) and info.st_uid == os.getuid():
            ours.append((info.st_mtime, entry.path))
    for _, old in sorted(ours, reverse=True)[KEPT_FAILURE_FILES:]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(old)


def _extra(failure):
    """The extra fields of a rank's error file (`launch._record`'s), or {}."""
    message = getattr(failure, "message", None)
    if isinstance(message, dict) and isinstance(message.get("extraInfo"), dict):
        return message["extraInfo"]
    return {}


def _failed_at(failure):
    """When the rank failed: `launch._record`'s time to the microsecond, or
    torchrun's whole second."""
    try:
        return float(_extra(failure)["ktd_time"])
    except (KeyError, TypeError, ValueError):
        return float(failure.timestamp)


def _exception(failure):
    """The exception text a rank recorded in its error file (our `record`
    wrapper writes one), or None when it recorded none (killed by a signal,
    or exited without an exception)."""
    if failure.error_file == _NO_ERROR_FILE:
        return None
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message)


def _cause(message):
    """ "Type: first line" of a recorded exception (`_log.first_line`)."""
    cause = first_line(message, _MAX_CAUSE_CHARS)
    if not cause:
        return "an exception without a message."
    return cause if cause.endswith((".", "...")) else cause + "."
