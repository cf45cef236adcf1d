"""Processes and devices: torch.distributed's process group, started once.

`initialize()` joins the job that started this process, whatever started
it: `environments.detect` reads the environment (torchrun, SLURM,
MPI, LSF, Kubeflow, explicit arguments; see there), and where this process
should start its node's processes instead (a bare script on a machine with
several GPUs, `initialize(num_processes=N)` without a launcher, one task
per node), `spawn` starts them and this process exits with them.

Environment variables read here: those `detect` reads, and
KTD_TIMEOUT_SECONDS (see `_env`): how long the rendezvous and every
collective may wait for a peer before failing (default 300).

A script that never calls `keras.distribution.initialize()` (single-host
JAX scripts never do) gets the process group started on first use when a
launcher's environment says this process is one of several (never starting
processes then).
"""

from __future__ import annotations

import datetime
import inspect
import os
import socket
import threading
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from keras_torch_distribution import _env
from keras_torch_distribution import _keras
from keras_torch_distribution._processes import agent_store
from keras_torch_distribution._processes import environments
from keras_torch_distribution._processes import interfaces
from keras_torch_distribution._processes import lost_hosts
from keras_torch_distribution._processes import seeds
from keras_torch_distribution._processes import spawn
from keras_torch_distribution.log import logger

if TYPE_CHECKING:
    from keras_torch_distribution._processes.record import Launch

DEFAULT_TIMEOUT_SECONDS = _env.DEFAULT_TIMEOUT_SECONDS
timeout_seconds = _env.timeout_seconds
# torchrun's default MASTER_PORT, used for job_addresses given without a port.
DEFAULT_PORT = environments.DEFAULT_PORT
# How long past KTD_TIMEOUT_SECONDS we wait for torch's rendezvous to report
# its own timeout before giving up on it ourselves.
_RENDEZVOUS_GRACE_SECONDS = 2.0
_DEVICE_TYPES = ("cpu", "gpu")


def is_initialized() -> bool:
    """True when torch.distributed's process group is running."""
    return dist.is_available() and dist.is_initialized()


def uses_cuda() -> bool:
    """True when this process computes on CUDA: CUDA is available and
    KTD_DEVICE=cpu does not ask for CPU processes. Under KTD_DEVICE=cpu,
    Keras' own torch device is made "cpu" too (`keep_keras_on_cpu`), so
    that every tensor Keras makes is one gloo can carry."""
    if _env.forces_cpu():
        keep_keras_on_cpu()
        return False
    return torch.cuda.is_available()


def keep_keras_on_cpu() -> None:
    """Make Keras' torch backend compute on the CPU (KTD_DEVICE=cpu): on a
    CUDA machine Keras otherwise puts every tensor on "cuda", which the
    gloo process group of a KTD_DEVICE=cpu run cannot carry. Refuses a
    KERAS_TORCH_DEVICE that asks for another device."""
    current = str(_keras.default_torch_device())
    if current == "cpu":
        return
    asked = os.environ.get("KERAS_TORCH_DEVICE")
    if asked is not None and asked.strip().lower() != "cpu":
        raise ValueError(
            f"KTD_DEVICE=cpu asks for CPU processes (gloo), but "
            f"KERAS_TORCH_DEVICE={asked!r} makes Keras compute on another "
            "device, whose tensors gloo cannot carry. Unset KERAS_TORCH_DEVICE "
            "(or set it to cpu), or unset KTD_DEVICE to run on CUDA."
        )
    _keras.set_default_torch_device("cpu")
    logger.info(
        "KTD_DEVICE=cpu: Keras' torch device is 'cpu' (it was %r)", current
    )


def _backend():
    return "cpu:gloo,cuda:nccl" if uses_cuda() else "gloo"


def local_device_count() -> int:
    """The accelerators this process could use: the visible CUDA devices,
    or 0 on CPU (and with KTD_DEVICE=cpu)."""
    return torch.cuda.device_count() if uses_cuda() else 0


def detect_launch(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Launch:
    """What `initialize()` would do in this process, starting nothing: a
    `environments.Launch` (which launcher, address, port, world,
    rank, local rank, or the processes it would start). `ktd env` shows it.
    """
    return environments.detect(
        os.environ,
        local_device_count(),
        job_addresses,
        num_processes,
        process_id,
    )


def initialize(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Start torch.distributed. Idempotent.

    With no arguments, joins the job that started this process (torchrun,
    SLURM srun, mpirun, LSF jsrun, Kubeflow; see `environments`);
    arguments (and KERAS_DISTRIBUTION_*) win over what is detected. In a
    plain `python` run it starts a world of one process, or, with several
    local GPUs or `num_processes=N` (no address), one process per device /
    N processes running this script, and this process exits with them.
    Collective: call on every rank.

    Args:
        job_addresses: process 0's address, `"host:port"` (`"host"`: port
            `DEFAULT_PORT`; a comma-separated list of every process's,
            whose first is process 0's), or a torch init URL such as
            `"tcp://host:port"` or `"file:///path"`. `None`:
            KERAS_DISTRIBUTION_JOB_ADDRESSES, or what the launcher's
            environment says.
        num_processes: the number of processes of the job. `None`:
            KERAS_DISTRIBUTION_NUM_PROCESSES, or what the launcher's
            environment says.
        process_id: this process's rank in `[0, num_processes)`. `None`:
            KERAS_DISTRIBUTION_PROCESS_ID, or what the launcher's
            environment says.

    Raises:
        ValueError: the arguments disagree with each other, with the
            launcher's environment or with the running process group.
        RuntimeError: the process group could not start (the message
            names what was tried and the fix).
    """
    _start(job_addresses, num_processes, process_id)


def _start(
    job_addresses=None, num_processes=None, process_id=None, first_use=None
):
    """initialize(); `first_use` names what started it when the script did
    not call initialize() (then no process is ever started)."""
    if is_initialized():
        _check_matches_running(num_processes, process_id)
        return
    timeout = datetime.timedelta(seconds=timeout_seconds())
    launch = detect_launch(job_addresses, num_processes, process_id)
    if launch.start == environments.SPAWN:
        launch = _start_processes_or_fall_back(launch, first_use)
    if first_use and launch.start == environments.JOIN:
        logger.info(
            "keras.distribution.initialize() was not called: %s starts the "
            "process group now from the launcher's environment (RANK=%d, "
            "WORLD_SIZE=%d, MASTER_ADDR=%s, MASTER_PORT=%s; %s)",
            first_use,
            launch.rank,
            launch.world,
            launch.address,
            launch.port,
            launch.environment,
        )
    if launch.start == environments.SINGLE:
        _init_process_group(
            store=dist.HashStore(),
            world_size=1,
            rank=0,
            timeout=timeout,
            local_rank=0,
        )
    elif launch.init_method == "env://":
        _init_process_group(
            init_method="env://", timeout=timeout, local_rank=launch.local_rank
        )
    else:
        _init_process_group(
            init_method=launch.init_method,
            world_size=launch.world,
            rank=launch.rank,
            timeout=timeout,
            local_rank=launch.local_rank,
        )
    seeds.initialize_rng(cpu_group() if is_multi_process() else None)
    logger.info(
        "initialized rank %d of %d (%s; %s)",
        dist.get_rank(),
        dist.get_world_size(),
        _backend(),
        launch.environment,
    )


def _start_processes_or_fall_back(launch, first_use):
    """Start this node's processes (this process then exits with them), or,
    where that is not allowed, the Launch to use instead: one process (with
    a warning), or an error when processes were asked for."""
    reason = spawn.why_not(first_use)
    if reason is None:
        logger.info(
            "starting %d processes on this node (%s; ranks %d to %d of %d)",
            launch.nproc,
            launch.environment,
            launch.node_rank * launch.nproc,
            (launch.node_rank + 1) * launch.nproc - 1,
            launch.world,
        )
        spawn.start_processes(launch, timeout_seconds())  # exits
    n = launch.nproc
    fix = (
        f"Start the script with `ktd run -n {n} script.py` (or torchrun "
        f"--nproc-per-node {n})"
        + (
            ", or call keras.distribution.initialize() at its top"
            if first_use
            else ""
        )
    )
    if launch.fallback is None:
        raise ValueError(
            f"initialize(num_processes={launch.world}) would start {n} local "
            f"processes, but {reason}. {fix}; or give every process "
            "job_addresses='host:port' (process 0's) and its process_id."
        )
    fallback = launch.fallback
    alone = (
        "alone"
        if fallback.world == 1
        else (
            f"as rank {fallback.rank} of {fallback.world}, one process per node"
        )
    )
    logger.warning(
        "%d processes could run on this node (%s: one per device), but %s: "
        "this process runs %s, on one device. %s to use every device.",
        n,
        launch.environment,
        reason,
        alone,
        fix,
    )
    return fallback


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

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.group = None  # the world group this package started

    def is_running(self) -> bool:
        return is_initialized() and dist.group.WORLD is self.group


started = StartedGroup()


def shutdown() -> bool:
    """Destroy the process group this package started, with every group
    torch made on it (the meshes' and the checkpoint writer's). A group the
    application started is left alone. True when it destroyed one.
    Collective: call on every rank."""
    destroyed = started.is_running()
    if destroyed:
        dist.destroy_process_group()
    started.clear()
    _cpu_group.clear()
    lost_hosts.table.clear()
    return destroyed


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
        if uses_cuda():
            if local_rank is None:
                local_rank = _local_rank_from_store(store, rank, world_size)
            index = local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            if _TAKES_DEVICE_ID:
                bound["device_id"] = torch.device("cuda", index)
        dist.init_process_group(
            backend=_backend(),
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
        group=cpu_group(),
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


class CpuGroup:
    """The process group that carries this package's small CPU-tensor
    collectives (ranks agreeing before fit, stopping together, the shared
    shuffle's generator state, object collectives and barriers).

    The world group when it has a CPU backend (the package starts
    "cpu:gloo,cuda:nccl" or "gloo"); for an application's group without
    one (`init_process_group("nccl")` before keras.distribution), a gloo
    group of all ranks made once per world group. A gloo side group rather
    than moving these tensors to the GPU: they are read on the host right
    away (a flag per step under StopTogether), where an NCCL collective
    would make the host wait for every kernel queued before it, and gloo's
    object collectives and barriers need no current CUDA device.
    """

    def __init__(self) -> None:
        # world group -> the group for CPU tensors (why: made once)
        self._groups = {}

    def get(self) -> dist.ProcessGroup:
        """Collective the first time for a world group without a CPU
        backend (it makes a group): call on every rank."""
        world = dist.group.WORLD
        group = self._groups.get(world)
        if group is None:
            self._groups.clear()  # a group of a destroyed world is dead
            group = (
                world
                if carries_cpu_tensors(world)
                else dist.new_group(backend="gloo")
            )
            self._groups[world] = group
        return group

    def clear(self) -> None:
        self._groups.clear()


_cpu_group = CpuGroup()


def cpu_group() -> dist.ProcessGroup:
    """The process group for collectives on CPU tensors (see `CpuGroup`).
    Collective the first time (when it makes a group): call on every rank."""
    return _cpu_group.get()


def carries_cpu_tensors(group: dist.ProcessGroup) -> bool:
    """True when `group` has a backend for CPU tensors."""
    device_types = getattr(group, "_device_types", None)
    if device_types is not None:
        return torch.device("cpu") in device_types
    backend = str(dist.get_backend(group)).lower()
    return backend in ("gloo", "mpi") or "cpu:" in backend


def ensure_initialized(use: str = "a DeviceMesh") -> int:
    """World size, starting the process group if it is not running yet.

    In a plain `python` run that is a world of one process; under a
    launcher, its job, as `initialize()` joins it (but no process is
    started: see `_start`). `use` names the caller for the log.
    Collective when it starts the group: call on every rank.
    """
    if not is_initialized():
        _start(first_use=use)
    return dist.get_world_size()


def num_processes() -> int:
    """Return the number of processes for the current distribution setting.

    The number of processes in the running process group (1 when none has
    started), as `jax.process_count()`.

    Returns:
        The world size of the running process group, or 1.
    """
    if is_initialized():
        return dist.get_world_size()
    return 1


def is_multi_process() -> bool:
    """True when this process is one of several in a running process
    group: the test for collectives, barriers and per-rank files."""
    return num_processes() > 1


def process_id() -> int:
    """Return the current process ID for the distribution setting.

    This process's rank in the running process group (0 when none has
    started), as `jax.process_index()`.

    Returns:
        The global rank of this process, or 0.
    """
    if is_initialized():
        return dist.get_rank()
    return 0


def default_device_type() -> str:
    """ "gpu" when this process computes on CUDA, else "cpu"."""
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


def list_devices(device_type: str | None = None) -> list[str]:
    """One device per process, named by global rank: ["cpu:0", "cpu:1", ...].

    Under a launcher, starts the process group if it is not running yet
    (collective then: call on every rank).

    Args:
        device_type: `"cpu"`, `"gpu"` (or `"cuda"`) or `"tpu"`. Defaults
            to this run's devices: `"gpu"` when the processes compute on
            CUDA, else `"cpu"`.

    Returns:
        The global devices, one per process: `"<type>:<rank>"` for each
        rank of the running process group (one when none runs); an empty
        list for `"tpu"`, and for `"gpu"` on a CPU run.

    Raises:
        ValueError: `device_type` is none of these, or asks for CPU devices
            in a run that computes on CUDA.
    """
    kind = _normalize_device_type(device_type)
    if kind == "tpu" or (kind == "gpu" and not uses_cuda()):
        return []
    if kind == "cpu" and uses_cuda():
        raise ValueError(
            f"list_devices({device_type!r}) asks for CPU devices, but this run "
            f"computes on CUDA (process group {_backend()!r}, Keras' torch "
            f"device {str(_keras.default_torch_device())!r}): a 'cpu' mesh "
            "would hold CUDA tensors. Use keras.distribution.list_devices() "
            "(or 'gpu') for this run's devices, or set KTD_DEVICE=cpu before "
            "the processes start to run on CPU processes (gloo)."
        )
    if not is_initialized() and detect_launch().start != environments.SINGLE:
        ensure_initialized("list_devices()")
    return [f"{kind}:{rank}" for rank in range(num_processes())]


def get_device_count(device_type: str | None = None) -> int:
    """Return the total number of devices of a type.

    Under a launcher, starts the process group if it is not running yet
    (collective then: call on every rank).

    Args:
        device_type: as for `list_devices`. Defaults to this run's devices.

    Returns:
        The number of devices `list_devices(device_type)` lists: one per
        process, or 0.
    """
    return len(list_devices(device_type))
