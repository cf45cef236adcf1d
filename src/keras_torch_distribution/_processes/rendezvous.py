"""The process group started: torch's rendezvous, bounded in time, and
`init_process_group` on its store.

The rendezvous runs in a thread given up after KTD_TIMEOUT_SECONDS (torch
does not bound its TCPStore handshake); on CUDA this process's GPU is made
current first; every rank's host is kept for naming lost hosts
(`lost_hosts`); a start that fails says what was tried and the fix.
`StartedGroup` remembers whether the running group is this package's
(`join.shutdown` destroys only that one).
"""

from __future__ import annotations

import inspect
import os
import socket
import threading
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from keras_torch_distribution._log import logger
from keras_torch_distribution._processes import agent_store
from keras_torch_distribution._processes import interfaces
from keras_torch_distribution._processes import lost_hosts
from keras_torch_distribution._processes import runtime

# How long past KTD_TIMEOUT_SECONDS we wait for torch's rendezvous to report
# its own timeout before giving up on it ourselves.
_RENDEZVOUS_GRACE_SECONDS = 2.0


class StartedGroup:
    """Whether the running process group was started by this package (it
    destroys only what it started; a group the application started is the
    application's to destroy)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.group = None  # the world group this package started

    def is_running(self) -> bool:
        return runtime.is_initialized() and dist.group.WORLD is self.group


started = StartedGroup()


def _init_process_group(
    init_method=None,
    store=None,
    world_size=-1,
    rank=-1,
    timeout=None,
    local_rank=0,
):
    """init_process_group with every wait bounded by `timeout`.

    The rendezvous (for an init_method) runs first, bounded by
    `_rendezvous`; then, on CUDA, this process's GPU is made current
    (`local_rank` % the visible devices; `local_rank` None: derived from
    the store, see `_local_rank_from_store`) and torch builds the group on
    the store, bound to that GPU where torch takes `device_id` (NCCL then
    connects at once, barriers know their device, and mesh groups are
    split from the world's communicator); its own waits are bounded by
    `timeout`.
    """
    where = {
        "init_method": init_method,
        "rank": rank,
        "world_size": world_size,
        "timeout": timeout,
    }
    try:
        if store is None:
            store, rank, world_size = _rendezvous(
                init_method, rank, world_size, timeout
            )
            store.set_timeout(timeout)
            if agent_store.uses_agent_store():
                # torchrun's store keeps earlier attempts' keys: a new prefix.
                store = agent_store.fresh_namespace(
                    store, rank, world_size, timeout
                )
            if world_size > 1:
                interfaces.choose(
                    store, rank, world_size, _coordinator_host(init_method)
                )
        bound = {}
        if runtime.uses_cuda():
            if local_rank is None:
                local_rank = _local_rank_from_store(store, rank, world_size)
            index = local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            if _TAKES_DEVICE_ID:
                bound["device_id"] = torch.device("cuda", index)
        dist.init_process_group(
            backend=runtime._backend(),
            store=store,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
            **bound,
        )
        started.group = dist.group.WORLD
        if world_size > 1:
            _remember_hosts(store, rank, init_method)
    except (RuntimeError, ValueError, TimeoutError) as error:
        raise RuntimeError(_start_failure_message(error, where)) from error


# torch >= 2.3 binds a process group to a device with `device_id=`.
_TAKES_DEVICE_ID = (
    "device_id" in inspect.signature(dist.init_process_group).parameters
)


def _local_rank_from_store(store, rank, world_size):
    """This process's index among the processes of its host, for a launch
    that set no local rank (an explicit initialize() without LOCAL_RANK):
    each process counts itself in on the rendezvous store under its host
    name, so that processes of one host get distinct GPUs. The index is the
    order of arrival (not of rank); set LOCAL_RANK for a fixed mapping."""
    if world_size == 1:
        return 0
    host = socket.gethostname()
    local = int(store.add(f"ktd/local_rank/{host}", 1)) - 1
    logger.info(
        "rank %d: no LOCAL_RANK was set; it is process %d of host %s (counted "
        "on the rendezvous store) and uses GPU %d",
        rank,
        local,
        host,
        local % torch.cuda.device_count(),
    )
    return local


def _rendezvous(init_method, rank, world_size, timeout):
    """(store, rank, world_size) from torch's rendezvous for `init_method`,
    given up after `timeout` (plus a grace for torch's own timeout error).

    torch bounds its TCPStore's connect and key waits by the timeout, but not
    its handshake: a process that reaches a port held by a program that
    never answers (one that accepts and stays silent, or listens and never
    accepts) waits forever in the TCPStore constructor (torch 2.13). The
    rendezvous therefore runs in a daemon thread that we stop waiting for;
    if it stays stuck, it ends with the process.
    """
    outcome = {}

    def run():
        try:
            outcome["result"] = next(
                dist.rendezvous(init_method, rank, world_size, timeout=timeout)
            )
        except Exception as error:  # re-raised below, in the calling thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="ktd-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + _RENDEZVOUS_GRACE_SECONDS)
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise TimeoutError(
            "no torch.distributed store answered at "
            f"{_coordinator(init_method)}."
        )
    return outcome["result"]


def _coordinator(init_method):
    """ "host:port" of the store that `init_method` names, for messages."""
    if init_method == "env://":
        return (
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        )
    return urlparse(init_method or "").netloc or str(init_method)


def _remember_hosts(store, rank, init_method):
    """Every rank's host, kept for naming lost hosts after a failure (one
    small all-gather at the start)."""
    facts = [None] * dist.get_world_size()
    dist.all_gather_object(
        facts,
        interfaces.host_facts(_coordinator_host(init_method)),
        group=runtime.cpu_group(),
    )
    lost_hosts.table.remember(
        store, dist.get_rank(), facts, _coordinator(init_method)
    )


def _coordinator_host(init_method):
    """The host of the coordinator that `init_method` names ("" for a file
    store): `_coordinator` without the port and IPv6 brackets."""
    if init_method != "env://" and not str(init_method).startswith("tcp:"):
        return ""
    return _coordinator(init_method).rpartition(":")[0].strip("[]")


def _start_failure_message(error, where):
    """Why the process group did not start, with what was tried and the fix."""
    init_method = where["init_method"]
    rank, world = where["rank"], where["world_size"]
    if init_method == "env://":
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        shown = (
            f"env:// (MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')!r})"
        )
    elif init_method is None:
        shown = "an in-process store (a world of one process)"
    else:
        shown = init_method
    seconds = where["timeout"].total_seconds()
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else repr(error)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        port = _coordinator(init_method).rpartition(":")[2]
        advice = (
            f"Another program holds port {port} on this host, where process 0 "
            "hosts the coordinator. Give every process the same free port "
            "(job_addresses='host:PORT', or MASTER_PORT), or stop the program "
            "that holds it."
        )
    elif (
        isinstance(error, TimeoutError)
        and "no torch.distributed store answered" in text
    ):
        advice = (
            "Either process 0 has not started its coordinator there (start it, "
            "or raise KTD_TIMEOUT_SECONDS if it starts slowly), or another "
            "program holds that port and does not answer (process 0 then "
            "fails at once with 'address already in use'): give every process "
            "the same free port."
        )
    else:
        advice = (
            "Check that every process was started with the same coordinator "
            "address (process 0's host:port, reachable from every process, "
            "with the port free on process 0's host) and the same number of "
            "processes, that all of them were started, and raise "
            "KTD_TIMEOUT_SECONDS if peers start slowly."
        )
    return (
        f"torch.distributed could not start process {rank} of {world} at "
        f"{shown} within KTD_TIMEOUT_SECONDS={seconds:g} s: {first_line} "
        f"{advice}"
    )
