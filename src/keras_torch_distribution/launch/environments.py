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

A row matches only on its full set of variables. Where a row's variables
show a job of several processes but some are missing or disagree, it raises
`IncompleteEnvironmentError` naming what it found, what is missing and the
fix: a process never trains alone because its launcher went unrecognised.
MASTER_ADDR and MASTER_PORT win over an address or port a row derives.
KTD_CLUSTER=<row name> tries only that row (an error if it does not match);
KTD_CLUSTER=none skips them all. KTD_SPAWN=0 never starts local processes;
KTD_SPAWN=N starts N per node where processes are started (CPU included).
"""

import dataclasses
import re
import socket
import zlib

import keras_torch_distribution.launch.hostlist as hostlist

# torchrun's default MASTER_PORT, used for an address given without a port.
DEFAULT_PORT = 29500
CLUSTER_VARIABLE = "KTD_CLUSTER"
SPAWN_VARIABLE = "KTD_SPAWN"
# The variables keras.distribution.initialize() reads for its arguments.
KERAS_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)
# What a row makes of this process.
JOIN = "join"  # it is one process of a job of `world` processes
SPAWN = "spawn"  # it starts `nproc` processes on this node, then waits for them
SINGLE = "single"  # a world of one
# Ports derived from scheduler ids land in [61440, 65535], as JAX's do.
_DERIVED_PORT_BASE, _DERIVED_PORT_SPAN = 61440, 4096


class IncompleteEnvironmentError(RuntimeError):
    """A launcher's variables say this process is one of several, but some
    are missing or disagree: joining is impossible, training alone wrong."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What `initialize()` does, as `detect` found it.

    environment: the row that matched ("explicit", "torchelastic", ...).
    start: JOIN, SPAWN or SINGLE.
    world: the number of processes of the job.
    rank / local_rank: this process's (JOIN); None under SPAWN.
    address / port: process 0's host and port (under SPAWN on several
        nodes, node 0's rendezvous); None where torch reads them itself.
    init_method: what torch's rendezvous is given (JOIN).
    nproc / nnodes / node_rank: under SPAWN, the processes to start here,
        the nodes and this node's index: rank = node_rank * nproc + index.
    fallback: under SPAWN, what to do where processes cannot be started
        (an interactive session, `python -c`, first use): None means that
        is an error (the user asked for several processes).
    variables: the variables the decision was read from, with their values.
    """

    environment: str
    start: str
    world: int = 1
    rank: int | None = 0
    local_rank: int | None = 0
    address: str | None = None
    port: int | None = None
    init_method: str | None = None
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    fallback: "Launch | None" = None
    variables: tuple = ()

    def describe(self):
        """{field: value} for `ktd env`."""
        shown = {"environment": self.environment, "start": self.start}
        if self.start == SPAWN:
            shown.update(processes_per_node=self.nproc, nodes=self.nnodes,
                         node_rank=self.node_rank, world=self.world,
                         ranks=f"{self.node_rank * self.nproc}..."
                               f"{(self.node_rank + 1) * self.nproc - 1}")
        else:
            shown.update(world=self.world, rank=self.rank, local_rank=self.local_rank)
        shown.update(address=self.address, port=self.port, init_method=self.init_method)
        shown["read from"] = " ".join(f"{k}={v}" for k, v in self.variables) or "-"
        return shown


def detect(env, local_devices=0, job_addresses=None, num_processes=None,
           process_id=None, outside=None):
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
        world = _whole(env, "WORLD_SIZE")
        if world != given["num_processes"]:
            raise ValueError(
                f"initialize(num_processes={given['num_processes']}) but torchrun "
                f"started WORLD_SIZE={world} processes. Pass num_processes={world} "
                "or none, or launch with that many processes."
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
        num_processes = _whole(env, "KERAS_DISTRIBUTION_NUM_PROCESSES")
    if process_id is None and env.get("KERAS_DISTRIBUTION_PROCESS_ID"):
        process_id = _whole(env, "KERAS_DISTRIBUTION_PROCESS_ID", minimum=0)
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
    local = env.get("LOCAL_RANK", "0")
    return Launch(
        "explicit", JOIN if num_processes > 1 else SINGLE, num_processes, process_id,
        int(local) if local.isdigit() else 0, init_method=url,
        variables=(("job_addresses", job_addresses), ("num_processes", num_processes),
                   ("process_id", process_id)),
    )


def _check_rank(num_processes, process_id):
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} must be in [0, num_processes={num_processes})."
        )


def _fill(found, job_addresses, num_processes, process_id):
    """A row's Launch with the explicit values applied."""
    if num_processes is not None and num_processes != found.world:
        raise ValueError(
            f"initialize(num_processes={num_processes}) but {found.environment} "
            f"started {found.world} processes ({_shown(found.variables)}). Pass "
            f"num_processes={found.world} or none."
        )
    if process_id is not None and found.start == JOIN and process_id != found.rank:
        raise ValueError(
            f"initialize(process_id={process_id}) but {found.environment} made "
            f"this process rank {found.rank} ({_shown(found.variables)}). Pass "
            "no process_id."
        )
    if process_id is not None and found.start == SPAWN:
        raise ValueError(
            f"initialize(process_id={process_id}) but this process starts the "
            f"{found.nproc} processes of node {found.node_rank} for {found.environment} "
            f"({_shown(found.variables)}), which have ranks of their own. Pass no "
            "process_id."
        )
    if job_addresses is not None and found.start == JOIN:
        found = dataclasses.replace(found, address=None, port=None,
                                    init_method=coordinator_url(job_addresses))
    return found


def _local(env, local_devices, job_addresses, num_processes, process_id):
    """No launcher: one process, or this process starts the local ones (one
    per local device, KTD_SPAWN of them, or num_processes)."""
    if num_processes is None and job_addresses is None and process_id is None:
        nproc = _node_processes(env, local_devices)
        return _local_spawn(env, nproc) if nproc > 1 else Launch("local", SINGLE)
    if job_addresses is not None and (num_processes is None or process_id is None):
        raise ValueError(
            f"initialize(job_addresses={job_addresses!r}) also needs "
            f"num_processes and process_id (got num_processes={num_processes}, "
            f"process_id={process_id}), and no launcher's environment gives them."
        )
    if num_processes == 1 or num_processes is None:
        if process_id not in (None, 0):
            _check_rank(1, process_id)
        return Launch("local", SINGLE)
    if process_id is not None:
        raise ValueError(
            f"initialize(num_processes={num_processes}, process_id={process_id}) "
            "needs job_addresses='host:port' of process 0, or a launch by "
            f"torchrun / `ktd run -n {num_processes}`, which sets the environment; "
            f"or leave out process_id to start {num_processes} local processes."
        )
    return dataclasses.replace(_local_spawn(env, num_processes), environment="explicit",
                               fallback=None)


def _local_spawn(env, nproc):
    return Launch(
        "local", SPAWN, world=nproc, rank=None, local_rank=None,
        address=env.get("MASTER_ADDR"), port=_port_or_none(env, "MASTER_PORT"),
        nproc=nproc, fallback=Launch("local", SINGLE),
        variables=tuple((k, env[k]) for k in (SPAWN_VARIABLE,) if k in env),
    )


def spawn_setting(env):
    """KTD_SPAWN as an int (0: never start processes), or None when unset."""
    text = env.get(SPAWN_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(
            f"{SPAWN_VARIABLE}={env[SPAWN_VARIABLE]!r} is not a number of local "
            "processes: set 0 to never start local processes, N >= 1 to start N "
            "per node (also on CPU), or unset it (one per local GPU)."
        )
    return int(text)


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
    if not host or (port is not None
                    and not (port.isdigit() and 0 < int(port) < 2**16)):
        return None, None
    return host, port


# ---------------------------------------------------------------------------
# The rows
# ---------------------------------------------------------------------------


def _detected(env, local_devices, outside):
    """The first row that matches (each returns None when its variables are
    absent), or the one KTD_CLUSTER names; None: no launcher."""
    forced = env.get(CLUSTER_VARIABLE, "").strip().lower()
    if forced == "none":
        return None
    rows = {name: row for name, row in _ROWS}
    if forced:
        if forced not in rows:
            raise ValueError(
                f"{CLUSTER_VARIABLE}={env[CLUSTER_VARIABLE]!r} names no environment: "
                f"set one of {', '.join(rows)}, or none (no detection), or unset it "
                "(detect)."
            )
        return rows[forced](env, local_devices, outside, forced=True)
    for _, row in _ROWS:
        found = row(env, local_devices, outside, forced=False)
        if found is not None:
            return found
    return None


def _torchelastic(env, local_devices, outside, forced):
    if not forced and "TORCHELASTIC_RUN_ID" not in env:
        return None
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    _require(env, "torchrun", names, also=("TORCHELASTIC_RUN_ID",),
             fix="Start it with torchrun or `ktd run -n N` (they set all of them).")
    world = _whole(env, "WORLD_SIZE")
    return _join("torchelastic", env, world, _whole(env, "RANK", minimum=0),
                 _local_rank(env, "LOCAL_RANK"), env["MASTER_ADDR"],
                 _port(env, "MASTER_PORT"), names + ("LOCAL_RANK",), "env://")


def _generic(env, local_devices, outside, forced):
    """MASTER_ADDR, MASTER_PORT, WORLD_SIZE and a rank: RANK, or
    NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK, or JOB_COMPLETION_INDEX."""
    if not forced and "WORLD_SIZE" not in env:
        return None
    if forced:
        _require(env, "the generic torch variables", ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
                 fix="Set them (and RANK) for every process, as torchrun does.")
    world = _whole(env, "WORLD_SIZE")
    pet_nproc = env.get("PET_NPROC_PER_NODE", "")
    if (not forced and "LOCAL_RANK" not in env and pet_nproc.isdigit()
            and int(pet_nproc) > 1):
        return None  # RANK is a node's rank here: the pet row starts the processes
    if world == 1 and not forced:
        return Launch("generic", SINGLE, variables=(("WORLD_SIZE", "1"),))
    rank_names = ("RANK",)
    if "RANK" in env:
        rank = _whole(env, "RANK", minimum=0)
    elif "LOCAL_RANK" in env and "NODE_RANK" in env:
        node, local = _whole(env, "NODE_RANK", minimum=0), _whole(env, "LOCAL_RANK", minimum=0)
        if "LOCAL_WORLD_SIZE" in env:
            rank = node * _whole(env, "LOCAL_WORLD_SIZE") + local
        elif node == 0:
            rank = local
        else:
            rank = None
        rank_names = ("NODE_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    elif "JOB_COMPLETION_INDEX" in env:
        rank, rank_names = _whole(env, "JOB_COMPLETION_INDEX", minimum=0), ("JOB_COMPLETION_INDEX",)
    else:
        rank = None
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
    if rank is None:
        missing.append("RANK (or NODE_RANK, LOCAL_WORLD_SIZE and LOCAL_RANK)")
    if missing:
        found = _shown(_present(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK",
                                      "MASTER_ADDR", "MASTER_PORT")))
        raise IncompleteEnvironmentError(
            f"WORLD_SIZE={world} says this process is one of {world}, but the "
            f"environment lacks {', '.join(missing)} to join the others (found "
            f"{found}). Launch the script with `ktd run -n {world} script.py` or "
            "torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; or "
            "call keras.distribution.initialize(job_addresses='host:port' "
            f"(process 0's), num_processes={world}, process_id=...) on every "
            "process; or unset WORLD_SIZE for a one-process run."
        )
    names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") + rank_names
    return _join("generic", env, world, rank, _local_rank(env, "LOCAL_RANK"),
                 env["MASTER_ADDR"], _port(env, "MASTER_PORT"), names,
                 "env://" if "RANK" in env else None)


# Open MPI <= 4 publishes its launcher's URI; JAX reads the host and job id
# from it (jax/_src/clusters/ompi_cluster.py).
_ORTE_URI = re.compile(r"^(\d+)\.\d+;tcp6?://\[?([0-9a-zA-Z:.\-]+?)\]?(?:,|:\d+)")


def _open_mpi(env, local_devices, outside, forced):
    keys = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
    if not forced and not any(k in env for k in keys):
        return None
    _require(env, "Open MPI", keys, fix="Start it with mpirun (Open MPI sets both).")
    world = _whole(env, "OMPI_COMM_WORLD_SIZE")
    rank = _whole(env, "OMPI_COMM_WORLD_RANK", minimum=0)
    local = _local_rank(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    address = port = None
    match = _ORTE_URI.match(env.get("OMPI_MCA_orte_hnp_uri", ""))
    if match:
        address = match.group(2)
        port = (int(match.group(1)) // _DERIVED_PORT_SPAN) % _DERIVED_PORT_SPAN + _DERIVED_PORT_BASE
    names = keys + ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_orte_hnp_uri")
    return _mpi_join("openmpi", "Open MPI", env, outside, world, rank, local, address, port,
                     names)


def _pmi(env, local_devices, outside, forced):
    keys = ("PMI_SIZE", "PMI_RANK")
    if not forced and not any(k in env for k in keys):
        return None
    _require(env, "MPICH / Intel MPI (PMI)", keys,
             fix="Start it with mpiexec / mpirun (Hydra sets both).")
    world, rank = _whole(env, "PMI_SIZE"), _whole(env, "PMI_RANK", minimum=0)
    address = port = None
    slurm = _slurm_step_address(env)
    if slurm is not None and env.get("SLURM_PROCID") == env["PMI_RANK"]:
        address, port = slurm  # srun --mpi=pmi2: SLURM's ranks are these ranks
    names = keys + ("MPI_LOCALRANKID",)
    return _mpi_join("pmi", "MPICH / Intel MPI", env, outside, world, rank,
                     _local_rank(env, "MPI_LOCALRANKID"), address, port, names)


def _mvapich(env, local_devices, outside, forced):
    keys = ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK")
    if not forced and not any(k in env for k in keys):
        return None
    _require(env, "MVAPICH2", keys, fix="Start it with mpirun_rsh / mpiexec.")
    world, rank = _whole(env, "MV2_COMM_WORLD_SIZE"), _whole(env, "MV2_COMM_WORLD_RANK", minimum=0)
    names = keys + ("MV2_COMM_WORLD_LOCAL_RANK",)
    return _mpi_join("mvapich", "MVAPICH2", env, outside, world, rank,
                     _local_rank(env, "MV2_COMM_WORLD_LOCAL_RANK"), None, None, names)


def _mpi_join(name, what, env, outside, world, rank, local, address, port, names):
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
            f"({_shown(_present(env, names))}), but nothing says where process 0 "
            "is: MASTER_ADDR is missing (and mpi4py, which could ask rank 0, is not "
            "installed). Set MASTER_ADDR to process 0's host (reachable from every "
            "process) and MASTER_PORT to a free port there, for every process, e.g. "
            "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`; or install "
            "mpi4py; or launch with torchrun / `ktd run` instead."
        )
    port = _port(env, "MASTER_PORT") if env.get("MASTER_PORT") else (port or DEFAULT_PORT)
    return _join(name, env, world, rank, local, address, port, names)


def _lsf(env, local_devices, outside, forced):
    keys = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK",
            "JSM_NAMESPACE_LOCAL_RANK")
    if not forced and not any(k.startswith("JSM_") and k in env for k in keys):
        return None
    _require(env, "LSF jsrun", keys, fix="Start it with jsrun (it sets all of them).")
    world, rank = _whole(env, "JSM_NAMESPACE_SIZE"), _whole(env, "JSM_NAMESPACE_RANK", minimum=0)
    address = env.get("MASTER_ADDR")
    if not address:
        # Line 1 is the launch node; the compute hosts follow, rank 0's first.
        lines = outside.read_text(env["LSB_DJOB_RANKFILE"]).splitlines()[1:]
        hosts = [line.strip() for line in lines if line.strip()]
        if not hosts:
            raise IncompleteEnvironmentError(
                f"LSF's rank file LSB_DJOB_RANKFILE={env['LSB_DJOB_RANKFILE']!r} lists "
                "no compute host after its first line. Set MASTER_ADDR to process 0's "
                "host and MASTER_PORT to a free port there."
            )
        address = hosts[0]
    port = (_port(env, "MASTER_PORT") if env.get("MASTER_PORT")
            else _whole(env, "LSB_JOBID", minimum=0) % 1000 + 10000)
    return _join("lsf", env, world, rank, _local_rank(env, "JSM_NAMESPACE_LOCAL_RANK"),
                 address, port, keys + ("MASTER_ADDR", "MASTER_PORT"))


_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _slurm(env, local_devices, outside, forced):
    """An srun step. Its batch script or an salloc shell shows SLURM_NTASKS
    and SLURM_PROCID too, but no SLURM_STEP_ID: that is no step (one process
    there is right)."""
    if not forced and "SLURM_STEP_ID" not in env:
        return None
    keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")
    tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    nodelist = next((k for k in _SLURM_NODELISTS if env.get(k)), "SLURM_STEP_NODELIST")
    names = keys + (tasks, nodelist)
    _require(env, "SLURM (an srun step)", names,
             fix="Start the script with srun inside the allocation, e.g. `srun python "
                 "train.py` (srun sets all of them).")
    world = _whole(env, tasks)
    rank, local = _whole(env, "SLURM_PROCID", minimum=0), _whole(env, "SLURM_LOCALID", minimum=0)
    address, port = _slurm_step_address(env)
    names = names + ("SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT")
    joined = _join("slurm", env, world, rank, local, address, port, names)
    nnodes = _slurm_nodes(env, nodelist)
    nproc = _node_processes(env, local_devices)
    if world != nnodes or nproc <= 1:
        return joined
    # One task per node on nodes with several devices: each task starts its
    # node's processes (rank = node rank * processes per node + index).
    node_rank = _whole(env, "SLURM_NODEID", minimum=0) if "SLURM_NODEID" in env else rank
    return _node_launcher("slurm", env, nnodes, node_rank, nproc, address, port,
                          names, joined if world > 1 else Launch("slurm", SINGLE))


def _slurm_step_address(env):
    """(first host of the step, port from the job and step ids), MASTER_ADDR /
    MASTER_PORT winning; None outside a step."""
    nodelist = next((env[k] for k in _SLURM_NODELISTS if env.get(k)), None)
    if "SLURM_STEP_ID" not in env or "SLURM_JOB_ID" not in env or nodelist is None:
        return None
    address = env.get("MASTER_ADDR") or hostlist.first_host(nodelist)
    if env.get("MASTER_PORT"):
        return address, _port(env, "MASTER_PORT")
    # Both ids, so concurrent steps of one job do not share a port.
    ids = f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}".encode()
    return address, zlib.crc32(ids) % _DERIVED_PORT_SPAN + _DERIVED_PORT_BASE


def _slurm_nodes(env, nodelist):
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return sum(1 for _ in hostlist.hosts(env[nodelist]))


def _pet(env, local_devices, outside, forced):
    """A node launcher's PET_* variables (torchrun reads them as its options):
    one process per node, which starts PET_NPROC_PER_NODE processes."""
    if not forced and not any(k in env for k in ("PET_NNODES", "PET_NODE_RANK")):
        return None
    address_name = "PET_MASTER_ADDR" if env.get("PET_MASTER_ADDR") else "MASTER_ADDR"
    port_name = "PET_MASTER_PORT" if env.get("PET_MASTER_PORT") else "MASTER_PORT"
    names = ("PET_NNODES", "PET_NODE_RANK", address_name, port_name)
    _require(env, "a PET_* node launcher (Kubeflow)", names,
             fix="Set them as Kubeflow's TrainJob does, or start torchrun, which "
                 "reads them.")
    low, _, high = env["PET_NNODES"].partition(":")
    if high and high != low:
        raise IncompleteEnvironmentError(
            f"PET_NNODES={env['PET_NNODES']!r} asks for an elastic number of nodes, "
            "which needs torchrun's rendezvous: run the script with `torchrun "
            "train.py` (it reads the PET_* variables)."
        )
    nnodes = _whole({"PET_NNODES": low}, "PET_NNODES")
    node_rank = _whole(env, "PET_NODE_RANK", minimum=0)
    nproc = _pet_processes(env, local_devices)
    address, port = env[address_name], _port(env, port_name)
    names = names + ("PET_NPROC_PER_NODE",)
    if "WORLD_SIZE" in env and _whole(env, "WORLD_SIZE") != nnodes * nproc:
        raise IncompleteEnvironmentError(
            f"WORLD_SIZE={env['WORLD_SIZE']} but PET_NNODES={nnodes} nodes x {nproc} "
            f"processes per node make {nnodes * nproc} "
            f"({_shown(_present(env, names + (SPAWN_VARIABLE,)))}). Without a GPU "
            f"one process per node starts; set {SPAWN_VARIABLE}=N to start N CPU "
            "processes per node, or make WORLD_SIZE agree."
        )
    joined = _join("pet", env, nnodes, node_rank, 0, address, port, names)
    if nproc == 1:
        return joined
    return _node_launcher("pet", env, nnodes, node_rank, nproc, address, port, names,
                          joined if nnodes > 1 else Launch("pet", SINGLE))


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
    return _whole(env, "PET_NPROC_PER_NODE")


def _node_processes(env, local_devices):
    """Processes started on this node: KTD_SPAWN, else one per local
    accelerator. (KTD_SPAWN=0, never start any, is `spawn`'s to refuse.)"""
    return spawn_setting(env) or max(local_devices, 1)


def _node_launcher(name, env, nnodes, node_rank, nproc, address, port, names, fallback):
    return Launch(
        name, SPAWN, world=nnodes * nproc, rank=None, local_rank=None,
        address=address, port=port, nproc=nproc, nnodes=nnodes, node_rank=node_rank,
        fallback=fallback, variables=_present(env, names + (SPAWN_VARIABLE,)),
    )


_ROWS = (
    ("torchelastic", _torchelastic),
    ("generic", _generic),
    ("openmpi", _open_mpi),
    ("pmi", _pmi),
    ("mvapich", _mvapich),
    ("lsf", _lsf),
    ("slurm", _slurm),
    ("pet", _pet),
)
ENVIRONMENTS = tuple(name for name, _ in _ROWS)


# ---------------------------------------------------------------------------
# Reading variables
# ---------------------------------------------------------------------------


def _join(name, env, world, rank, local, address, port, names, init_method=None):
    if not 0 <= rank < world:
        raise IncompleteEnvironmentError(
            f"{name} made this process rank {rank} of {world} processes "
            f"({_shown(_present(env, names))}): a rank must be in [0, {world}). "
            "Check how the job was started."
        )
    if world == 1:
        return Launch(name, SINGLE, variables=_present(env, names))
    return Launch(
        name, JOIN, world, rank, local, address, port,
        init_method or f"tcp://{_bracketed(address)}:{port}",
        variables=_present(env, names),
    )


def _bracketed(host):
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _require(env, what, names, also=(), fix=""):
    """Raise naming what was found and what is missing, unless all of
    `names` are set."""
    missing = [n for n in names if not env.get(n)]
    if missing:
        found = _present(env, tuple(names) + tuple(also))
        raise IncompleteEnvironmentError(
            f"This process looks started by {what} ({_shown(found) or 'nothing set'}), "
            f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing, "
            f"so it cannot join the other processes. {fix} Or set "
            f"{CLUSTER_VARIABLE}=none to run one process and ignore these variables."
        )


def _present(env, names):
    return tuple((n, env[n]) for n in dict.fromkeys(names) if env.get(n))


def _shown(variables):
    return ", ".join(f"{k}={v}" for k, v in variables)


def _whole(env, name, minimum=1):
    text = env[name].strip()
    if not text.isdigit() or int(text) < minimum:
        what = "a number of processes" if minimum else "a rank or index"
        raise ValueError(
            f"{name}={env[name]!r} is not {what} (a whole number >= {minimum}): "
            "the launcher sets it so; correct it, or unset it for a one-process run."
        )
    return int(text)


def _local_rank(env, name):
    return _whole(env, name, minimum=0) if env.get(name) else 0


def _port(env, name):
    text = env[name].strip()
    if not text.isdigit() or not 0 < int(text) < 2**16:
        raise ValueError(
            f"{name}={env[name]!r} is not a port: give a number in [1, 65535], the "
            "same free port for every process."
        )
    return int(text)


def _port_or_none(env, name):
    return _port(env, name) if env.get(name) else None


class Outside:
    """What detection reads beyond the environment variables; tests replace it."""

    def read_text(self, path):
        with open(path, encoding="utf-8") as f:
            return f.read()

    def mpi_address(self):
        """(rank 0's host name, a port free there), broadcast from rank 0 to
        every rank of MPI_COMM_WORLD by mpi4py; None without mpi4py.
        Collective over MPI: every rank reaches it together, in initialize()."""
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        told = None
        if MPI.COMM_WORLD.Get_rank() == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                told = (socket.gethostname(), probe.getsockname()[1])
        return MPI.COMM_WORLD.bcast(told, root=0)
