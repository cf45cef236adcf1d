"""A node whose torchrun agent cannot reach the rendezvous store ends anyway.

torchrun's agent reads its rendezvous store (hosted by the rendezvous
endpoint's node) every monitoring round. When that host dies or this host
is cut off from it, the read blocks for the store's timeout, the agent's
shutdown reads again, and the node's `ktd run` only ends minutes later
(measured: 390 s and 595 s), long after its ranks failed: the agent has not
even reaped them. `Watch` (a thread of `ktd run`) sees a rank of this node
that exited with an error and stays unreaped for `GRACE_SECONDS` (a
working agent reaps within its monitoring interval, 0.1 s), says so in one
line with the rank's own error, stops this node's other ranks (SIGTERM,
then SIGKILL) and ends `ktd run` with exit code 1. Only children seen
alive as ranks (TORCHELASTIC_RUN_ID in their environment) count.
"""

import json
import os
import signal
import sys
import threading
import time

from keras_torch_distribution._log import first_line

GRACE_SECONDS = 4.0
POLL_SECONDS = 0.25
STOP_SECONDS = 3.0
_EXIT_CODE = 1


class Watch(threading.Thread):
    def __init__(self, endpoint):
        super().__init__(name="ktd-stuck-agent", daemon=True)
        self.endpoint = endpoint  # the rendezvous endpoint, for the message
        self._stopped = threading.Event()
        self._ranks = {}  # child pid -> (RANK, LOCAL_RANK, error file)

    def stop(self):
        self._stopped.set()

    def run(self):
        failed_since = {}  # pid -> when it was first seen failed, unreaped
        while not self._stopped.wait(POLL_SECONDS):
            self._note_children()
            for pid in self._workers():
                code = _exited(pid)
                if not code:  # running, reaped, or a success (reaped soon)
                    failed_since.pop(pid, None)
                    continue
                since = failed_since.setdefault(pid, time.monotonic())
                if time.monotonic() - since >= GRACE_SECONDS:
                    self._end(pid, code)

    def _workers(self):
        """Pids of the children seen alive as torchrun's ranks."""
        return [pid for pid, (rank, _, _) in self._ranks.items() if rank != "?"]

    def _note_children(self):
        """Remember the children of now (a reaped one is forgotten: its pid
        may come back as another process)."""
        noted = {}
        for pid in _children():
            known = self._ranks.get(pid)
            if known is None or (known[0] == "?" and _running(pid)):
                known = _rank_of(pid)  # (again: read before its exec)
            noted[pid] = known
        self._ranks = noted

    def _end(self, pid, code):
        rank, local_rank, error_file = self._ranks[pid]
        said = _recorded_error(error_file)
        sys.stderr.write(
            f"ktd run: rank {rank} (local rank {local_rank}) failed, "
            f"{_how(code)}{': ' + said if said else ''}. torchrun's agent on "
            f"this node has not stopped it for {GRACE_SECONDS:g} s: it waits "
            f"on the rendezvous store at {self.endpoint}, which this host "
            "cannot reach (that host is lost, or this one is cut off). "
            "Stopping this node's processes.\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        alive = [p for p in _children() if p != pid]
        for other in alive:
            _signal(other, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        while time.monotonic() < deadline and any(_running(p) for p in alive):
            time.sleep(0.1)
        for other in alive:
            _signal(other, signal.SIGKILL)
        os._exit(_EXIT_CODE)  # the agent's threads are stuck in the store


def _children():
    """This process's child pids (every thread's: the agent starts them)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found.extend(int(pid) for pid in f.read().split())
        except FileNotFoundError:  # (a thread that just ended)
            continue
    return found


def _exited(pid):
    """The exit code (or -signal) of child `pid` if it exited and is not yet
    reaped (it stays so: WNOWAIT), else None."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # (reaped meanwhile)
        return None
    if info is None or info.si_pid == 0:
        return None
    exited = info.si_code == os.CLD_EXITED
    return info.si_status if exited else -info.si_status


def _rank_of(pid):
    """(RANK, LOCAL_RANK, TORCHELASTIC_ERROR_FILE) of a child, from its
    environment ("?" where it cannot be read, or it is not a rank: no
    TORCHELASTIC_RUN_ID)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return "?", "?", None
    env = dict(
        pair.decode(errors="replace").split("=", 1)
        for pair in pairs
        if b"=" in pair
    )
    if "TORCHELASTIC_RUN_ID" not in env:
        return "?", "?", None
    return (
        env.get("RANK", "?"),
        env.get("LOCAL_RANK", "?"),
        env.get("TORCHELASTIC_ERROR_FILE"),
    )


def _recorded_error(path):
    """The first line of the exception a rank recorded, or ""."""
    if not path:
        return ""
    try:
        with open(path) as f:
            message = json.load(f).get("message", {})
    except (OSError, ValueError):
        return ""
    if isinstance(message, dict):
        message = message.get("message", "")
    return first_line(str(message), 400)


def _how(code):
    if code >= 0:
        return f"exit code {code}"
    return f"killed by {signal.Signals(-code).name}"


def _signal(pid, number):
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
