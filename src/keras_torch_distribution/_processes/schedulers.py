"""One function per launcher: its variables -> a `Launch`, or None when
they are absent (see `environments` for the order they are tried in):
torchrun, a generic RANK / WORLD_SIZE, LSF, SLURM, Kubeflow's node
launcher here; the MPIs in `mpi`.

Each reads only the mapping it is given (and `Outside` for a file or MPI),
matches only on its full set of variables, and raises
`IncompleteEnvironmentError` where they show a job of several processes
but some are missing or disagree.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import keras_torch_distribution._processes.hostlist as hostlist
from keras_torch_distribution._processes.record import SINGLE
from keras_torch_distribution._processes.record import SPAWN
from keras_torch_distribution._processes.record import SPAWN_VARIABLE
from keras_torch_distribution._processes.record import (
    IncompleteEnvironmentError,
)
from keras_torch_distribution._processes.record import Launch
from keras_torch_distribution._processes.record import Outside
from keras_torch_distribution._processes.record import join
from keras_torch_distribution._processes.record import node_processes
from keras_torch_distribution._processes.record import present
from keras_torch_distribution._processes.record import read_local_rank
from keras_torch_distribution._processes.record import read_local_rank_or_none
from keras_torch_distribution._processes.record import read_port
from keras_torch_distribution._processes.record import read_whole
from keras_torch_distribution._processes.record import require
from keras_torch_distribution._processes.record import shown
from keras_torch_distribution._processes.record import spawn_setting

# Ports derived from scheduler ids land in [61440, 65535], as JAX's do.
DERIVED_PORT_BASE, DERIVED_PORT_SPAN = 61440, 4096


def torchelastic(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    if not forced and "TORCHELASTIC_RUN_ID" not in env:
        return None
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    require(
        env,
        "torchrun",
        names,
        also=("TORCHELASTIC_RUN_ID",),
        fix="Start it with torchrun or `ktd run -n N` (they set all of them).",
    )
    world = read_whole(env, "WORLD_SIZE")
    return join(
        "torchelastic",
        env,
        world,
        read_whole(env, "RANK", minimum=0),
        read_local_rank(env, "LOCAL_RANK"),
        env["MASTER_ADDR"],
        read_port(env, "MASTER_PORT"),
        names + ("LOCAL_RANK",),
        "env://",
    )


def generic(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    """MASTER_ADDR, MASTER_PORT, WORLD_SIZE and a rank: RANK, or
    NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK, or JOB_COMPLETION_INDEX."""
    if not forced and "WORLD_SIZE" not in env:
        return None
    if forced:
        require(
            env,
            "the generic torch variables",
            ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
            fix="Set them (and RANK) for every process, as torchrun does.",
        )
    world = read_whole(env, "WORLD_SIZE")
    pet_nproc = env.get("PET_NPROC_PER_NODE", "")
    if (
        not forced
        and "LOCAL_RANK" not in env
        and pet_nproc.isdigit()
        and int(pet_nproc) > 1
    ):
        return (
            None  # RANK is a node's rank here: the pet row starts the processes
        )
    if world == 1 and not forced:
        return Launch("generic", SINGLE, variables=(("WORLD_SIZE", "1"),))
    rank_names = ("RANK",)
    if "RANK" in env:
        rank = read_whole(env, "RANK", minimum=0)
    elif "LOCAL_RANK" in env and "NODE_RANK" in env:
        node, local = (
            read_whole(env, "NODE_RANK", minimum=0),
            read_whole(env, "LOCAL_RANK", minimum=0),
        )
        if "LOCAL_WORLD_SIZE" in env:
            rank = node * read_whole(env, "LOCAL_WORLD_SIZE") + local
        elif node == 0:
            rank = local
        else:
            rank = None
        rank_names = ("NODE_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    elif "JOB_COMPLETION_INDEX" in env:
        rank, rank_names = (
            read_whole(env, "JOB_COMPLETION_INDEX", minimum=0),
            ("JOB_COMPLETION_INDEX",),
        )
    else:
        rank = None
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
    if rank is None:
        missing.append("RANK (or NODE_RANK, LOCAL_WORLD_SIZE and LOCAL_RANK)")
    if missing:
        found = shown(
            present(
                env,
                (
                    "RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "NODE_RANK",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                ),
            )
        )
        raise IncompleteEnvironmentError(
            f"WORLD_SIZE={world} says this process is one of {world}, but the "
            f"environment lacks {', '.join(missing)} to join the others (found "
            f"{found}). Launch the script with `ktd run -n {world} script.py` "
            "or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and "
            "MASTER_PORT; or call "
            "keras.distribution.initialize(job_addresses='host:port' (process "
            f"0's), num_processes={world}, process_id=...) on every process; "
            "or unset WORLD_SIZE for a one-process run."
        )
    names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") + rank_names
    return join(
        "generic",
        env,
        world,
        rank,
        read_local_rank_or_none(env, "LOCAL_RANK"),
        env["MASTER_ADDR"],
        read_port(env, "MASTER_PORT"),
        names,
        "env://" if "RANK" in env else None,
    )


def lsf(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    keys = (
        "LSB_JOBID",
        "LSB_DJOB_RANKFILE",
        "JSM_NAMESPACE_SIZE",
        "JSM_NAMESPACE_RANK",
        "JSM_NAMESPACE_LOCAL_RANK",
    )
    if not forced and not any(k.startswith("JSM_") and k in env for k in keys):
        return None
    require(
        env, "LSF jsrun", keys, fix="Start it with jsrun (it sets all of them)."
    )
    world, rank = (
        read_whole(env, "JSM_NAMESPACE_SIZE"),
        read_whole(env, "JSM_NAMESPACE_RANK", minimum=0),
    )
    address = env.get("MASTER_ADDR")
    if not address:
        # Line 1 is the launch node; the compute hosts follow, rank 0's first.
        lines = outside.read_text(env["LSB_DJOB_RANKFILE"]).splitlines()[1:]
        hosts = [line.strip() for line in lines if line.strip()]
        if not hosts:
            raise IncompleteEnvironmentError(
                "LSF's rank file "
                f"LSB_DJOB_RANKFILE={env['LSB_DJOB_RANKFILE']!r} lists no "
                "compute host after its first line. Set MASTER_ADDR to process "
                "0's host and MASTER_PORT to a free port there."
            )
        address = hosts[0]
    port = (
        read_port(env, "MASTER_PORT")
        if env.get("MASTER_PORT")
        else read_whole(env, "LSB_JOBID", minimum=0) % 1000 + 10000
    )
    return join(
        "lsf",
        env,
        world,
        rank,
        read_local_rank(env, "JSM_NAMESPACE_LOCAL_RANK"),
        address,
        port,
        keys + ("MASTER_ADDR", "MASTER_PORT"),
    )


_SLURM_NODELISTS = (
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
)


def slurm(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    """An srun step. Its batch script or an salloc shell shows SLURM_NTASKS
    and SLURM_PROCID too, but no SLURM_STEP_ID: that is no step (one process
    there is right)."""
    if not forced and "SLURM_STEP_ID" not in env:
        return None
    keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")
    tasks = (
        "SLURM_STEP_NUM_TASKS"
        if "SLURM_STEP_NUM_TASKS" in env
        else "SLURM_NTASKS"
    )
    nodelist = next(
        (k for k in _SLURM_NODELISTS if env.get(k)), "SLURM_STEP_NODELIST"
    )
    names = keys + (tasks, nodelist)
    require(
        env,
        "SLURM (an srun step)",
        names,
        fix=(
            "Start the script with srun inside the allocation, e.g. `srun "
            "python train.py` (srun sets all of them)."
        ),
    )
    world = read_whole(env, tasks)
    rank, local = (
        read_whole(env, "SLURM_PROCID", minimum=0),
        read_whole(env, "SLURM_LOCALID", minimum=0),
    )
    address, port = slurm_step_address(env)
    names = names + ("SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT")
    joined = join("slurm", env, world, rank, local, address, port, names)
    nnodes = _slurm_nodes(env, nodelist)
    nproc = node_processes(env, local_devices)
    if world != nnodes or nproc <= 1:
        return joined
    # One task per node on nodes with several devices: each task starts its
    # node's processes (rank = node rank * processes per node + index).
    node_rank = (
        read_whole(env, "SLURM_NODEID", minimum=0)
        if "SLURM_NODEID" in env
        else rank
    )
    return _node_launcher(
        "slurm",
        env,
        nnodes,
        node_rank,
        nproc,
        address,
        port,
        names,
        joined if world > 1 else Launch("slurm", SINGLE),
    )


def slurm_step_address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(first host of the step, port from the job and step ids), MASTER_ADDR /
    MASTER_PORT winning; None outside a step."""
    nodelist = next((env[k] for k in _SLURM_NODELISTS if env.get(k)), None)
    if (
        "SLURM_STEP_ID" not in env
        or "SLURM_JOB_ID" not in env
        or nodelist is None
    ):
        return None
    address = env.get("MASTER_ADDR") or hostlist.first_host(nodelist)
    if env.get("MASTER_PORT"):
        return address, read_port(env, "MASTER_PORT")
    # Both ids, so concurrent steps of one job do not share a port.
    ids = f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}".encode()
    return address, zlib.crc32(ids) % DERIVED_PORT_SPAN + DERIVED_PORT_BASE


def _slurm_nodes(env, nodelist):
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return sum(1 for _ in hostlist.hosts(env[nodelist]))


def pet(
    env: Mapping[str, str], local_devices: int, outside: Outside, forced: bool
) -> Launch | None:
    """A node launcher's PET_* variables (torchrun reads them as its options):
    one process per node, which starts PET_NPROC_PER_NODE processes."""
    if not forced and not any(
        k in env for k in ("PET_NNODES", "PET_NODE_RANK")
    ):
        return None
    address_name = (
        "PET_MASTER_ADDR" if env.get("PET_MASTER_ADDR") else "MASTER_ADDR"
    )
    port_name = (
        "PET_MASTER_PORT" if env.get("PET_MASTER_PORT") else "MASTER_PORT"
    )
    names = ("PET_NNODES", "PET_NODE_RANK", address_name, port_name)
    require(
        env,
        "a PET_* node launcher (Kubeflow)",
        names,
        fix="Set them as Kubeflow's TrainJob does, or start torchrun, which "
        "reads them.",
    )
    low, _, high = env["PET_NNODES"].partition(":")
    if high and high != low:
        raise IncompleteEnvironmentError(
            f"PET_NNODES={env['PET_NNODES']!r} asks for an elastic number of "
            "nodes, which needs torchrun's rendezvous: run the script with "
            "`torchrun train.py` (it reads the PET_* variables)."
        )
    nnodes = read_whole({"PET_NNODES": low}, "PET_NNODES")
    node_rank = read_whole(env, "PET_NODE_RANK", minimum=0)
    nproc = _pet_processes(env, local_devices)
    address, port = env[address_name], read_port(env, port_name)
    names = names + ("PET_NPROC_PER_NODE",)
    if "WORLD_SIZE" in env and read_whole(env, "WORLD_SIZE") != nnodes * nproc:
        raise IncompleteEnvironmentError(
            f"WORLD_SIZE={env['WORLD_SIZE']} but PET_NNODES={nnodes} nodes x "
            f"{nproc} processes per node make {nnodes * nproc} "
            f"({shown(present(env, names + (SPAWN_VARIABLE,)))}). Without a "
            f"GPU one process per node starts; set {SPAWN_VARIABLE}=N to start "
            "N CPU processes per node, or make WORLD_SIZE agree."
        )
    joined = join("pet", env, nnodes, node_rank, 0, address, port, names)
    if nproc == 1:
        return joined
    return _node_launcher(
        "pet",
        env,
        nnodes,
        node_rank,
        nproc,
        address,
        port,
        names,
        joined if nnodes > 1 else Launch("pet", SINGLE),
    )


def _pet_processes(env, local_devices):
    """Processes per node: PET_NPROC_PER_NODE on GPUs ("auto"/"gpu": one per
    GPU). On CPU 1 (Kubeflow writes the pod's CPU count there), unless
    KTD_SPAWN asks for more."""
    spawn = spawn_setting(env)
    if spawn:
        return spawn
    text = env.get("PET_NPROC_PER_NODE", "auto")
    if local_devices < 1:
        return 1
    if text in ("auto", "gpu"):
        return local_devices
    return read_whole(env, "PET_NPROC_PER_NODE")


def _node_launcher(
    name, env, nnodes, node_rank, nproc, address, port, names, fallback
):
    return Launch(
        name,
        SPAWN,
        world=nnodes * nproc,
        rank=None,
        local_rank=None,
        address=address,
        port=port,
        nproc=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        fallback=fallback,
        variables=present(env, names + (SPAWN_VARIABLE,)),
    )
