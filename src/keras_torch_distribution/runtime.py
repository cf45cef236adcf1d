"""Processes and devices: torch.distributed's process group, started once.

Environment variables read here:
- torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- KTD_TIMEOUT_SECONDS (see `_env`): how long the rendezvous and every
  collective may wait for a peer before failing (default 300).

A script that never calls `keras.distribution.initialize()` (single-host
JAX scripts never do) gets the process group started on first use when a
launcher's environment says this process is one of several.
"""

import datetime
import os
import threading
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from keras_torch_distribution import _env
from keras_torch_distribution import seeds
from keras_torch_distribution.log import logger

DEFAULT_TIMEOUT_SECONDS = _env.DEFAULT_TIMEOUT_SECONDS
timeout_seconds = _env.timeout_seconds
# torchrun's default MASTER_PORT, used for job_addresses given without a port.
DEFAULT_PORT = 29500
# How long past KTD_TIMEOUT_SECONDS we wait for torch's rendezvous to report
# its own timeout before giving up on it ourselves.
_RENDEZVOUS_GRACE_SECONDS = 2.0
# What torchrun (and `ktd run`) set for each process of a launch.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_DEVICE_TYPES = ("cpu", "gpu")


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def launched_world_size():
    """WORLD_SIZE set by torchrun (or our launcher), else 1."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(
            f"WORLD_SIZE={text!r} is not a number of processes: a launcher "
            "(torchrun, `ktd run -n N`) sets it to a whole number >= 1. Unset "
            "it for a one-process run."
        )
    return int(text)


def uses_cuda():
    return torch.cuda.is_available() and not _env.forces_cpu()


def _backend():
    return "cpu:gloo,cuda:nccl" if uses_cuda() else "gloo"


def _init_method(job_addresses):
    """torch init_method from Keras' job_addresses: the first entry, process
    0's "host:port" (or "host", meaning port DEFAULT_PORT), or an init URL
    such as "tcp://host:port" or "file:///path"."""
    first = job_addresses.split(",")[0].strip()
    if "://" in first:
        return first
    host, port = _host_and_port(first)
    if host is None:
        raise ValueError(
            f"job_addresses={job_addresses!r} is not 'host:port' or 'host' "
            f"(process 0's address first; port {DEFAULT_PORT} when left out) "
            "nor an init URL such as 'tcp://host:port' or 'file:///path'. "
            "Give e.g. job_addresses='10.0.0.1:1234'."
        )
    if port is None:
        logger.info(
            "job_addresses=%r names no port: using torch's default port %d",
            job_addresses, DEFAULT_PORT,
        )
        port = DEFAULT_PORT
    return f"tcp://{host}:{port}"


def _host_and_port(address):
    """(host, port or None) of "host", "host:port", "[v6]" or "[v6]:port";
    (None, None) when `address` is none of these."""
    if address.startswith("["):  # an IPv6 address in brackets
        inside, bracket, rest = address[1:].partition("]")
        host = f"[{inside}]" if bracket and inside else None
        port = rest[1:] if rest.startswith(":") else (None if not rest else "x")
    elif address.count(":") > 1:  # an IPv6 address without brackets or port
        host, port = f"[{address}]", None
    else:
        host, colon, port = address.partition(":")
        port = port if colon else None
    if not host or (port is not None
                    and not (port.isdigit() and 0 < int(port) < 2**16)):
        return None, None
    return host, port


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Start torch.distributed. Idempotent.

    With no arguments, reads torchrun's environment; in a plain `python`
    run it starts a world of one process. Collective: call on every rank.
    """
    if is_initialized():
        _check_matches_running(num_processes, process_id)
        return
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if job_addresses:
        if num_processes is None or process_id is None:
            raise ValueError(
                f"initialize(job_addresses={job_addresses!r}) also needs "
                f"num_processes and process_id (got num_processes="
                f"{num_processes}, process_id={process_id})."
            )
        addresses = [a for a in job_addresses.split(",") if a.strip()]
        if len(addresses) > 1 and len(addresses) != num_processes:
            raise ValueError(
                f"job_addresses lists {len(addresses)} jobs but "
                f"num_processes={num_processes}; give one address per process "
                "or only the coordinator's."
            )
        _check_rank(num_processes, process_id)
        _init_process_group(
            init_method=_init_method(job_addresses),
            world_size=int(num_processes),
            rank=int(process_id),
            timeout=timeout,
        )
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = launched_world_size()
        if num_processes is not None and int(num_processes) != world:
            raise ValueError(
                f"initialize(num_processes={num_processes}) but torchrun "
                f"started WORLD_SIZE={world} processes."
            )
        _init_process_group(init_method="env://", timeout=timeout)
    else:
        if num_processes not in (None, 1):
            raise ValueError(
                f"initialize(num_processes={num_processes}) needs "
                "job_addresses='host:port' of process 0, or a launch by "
                "torchrun / `ktd run -n N`, which sets the environment."
            )
        _init_process_group(
            store=dist.HashStore(), world_size=1, rank=0, timeout=timeout
        )
    if uses_cuda():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    seeds.initialize_rng()
    logger.info(
        "initialized rank %d of %d (%s)",
        dist.get_rank(),
        dist.get_world_size(),
        _backend(),
    )


def _check_rank(num_processes, process_id):
    if int(num_processes) < 1 or not 0 <= int(process_id) < int(num_processes):
        raise ValueError(
            f"process_id={process_id} must be in [0, num_processes="
            f"{num_processes})."
        )


def _check_matches_running(num_processes, process_id):
    world, rank = dist.get_world_size(), dist.get_rank()
    if num_processes is not None and int(num_processes) != world:
        raise ValueError(
            f"initialize(num_processes={num_processes}) but torch.distributed "
            f"already runs {world} processes."
        )
    if process_id is not None and int(process_id) != rank:
        raise ValueError(
            f"initialize(process_id={process_id}) but this process already "
            f"is rank {rank}."
        )


class StartedGroup:
    """Whether the running process group was started by this package (it
    destroys only what it started; a group the application started is the
    application's to destroy)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.group = None  # the world group this package started

    def is_running(self):
        return is_initialized() and dist.group.WORLD is self.group


started = StartedGroup()


def shutdown():
    """Destroy the process group this package started, with every group
    torch made on it (the meshes' and the checkpoint writer's). A group the
    application started is left alone. True when it destroyed one.
    Collective: call on every rank."""
    destroyed = started.is_running()
    if destroyed:
        dist.destroy_process_group()
    started.clear()
    return destroyed


def _init_process_group(init_method=None, store=None, world_size=-1, rank=-1,
                        timeout=None):
    """init_process_group with every wait bounded by `timeout`.

    The rendezvous (for an init_method) runs first, bounded by
    `_rendezvous`; then torch builds the group on the store it returned,
    its own waits bounded by `timeout`.
    """
    where = {"init_method": init_method, "rank": rank, "world_size": world_size,
             "timeout": timeout}
    try:
        if store is None:
            store, rank, world_size = _rendezvous(init_method, rank, world_size, timeout)
            store.set_timeout(timeout)
        dist.init_process_group(
            backend=_backend(), store=store, world_size=world_size, rank=rank,
            timeout=timeout,
        )
        started.group = dist.group.WORLD
    except (RuntimeError, ValueError, TimeoutError) as error:
        raise RuntimeError(_start_failure_message(error, where)) from error


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
            f"no torch.distributed store answered at {_coordinator(init_method)}."
        )
    return outcome["result"]


def _coordinator(init_method):
    """"host:port" of the store that `init_method` names, for messages."""
    if init_method == "env://":
        return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return urlparse(init_method or "").netloc or str(init_method)


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
    elif isinstance(error, TimeoutError) and "no torch.distributed store answered" in text:
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
        f"{shown} within KTD_TIMEOUT_SECONDS={seconds:g} s: {first_line} {advice}"
    )


def ensure_initialized(use="a DeviceMesh"):
    """World size, starting the process group if it is not running yet.

    In a plain `python` run that is a world of one process; under a
    launcher, see `_start_on_first_use`. `use` names the caller for the log.
    Collective when it starts the group: call on every rank.
    """
    if not is_initialized():
        if launched_world_size() > 1:
            _start_on_first_use(use)
        else:
            initialize()
    return dist.get_world_size()


def _start_on_first_use(use):
    """Start the process group from a launcher's environment, for a script
    that never called keras.distribution.initialize() (single-host JAX
    scripts do not). Refuses when that environment is incomplete.
    """
    world = launched_world_size()
    missing = [name for name in _LAUNCHER_VARIABLES if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"This process is one of WORLD_SIZE={world} processes, but "
            "torch.distributed is not initialized yet and the environment "
            f"lacks {', '.join(missing)} to start it. Call "
            "keras.distribution.initialize() first, on every process, with "
            f"job_addresses='host:port' (process 0's), num_processes={world} "
            "and process_id (this process's index); or launch the script with "
            f"`ktd run -n {world} script.py` or torchrun, which set RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    logger.info(
        "keras.distribution.initialize() was not called: %s starts the process "
        "group now from the launcher's environment (RANK=%s, WORLD_SIZE=%d, "
        "MASTER_ADDR=%s, MASTER_PORT=%s)",
        use, os.environ["RANK"], world, os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    initialize()


def num_processes():
    """The number of processes in the running process group (1 when none
    has started), as `jax.process_count()`."""
    if is_initialized():
        return dist.get_world_size()
    return 1


def is_multi_process():
    """True when this process is one of several in a running process
    group: the test for collectives, barriers and per-rank files."""
    return num_processes() > 1


def process_id():
    """This process's rank in the running process group (0 when none has
    started), as `jax.process_index()`."""
    if is_initialized():
        return dist.get_rank()
    return 0


def default_device_type():
    return "gpu" if uses_cuda() else "cpu"


def _normalize_device_type(device_type):
    if device_type is None:
        return default_device_type()
    kind = str(device_type).lower()
    kind = "gpu" if kind == "cuda" else kind
    if kind not in _DEVICE_TYPES + ("tpu",):
        raise ValueError(
            f"device_type={device_type!r} is not one of 'cpu', 'gpu' or "
            "'tpu' (or None for the default)."
        )
    return kind


def list_devices(device_type=None):
    """One device per process, named by global rank: ["cpu:0", "cpu:1", ...].

    Under a launcher, starts the process group if it is not running yet
    (collective then: call on every rank).
    """
    kind = _normalize_device_type(device_type)
    if kind == "tpu" or (kind == "gpu" and not torch.cuda.is_available()):
        return []
    if not is_initialized() and launched_world_size() > 1:
        ensure_initialized("list_devices()")
    return [f"{kind}:{rank}" for rank in range(num_processes())]


def get_device_count(device_type=None):
    return len(list_devices(device_type))
