"""Preemption signals: the handler only takes note; a watchdog bounds the
wait for the next step boundary.

`catch()` (the start of a multi-process `fit`, main thread) replaces the
handlers of KTD_PREEMPTION_SIGNALS (default SIGTERM, SIGUSR1) with one that
records the first signal and its time, and nothing else: saving inside a
signal handler can deadlock (the main thread may be inside a collective or
holding a lock). `release()` puts the previous handlers back.

A Python handler runs only when the main thread returns to the
interpreter; a main thread blocked in a collective whose peer is gone
never does. So the signal also reaches a watchdog thread through
`signal.set_wakeup_fd` (CPython writes each signal's number to that pipe
from its C-level handler, whichever thread the kernel picked): if no step
boundary is reached within KTD_PREEMPTION_WAIT seconds of the signal, the
watchdog logs one line and ends the process with 128 + the signal, without
saving (torchrun would SIGKILL it after its own 30 s anyway).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from keras_torch_distribution import _env
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import warn_once


class Preempted(SystemExit):
    """Raised on every rank after a preemption signal: the ranks agreed on
    a step, wrote their backup there, and the process exits with
    `code` = 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1),
    as a process killed by that signal would be reported by a shell, so
    that schedulers and torchrun see a retryable failure."""

    def __init__(self, signal_number: int, message: str) -> None:
        super().__init__(128 + signal_number)
        self.signal_number = signal_number
        self.message = message

    def __str__(self) -> str:
        return self.message


def signal_name(number: int) -> str:
    """ "SIGTERM" for 15."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _State:
    """The signals caught, the first one received, the watchdog."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.previous = {}  # signal number -> the handler before catch()
        self.previous_wakeup_fd = None
        self.pipe = None  # (read fd, write fd) of the wakeup pipe
        self.watchdog = None
        self.received = 0  # the first preemption signal's number
        self.received_at = None  # its time.monotonic()
        self.boundary = threading.Event()  # set when a boundary is reached
        self.wait = _env.DEFAULT_PREEMPTION_WAIT


state = _State()


def catch() -> bool:
    """Take note of KTD_PREEMPTION_SIGNALS from now on; True when caught
    (False: none configured, or not the main thread, with a warning)."""
    numbers = _env.preemption_signals()
    wait = _env.preemption_wait()
    if not numbers or state.previous:
        return bool(state.previous)
    if threading.current_thread() is not threading.main_thread():
        warn_once(
            "preemption-not-main-thread",
            "fit() runs outside the main thread, where signal handlers cannot "
            "be set: a preemption signal (%s) ends this process at once, "
            "without a backup at the step it reached. Call fit() from the "
            "main thread to have preemptions saved.",
            ", ".join(signal_name(n) for n in numbers),
        )
        return False
    state.received = 0
    state.received_at = None
    state.boundary = threading.Event()
    state.wait = wait
    for number in numbers:
        state.previous[number] = signal.signal(number, _take_note)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    state.pipe = (read_fd, write_fd)
    state.previous_wakeup_fd = signal.set_wakeup_fd(
        write_fd, warn_on_full_buffer=False
    )
    state.watchdog = threading.Thread(
        target=_watch,
        args=(read_fd, frozenset(numbers), state.boundary, wait),
        name="ktd-preemption-watchdog",
        daemon=True,
    )
    state.watchdog.start()
    return True


def release() -> None:
    """Put back the handlers `catch()` replaced; stop the watchdog."""
    if not state.previous:
        return
    for number, handler in state.previous.items():
        signal.signal(number, handler)
    signal.set_wakeup_fd(state.previous_wakeup_fd)
    state.boundary.set()  # a watchdog waiting for a boundary stops waiting
    read_fd, write_fd = state.pipe
    os.close(write_fd)  # the watchdog's read returns b"": it ends
    state.watchdog.join(timeout=5)
    os.close(read_fd)
    received = state.received
    state.clear()
    if received:
        logger.info(
            "%s arrived after the last step boundary of fit(): fit() "
            "completed, and the signal is not acted on.",
            signal_name(received),
        )


def received() -> int:
    """The first preemption signal's number since `catch()`, or 0."""
    return state.received


def seconds_since_signal() -> float:
    return time.monotonic() - state.received_at if state.received_at else 0.0


def boundary_reached() -> None:
    """This rank reached the agreed step boundary: the watchdog stands
    down (the save that follows is bounded by the collectives' timeout)."""
    state.boundary.set()


def _note(number):
    if not state.received:
        state.received = number
        state.received_at = time.monotonic()


def _take_note(number, frame):
    """The handler: note the first signal, nothing else."""
    del frame
    _note(number)


def _watch(read_fd, numbers, boundary, wait):
    """The watchdog thread: read signal numbers from the wakeup pipe; after
    the first preemption signal, wait for the boundary."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return  # release() closed the pipe
        hits = [n for n in data if n in numbers]
        if hits:
            break
    _note(hits[0])
    if wait == 0 or boundary.wait(wait):
        return
    code = 128 + state.received
    logger.error(
        "%s received %.0f s ago, and this rank reached no step boundary since "
        "(a peer is gone, or a step is stuck): exiting with %d without saving. "
        "The next start resumes from the newest complete backup. Set "
        "KTD_PREEMPTION_WAIT to wait longer (0: forever).",
        signal_name(state.received),
        wait,
        code,
        extra={"ktd_every_rank": True},
    )
    sys.stderr.flush()
    os._exit(code)
