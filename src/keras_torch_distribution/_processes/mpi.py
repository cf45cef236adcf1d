"""The MPI launchers' rows (Open MPI, MPICH / Intel MPI through PMI,
MVAPICH2): their variables -> a `Launch`, or None when they are absent; as
`schedulers`' rows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from keras_torch_distribution._processes.record import DEFAULT_PORT
from keras_torch_distribution._processes.record import (
    IncompleteEnvironmentError,
)
from keras_torch_distribution._processes.record import Launch
from keras_torch_distribution._processes.record import Outside
from keras_torch_distribution._processes.record import join
from keras_torch_distribution._processes.record import present
from keras_torch_distribution._processes.record import read_local_rank
from keras_torch_distribution._processes.record import read_port
from keras_torch_distribution._processes.record import read_whole
from keras_torch_distribution._processes.record import require
from keras_torch_distribution._processes.record import shown
from keras_torch_distribution._processes.schedulers import DERIVED_PORT_BASE
from keras_torch_distribution._processes.schedulers import DERIVED_PORT_SPAN
from keras_torch_distribution._processes.schedulers import slurm_step_address

# Open MPI <= 4 publishes its launcher's URI; JAX reads the host and job id
# from it (jax/_src/clusters/ompi_cluster.py).
_ORTE_URI = re.compile(
    r"^(\d+)\.\d+;tcp6?://\[?([0-9a-zA-Z:.\-]+?)\]?(?:,|:\d+)"
)


def open_mpi(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    keys = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
    if not forced and not any(k in env for k in keys):
        return None
    require(
        env, "Open MPI", keys, fix="Start it with mpirun (Open MPI sets both)."
    )
    world = read_whole(env, "OMPI_COMM_WORLD_SIZE")
    rank = read_whole(env, "OMPI_COMM_WORLD_RANK", minimum=0)
    local = read_local_rank(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    address = port = None
    match = _ORTE_URI.match(env.get("OMPI_MCA_orte_hnp_uri", ""))
    if match:
        address = match.group(2)
        port = (
            int(match.group(1)) // DERIVED_PORT_SPAN
        ) % DERIVED_PORT_SPAN + DERIVED_PORT_BASE
    names = keys + ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_orte_hnp_uri")
    return _mpi_join(
        "openmpi",
        "Open MPI",
        env,
        outside,
        world,
        rank,
        local,
        address,
        port,
        names,
    )


def pmi(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    keys = ("PMI_SIZE", "PMI_RANK")
    if not forced and not any(k in env for k in keys):
        return None
    require(
        env,
        "MPICH / Intel MPI (PMI)",
        keys,
        fix="Start it with mpiexec / mpirun (Hydra sets both).",
    )
    world, rank = (
        read_whole(env, "PMI_SIZE"),
        read_whole(env, "PMI_RANK", minimum=0),
    )
    address = port = None
    slurm = slurm_step_address(env)
    if slurm is not None and env.get("SLURM_PROCID") == env["PMI_RANK"]:
        address, port = slurm  # srun --mpi=pmi2: SLURM's ranks are these ranks
    names = keys + ("MPI_LOCALRANKID",)
    return _mpi_join(
        "pmi",
        "MPICH / Intel MPI",
        env,
        outside,
        world,
        rank,
        read_local_rank(env, "MPI_LOCALRANKID"),
        address,
        port,
        names,
    )


def mvapich(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    keys = ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")
    if not forced and not any(k in env for k in keys):
        return None
    require(env, "MVAPICH2", keys, fix="Start it with mpirun_rsh / mpiexec.")
    world, rank = (
        read_whole(env, "MV2_COMM_WORLD_SIZE"),
        read_whole(env, "MV2_COMM_WORLD_RANK", minimum=0),
    )
    names = keys + ("MV2_COMM_WORLD_LOCAL_RANK",)
    return _mpi_join(
        "mvapich",
        "MVAPICH2",
        env,
        outside,
        world,
        rank,
        read_local_rank(env, "MV2_COMM_WORLD_LOCAL_RANK"),
        None,
        None,
        names,
    )


def _mpi_join(
    name, what, env, outside, world, rank, local, address, port, names
):
    """An MPI row's Launch. MASTER_ADDR / MASTER_PORT win; else the address
    the MPI tells; else rank 0's, broadcast over MPI by mpi4py where it is
    installed; else an error asking for MASTER_ADDR."""
    names = names + ("MASTER_ADDR", "MASTER_PORT")
    address = env.get("MASTER_ADDR") or address
    if world > 1 and address is None:
        told = outside.mpi_address()
        if told is not None:
            address, port = told[0], port or told[1]
    if world > 1 and address is None:
        raise IncompleteEnvironmentError(
            f"{what} started this process as rank {rank} of {world} "
            f"({shown(present(env, names))}), but nothing says where process 0 "
            "is: MASTER_ADDR is missing (and mpi4py, which could ask rank 0, "
            "is not installed). Set MASTER_ADDR to process 0's host (reachable "
            "from every process) and MASTER_PORT to a free port there, for "
            "every process, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x "
            "MASTER_PORT=29500 ...`; or install mpi4py; or launch with "
            "torchrun / `ktd run` instead."
        )
    port = (
        read_port(env, "MASTER_PORT")
        if env.get("MASTER_PORT")
        else (port or DEFAULT_PORT)
    )
    return join(name, env, world, rank, local, address, port, names)
