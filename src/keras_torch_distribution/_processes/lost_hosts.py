"""Which hosts a failed collective lost, said in one line.

When a host dies or is cut off, the other hosts' ranks fail in the
collective they wait in, with gloo's words: `Timed out waiting 60000ms for
recv operation`, `Connection closed by peer [10.0.0.2]:41234`. `explain`
turns that into the hosts and ranks lost: every rank that failed writes its
name on the rendezvous store and waits `ROLL_CALL_SECONDS`; the ranks whose
names are missing are lost, named with their hosts (the table every rank
keeps from the start: `remember`). Where the store itself does not answer,
the host that holds it (the coordinator's) is the one lost, seen from here.
"""

import re
import threading
import time

# How long a failed rank waits for the other survivors to sign the roll.
ROLL_CALL_SECONDS = 3.0
_PREFIX = "ktd/alive/"
# gloo's words for a peer that stopped answering or went away.
_LOST = re.compile(
    r"Timed out waiting \d+ms for (recv|send)|Connection closed by peer|"
    r"Connection reset by peer|Broken pipe|ECONNRESET|EPIPE|"
    r"failed to recv, got 0 bytes|Connection refused",
    re.IGNORECASE,
)


class Table:
    """Each rank's host (name and address), the rendezvous store, and the
    coordinator's host: what `explain` needs after a failure."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.store = None
        self.rank = 0
        self.hosts = []  # rank -> (name, address)
        self.on_coordinator = []  # rank -> on the coordinator's host
        self.coordinator = ""

    def remember(self, store, rank, facts, coordinator):
        """`facts`: each rank's (host name, address, on the coordinator's
        host), `interfaces.host_facts`; `coordinator`: "host:port"."""
        self.store, self.rank = store, rank
        self.hosts = [(name, address) for name, address, _ in facts]
        self.on_coordinator = [on for _, _, on in facts]
        self.coordinator = coordinator


table = Table()


def is_lost_peer(error):
    """Whether `error` is a collective's or the store's on a peer that went
    away (a closed connection, a timed-out receive)."""
    return bool(_LOST.search(str(error)))


def explain(error):
    """One line naming the hosts and ranks `error` lost, or None when it is
    not a lost peer, or the job runs on one host (or no table is kept)."""
    if not table.hosts or not _LOST.search(str(error)):
        return None
    if len({name for name, _ in table.hosts}) < 2:
        return None
    me = table.rank
    missing = _roll_call(table.store, me, len(table.hosts))
    if missing is None:  # the store does not answer
        coordinator_ranks = [
            rank for rank, on in enumerate(table.on_coordinator) if on
        ]
        return (
            f"rank {me} lost the coordinator's host: "
            f"{_hosts(coordinator_ranks)} (it holds the rendezvous store at "
            f"{table.coordinator}, which does not answer either): that host "
            f"died or this host is cut off from it. ({_first_line(error)})"
        )
    if not missing:
        return None
    return (
        f"rank {me} lost {_hosts(missing)}: stopped answering and did not "
        "sign in on the rendezvous store within "
        f"{ROLL_CALL_SECONDS:g} s (a host that died or was cut off; a "
        "process that died). "
        f"({_first_line(error)})"
    )


def _roll_call(store, me, world):
    """The ranks that did not sign in within ROLL_CALL_SECONDS, or None
    when the store does not answer. Runs in a thread given up on after a
    bound: a store whose host is gone can block a read for its whole
    timeout (the innermost store's, which set_timeout on a PrefixStore
    does not change)."""
    answer = {}

    def call():
        try:
            store.set(f"{_PREFIX}{me}", "1")
            time.sleep(ROLL_CALL_SECONDS)
            answer["missing"] = [
                rank
                for rank in range(world)
                if not store.check([f"{_PREFIX}{rank}"])
            ]
        except (RuntimeError, TimeoutError, ValueError) as error:
            answer["error"] = error  # the store is gone: said by the caller

    thread = threading.Thread(target=call, name="ktd-roll-call", daemon=True)
    thread.start()
    thread.join(2 * ROLL_CALL_SECONDS)
    return answer.get("missing")


def _hosts(ranks):
    """ "host node-h2 (10.0.0.2: ranks 2, 3)" for a host all of whose ranks
    are in `ranks`, "rank 3 on host node-h2 (10.0.0.2)" for one of some."""
    by_host = {}
    for rank in ranks:
        by_host.setdefault(table.hosts[rank], []).append(rank)
    parts = []
    for (name, address), found in by_host.items():
        where = address or "address unknown"
        every = [r for r, host in enumerate(table.hosts) if host[0] == name]
        listed = ", ".join(map(str, found))
        if found == every:
            s = "s" if len(found) > 1 else ""
            parts.append(f"host {name} ({where}: rank{s} {listed})")
        else:
            s = "s" if len(found) > 1 else ""
            parts.append(f"rank{s} {listed} on host {name} ({where})")
    return "; ".join(parts)


def _first_line(error):
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
