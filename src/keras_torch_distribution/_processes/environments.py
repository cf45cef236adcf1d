"""Which launcher started this process, and how `initialize()` joins its job.

`detect(env, local_devices, ...)` is a pure function of the environment
variables (and the number of local accelerators): it names the launcher
and gives the coordinator's address and port, the number of processes,
this process's rank and local rank, or says that this process should start
the processes of its node itself. Rows are tried innermost launcher first,
because outer launchers' variables leak into the processes inner ones
start (torchrun inside an srun step sees SLURM's; mpirun's ranks inside
SLURM see the step of the per-node daemons):

    explicit arguments / KERAS_DISTRIBUTION_*  (what is given wins; the rest
                        is filled in by the rows below)
    torchelastic  torchrun, `ktd run`, and this package's own local processes
    generic       MASTER_ADDR, MASTER_PORT, WORLD_SIZE and a rank (Kubeflow
                  PyTorchJob, Lightning children, indexed Jobs, by hand)
    openmpi       OMPI_COMM_WORLD_*
    pmi           MPICH / Intel MPI (PMI_RANK, PMI_SIZE)
    mvapich       MVAPICH2 (MV2_COMM_WORLD_*)
    lsf           LSF jsrun (JSM_NAMESPACE_*)
    slurm         an srun step (SLURM_STEP_ID: the batch script itself or an
                  salloc shell is no step)
    pet           a node launcher's PET_* variables (Kubeflow Trainer v2)
    local         nothing: one process, or one per local device

Each row is one function of `schedulers` or `mpi`; `record` holds the `Launch`
record and the readers. A row matches only on its full set of variables. Where a
row's variables show a job of several processes but some are missing or
disagree, it raises `IncompleteEnvironmentError` naming what it found, what is
missing and the fix: a process never trains alone because its launcher went
unrecognised.
MASTER_ADDR and MASTER_PORT win over an address or port a row derives.
KTD_CLUSTER=<row name> tries only that row (an error if it does not match);
KTD_CLUSTER=none skips them all. KTD_SPAWN=0 never starts local processes;
KTD_SPAWN=N starts N per node where processes are started (CPU included).
"""

import dataclasses

import keras_torch_distribution._processes.mpi as mpi
import keras_torch_distribution._processes.schedulers as schedulers
from keras_torch_distribution._processes.record import CLUSTER_VARIABLE
from keras_torch_distribution._processes.record import DEFAULT_PORT  # noqa: F401
from keras_torch_distribution._processes.record import JOIN
from keras_torch_distribution._processes.record import SINGLE
from keras_torch_distribution._processes.record import SPAWN
from keras_torch_distribution._processes.record import SPAWN_VARIABLE  # noqa: F401
from keras_torch_distribution._processes.record import (
    IncompleteEnvironmentError,  # noqa: F401
)
from keras_torch_distribution._processes.record import Launch
from keras_torch_distribution._processes.record import Outside
from keras_torch_distribution._processes.record import node_processes
from keras_torch_distribution._processes.record import read_local_rank_or_none
from keras_torch_distribution._processes.record import read_port_or_none
from keras_torch_distribution._processes.record import read_whole
from keras_torch_distribution._processes.record import shown
from keras_torch_distribution._processes.record import spawn_setting  # noqa: F401

# The variables keras.distribution.initialize() reads for its arguments.
KERAS_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


def detect(
    env,
    local_devices=0,
    job_addresses=None,
    num_processes=None,
    process_id=None,
    outside=None,
):
    """The Launch for environment `env` (a mapping of variables).

    local_devices: the accelerators this process would use (0 on CPU).
    job_addresses / num_processes / process_id: initialize()'s arguments;
    KERAS_DISTRIBUTION_* fill those not given. outside: what is read
    beyond the variables (LSF's rank file; rank 0's address over MPI),
    `Outside()` by default.
    """
    given = _given(env, job_addresses, num_processes, process_id)
    if all(value is not None for value in given.values()):
        return _explicit(env, **given)
    if given["num_processes"] is not None and "WORLD_SIZE" in env:
        # A disagreement is a better message than a missing variable.
        world = read_whole(env, "WORLD_SIZE")
        if world != given["num_processes"]:
            raise ValueError(
                f"initialize(num_processes={given['num_processes']}) but "
                f"torchrun started WORLD_SIZE={world} processes. Pass "
                f"num_processes={world} or none, or launch with that many "
                "processes."
            )
    found = _detected(env, local_devices, outside or Outside())
    if found is None:
        return _local(env, local_devices, **given)
    return _fill(found, **given)


# ---------------------------------------------------------------------------
# Explicit values
# ---------------------------------------------------------------------------


def _given(env, job_addresses, num_processes, process_id):
    """initialize()'s arguments, KERAS_DISTRIBUTION_* for those not given."""
    if job_addresses is None:
        job_addresses = env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES") or None
    if num_processes is None and env.get("KERAS_DISTRIBUTION_NUM_PROCESSES"):
        num_processes = read_whole(env, "KERAS_DISTRIBUTION_NUM_PROCESSES")
    if process_id is None and env.get("KERAS_DISTRIBUTION_PROCESS_ID"):
        process_id = read_whole(env, "KERAS_DISTRIBUTION_PROCESS_ID", minimum=0)
    return {
        "job_addresses": job_addresses,
        "num_processes": None if num_processes is None else int(num_processes),
        "process_id": None if process_id is None else int(process_id),
    }


def _explicit(env, job_addresses, num_processes, process_id):
    addresses = [a for a in job_addresses.split(",") if a.strip()]
    if len(addresses) > 1 and len(addresses) != num_processes:
        raise ValueError(
            f"job_addresses lists {len(addresses)} jobs but "
            f"num_processes={num_processes}; give one address per process "
            "or only the coordinator's."
        )
    _check_rank(num_processes, process_id)
    url = coordinator_url(job_addresses)
    # Without LOCAL_RANK, rendezvous counts the processes of each host on the
    # store: taking 0 would put every process of a host on GPU 0.
    local = (
        read_local_rank_or_none(env, "LOCAL_RANK") if num_processes > 1 else 0
    )
    return Launch(
        "explicit",
        JOIN if num_processes > 1 else SINGLE,
        num_processes,
        process_id,
        local,
        init_method=url,
        variables=(
            ("job_addresses", job_addresses),
            ("num_processes", num_processes),
            ("process_id", process_id),
        ),
    )


def _check_rank(num_processes, process_id):
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} must be in [0, "
            f"num_processes={num_processes})."
        )


def _fill(found, job_addresses, num_processes, process_id):
    """A row's Launch with the explicit values applied."""
    if num_processes is not None and num_processes != found.world:
        raise ValueError(
            f"initialize(num_processes={num_processes}) but "
            f"{found.environment} started {found.world} processes "
            f"({shown(found.variables)}). Pass num_processes={found.world} or "
            "none."
        )
    if (
        process_id is not None
        and found.start == JOIN
        and process_id != found.rank
    ):
        raise ValueError(
            f"initialize(process_id={process_id}) but {found.environment} made "
            f"this process rank {found.rank} ({shown(found.variables)}). Pass "
            "no process_id."
        )
    if process_id is not None and found.start == SPAWN:
        raise ValueError(
            f"initialize(process_id={process_id}) but this process starts the "
            f"{found.nproc} processes of node {found.node_rank} for "
            f"{found.environment} ({shown(found.variables)}), which have ranks "
            "of their own. Pass no process_id."
        )
    if job_addresses is not None and found.start == JOIN:
        found = dataclasses.replace(
            found,
            address=None,
            port=None,
            init_method=coordinator_url(job_addresses),
        )
    return found


def _local(env, local_devices, job_addresses, num_processes, process_id):
    """No launcher: one process, or this process starts the local ones (one
    per local device, KTD_SPAWN of them, or num_processes)."""
    if num_processes is None and job_addresses is None and process_id is None:
        nproc = node_processes(env, local_devices)
        return (
            _local_spawn(env, nproc) if nproc > 1 else Launch("local", SINGLE)
        )
    if job_addresses is not None and (
        num_processes is None or process_id is None
    ):
        raise ValueError(
            f"initialize(job_addresses={job_addresses!r}) also needs "
            f"num_processes and process_id (got num_processes={num_processes}, "
            f"process_id={process_id}), and no launcher's environment gives "
            "them."
        )
    if num_processes == 1 or num_processes is None:
        if process_id not in (None, 0):
            _check_rank(1, process_id)
        return Launch("local", SINGLE)
    if process_id is not None:
        raise ValueError(
            f"initialize(num_processes={num_processes}, "
            f"process_id={process_id}) needs job_addresses='host:port' of "
            "process 0, or a launch by torchrun / `ktd run -n "
            f"{num_processes}`, which sets the environment; or leave out "
            f"process_id to start {num_processes} local processes."
        )
    return dataclasses.replace(
        _local_spawn(env, num_processes), environment="explicit", fallback=None
    )


def _local_spawn(env, nproc):
    return Launch(
        "local",
        SPAWN,
        world=nproc,
        rank=None,
        local_rank=None,
        address=env.get("MASTER_ADDR"),
        port=read_port_or_none(env, "MASTER_PORT"),
        nproc=nproc,
        fallback=Launch("local", SINGLE),
        variables=tuple((k, env[k]) for k in (SPAWN_VARIABLE,) if k in env),
    )


def coordinator_url(job_addresses):
    """torch init_method from Keras' job_addresses: the first entry, process
    0's "host:port" (or "host", meaning port DEFAULT_PORT), or an init URL
    such as "tcp://host:port" or "file:///path"."""
    first = job_addresses.split(",")[0].strip()
    if "://" in first:
        return first
    host, port = host_and_port(first)
    if host is None:
        raise ValueError(
            f"job_addresses={job_addresses!r} is not 'host:port' or 'host' "
            f"(process 0's address first; port {DEFAULT_PORT} when left out) "
            "nor an init URL such as 'tcp://host:port' or 'file:///path'. "
            "Give e.g. job_addresses='10.0.0.1:1234'."
        )
    return f"tcp://{host}:{DEFAULT_PORT if port is None else port}"


def host_and_port(address):
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
    if not host or (
        port is not None and not (port.isdigit() and 0 < int(port) < 2**16)
    ):
        return None, None
    return host, port


# The rows, in the order they are tried.
ROWS = (
    ("torchelastic", schedulers.torchelastic),
    ("generic", schedulers.generic),
    ("openmpi", mpi.open_mpi),
    ("pmi", mpi.pmi),
    ("mvapich", mpi.mvapich),
    ("lsf", schedulers.lsf),
    ("slurm", schedulers.slurm),
    ("pet", schedulers.pet),
)


def _detected(env, local_devices, outside):
    """The first row that matches (each returns None when its variables are
    absent), or the one KTD_CLUSTER names; None: no launcher."""
    forced = env.get(CLUSTER_VARIABLE, "").strip().lower()
    if forced == "none":
        return None
    rows = {name: row for name, row in ROWS}
    if forced:
        if forced not in rows:
            raise ValueError(
                f"{CLUSTER_VARIABLE}={env[CLUSTER_VARIABLE]!r} names no "
                f"environment: set one of {', '.join(rows)}, or none (no "
                "detection), or unset it (detect)."
            )
        return rows[forced](env, local_devices, outside, forced=True)
    for _, row in ROWS:
        found = row(env, local_devices, outside, forced=False)
        if found is not None:
            return found
    return None
