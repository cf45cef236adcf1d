"""This process joins its job: `initialize()`, and its end, `shutdown()`.

`initialize()` joins the job that started this process, whatever started
it: `environments.detect` reads the environment (torchrun, SLURM, MPI,
LSF, Kubeflow, explicit arguments; see there), and where this process
should start its node's processes instead (a bare script on a machine with
several GPUs, `initialize(num_processes=N)` without a launcher, one task
per node), `spawn` starts them and this process exits with them. The
process group itself is started by `rendezvous`.

Environment variables read here: those `detect` reads, and
KTD_TIMEOUT_SECONDS (see `_env`): how long the rendezvous and every
collective may wait for a peer before failing (default 300).

A script that never calls `keras.distribution.initialize()` (single-host
JAX scripts never do) gets the process group started on first use when a
launcher's environment says this process is one of several (never starting
processes then): `ensure_initialized`, `list_devices`.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import quiet_other_ranks
from keras_torch_distribution._log import warn_misspelled_settings
from keras_torch_distribution._processes import environments
from keras_torch_distribution._processes import lost_hosts
from keras_torch_distribution._processes import rendezvous
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._processes import seeds
from keras_torch_distribution._processes import spawn

if TYPE_CHECKING:
    from keras_torch_distribution._processes.record import Launch

# torchrun's default MASTER_PORT, used for job_addresses given without a port.
DEFAULT_PORT = environments.DEFAULT_PORT


def detect_launch(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Launch:
    """What `initialize()` would do in this process, starting nothing: a
    `record.Launch` (which launcher, address, port, world,
    rank, local rank, or the processes it would start). `ktd env` shows it.
    """
    return environments.detect(
        os.environ,
        runtime.local_device_count(),
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
    if runtime.is_initialized():
        _check_matches_running(num_processes, process_id)
        return
    warn_misspelled_settings()
    timeout = datetime.timedelta(seconds=runtime.timeout_seconds())
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
        rendezvous._init_process_group(
            store=dist.HashStore(),
            world_size=1,
            rank=0,
            timeout=timeout,
            local_rank=0,
        )
    elif launch.init_method == "env://":
        rendezvous._init_process_group(
            init_method="env://", timeout=timeout, local_rank=launch.local_rank
        )
    else:
        rendezvous._init_process_group(
            init_method=launch.init_method,
            world_size=launch.world,
            rank=launch.rank,
            timeout=timeout,
            local_rank=launch.local_rank,
        )
    seeds.initialize_rng(
        runtime.cpu_group() if runtime.is_multi_process() else None
    )
    quiet_other_ranks()  # other libraries' logging: rank 0's, once
    logger.info(
        "initialized rank %d of %d (%s; %s)",
        dist.get_rank(),
        dist.get_world_size(),
        runtime._backend(),
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
        spawn.start_processes(launch, runtime.timeout_seconds())  # exits
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


def shutdown() -> bool:
    """Destroy the process group this package started, with every group
    torch made on it (the meshes' and the checkpoint writer's). A group the
    application started is left alone. True when it destroyed one.
    Collective: call on every rank."""
    destroyed = rendezvous.started.is_running()
    if destroyed:
        dist.destroy_process_group()
    rendezvous.started.clear()
    runtime._cpu_group.clear()
    lost_hosts.table.clear()
    return destroyed


def ensure_initialized(use: str = "a DeviceMesh") -> int:
    """World size, starting the process group if it is not running yet.

    In a plain `python` run that is a world of one process; under a
    launcher, its job, as `initialize()` joins it (but no process is
    started: see `_start`). `use` names the caller for the log.
    Collective when it starts the group: call on every rank.
    """
    if not runtime.is_initialized():
        _start(first_use=use)
    return dist.get_world_size()


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
        list for `"tpu"`, and for `"gpu"` under KTD_DEVICE=cpu.

    Raises:
        ValueError: `device_type` is none of these, or asks for CPU devices
            in a run that computes on CUDA.
        RuntimeError: `"gpu"` where CUDA is not available (as JAX's
            `jax.devices("gpu")` on a machine without one), naming what
            was found.
    """
    kind = runtime._normalize_device_type(device_type)
    if kind == "gpu" and not runtime.uses_cuda():
        if runtime.torch.cuda.is_available():  # KTD_DEVICE=cpu
            return []
        raise RuntimeError(
            f"list_devices({device_type!r}) asks for GPUs, but "
            f"{runtime.cuda_found()} Use keras.distribution.list_devices() "
            "for this run's devices (CPUs here), or run on a machine with a "
            "GPU and a CUDA build of torch."
        )
    if kind == "tpu":
        return []
    if kind == "cpu" and runtime.uses_cuda():
        raise ValueError(
            f"list_devices({device_type!r}) asks for CPU devices, but this run "
            f"computes on CUDA (process group {runtime._backend()!r}, Keras' "
            f"torch device {str(_keras.default_torch_device())!r}): a 'cpu' "
            "mesh would hold CUDA tensors. Use "
            "keras.distribution.list_devices() (or 'gpu') for this run's "
            "devices, or set KTD_DEVICE=cpu before the processes start to run "
            "on CPU processes (gloo)."
        )
    if (
        not runtime.is_initialized()
        and detect_launch().start != environments.SINGLE
    ):
        ensure_initialized("list_devices()")
    return [f"{kind}:{rank}" for rank in range(runtime.num_processes())]


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
