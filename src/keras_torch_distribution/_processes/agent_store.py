"""A fresh key space on torchrun's store for each start of the processes.

Under torchrun (and `ktd run`, and the processes `initialize()` starts),
the processes' store is a TCPStore server that the elastic agent hosts
(TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR:MASTER_PORT), and the
agent keeps that one server for its whole life: every restart of the
processes (`--max-restarts`) gets the same address and port and finds every
key of the attempts before it (torch 2.11 to 2.15:
`DynamicRendezvousHandler.next_rendezvous` creates the shared server only
in its first round; `rendezvous._create_c10d_store` adds no prefix per
attempt, its comment assuming a new server per retry). A process group
then reads its peers' addresses from the previous attempt: gloo fails
with `connectFullMesh ... Connection refused`, or hangs in its connect
past every timeout (seen for minutes with KTD_TIMEOUT_SECONDS=60).
TORCHELASTIC_RESTART_COUNT does not separate attempts either: each node's
agent counts its own restarts, and a node restarted because another node
failed does not count it (pytorch/pytorch#135712).

`fresh_namespace` therefore agrees on a new key prefix among the processes
of this start, without trusting any key written before: rank 0 publishes a
random name under a fixed key; every other rank reads it, checks in under
that name with a random token of its own, and takes the name only once
rank 0 has answered that token (a key no earlier process can have
written). A rank that read the name of an earlier attempt gets no answer
and reads again. Every process of an earlier attempt is gone before any
process of the next one starts (each agent stops its processes before it
joins the next rendezvous round), so rank 0's name is the newest one.
"""

import datetime
import os
import time
import uuid

# The key under which rank 0 publishes this start's name (on the raw store).
LEADER_KEY = "ktd/start"
# How often a rank that has not been answered reads again: the first and the
# longest pause, in seconds (doubling in between).
POLL_SECONDS = (0.01, 0.5)


def uses_agent_store(environ=os.environ):
    """True when torch's env:// rendezvous hands this process a client of
    the elastic agent's store, which outlives the processes."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def fresh_namespace(store, rank, world_size, timeout):
    """`store` under a key prefix that only the processes of this start
    use (see the module's docstring). Collective over the store: every rank
    of the world calls it. Raises TimeoutError after `timeout` (a
    timedelta) when a rank does not check in."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        name = uuid.uuid4().hex
        store.set(LEADER_KEY, name)
        prefix = _prefix(name)
        keys = [f"{prefix}here/{member}" for member in range(1, world_size)]
        if keys:
            _wait(store, keys, deadline)
            tokens = [token.decode() for token in store.multi_get(keys)]
            store.multi_set(
                [f"{prefix}welcome/{token}" for token in tokens],
                [name] * len(tokens),
            )
        return dist.PrefixStore(prefix, store)
    token = uuid.uuid4().hex
    _wait(store, [LEADER_KEY], deadline)
    name, pause = None, POLL_SECONDS[0]
    while True:
        latest = store.get(LEADER_KEY).decode()
        if latest != name:  # (check in again under rank 0's newer name)
            name = latest
            store.set(f"{_prefix(name)}here/{rank}", token)
        if store.check([f"{_prefix(name)}welcome/{token}"]):
            return dist.PrefixStore(_prefix(name), store)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 did not answer rank {rank} on the launcher's store "
                f"(MASTER_ADDR:MASTER_PORT) under the name it published, {name}"
            )
        # An earlier start's name, or rank 0 has not answered yet. (Polled,
        # not waited for: a store.wait that times out logs a warning.)
        time.sleep(pause)
        pause = min(2 * pause, POLL_SECONDS[1])


def _prefix(name):
    return f"ktd/start/{name}/"


def _wait(store, keys, deadline):
    """Wait until every key of `keys` exists, up to the deadline; a
    TimeoutError names the ranks whose keys are missing."""
    import torch.distributed as dist

    left = deadline - time.monotonic()
    try:
        if left <= 0:
            raise dist.DistStoreError("deadline passed")
        store.wait(keys, datetime.timedelta(seconds=left))
    except dist.DistStoreError:
        missing = [key for key in keys if not store.check([key])]
        if missing == [LEADER_KEY]:
            raise TimeoutError(
                "rank 0 never published this start's name on the launcher's "
                "store (MASTER_ADDR:MASTER_PORT)"
            ) from None
        ranks = [key.rpartition("/")[2] for key in missing]
        raise TimeoutError(
            f"ranks {', '.join(ranks)} never checked in on the launcher's "
            "store (MASTER_ADDR:MASTER_PORT)"
        ) from None
