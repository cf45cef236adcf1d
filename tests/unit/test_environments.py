"""Which launcher started this process: `_processes.environments.detect` on the
variables each scheduler sets (the cases T1-T26 of the design note
design/clusters.md), the SLURM host list parser, and the errors of
incomplete or inconsistent variables. Pure functions: nothing starts.
Launches with these variables are in e2e/test_clusters.py.
"""

import socket
import sys
import types
import zlib

import pytest

from keras_torch_distribution._processes import hostlist
from keras_torch_distribution._processes.environments import JOIN
from keras_torch_distribution._processes.environments import SINGLE
from keras_torch_distribution._processes.environments import SPAWN
from keras_torch_distribution._processes.environments import (
    IncompleteEnvironmentError,
)
from keras_torch_distribution._processes.environments import Outside
from keras_torch_distribution._processes.environments import detect

T1 = {
    "TORCHELASTIC_RUN_ID": "x",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
T3 = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}
# Derived from the job and step ids (crc32 of "123456.0"), in [61440, 65535].
T3_PORT = zlib.crc32(b"123456.0") % 4096 + 61440
OMPI_URI = "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"


def _where(launch):
    return (
        launch.environment,
        launch.start,
        launch.address,
        launch.port,
        launch.world,
        launch.rank,
        launch.local_rank,
    )


# ---------------------------------------------------------------------------
# One row per launcher
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, env, expected",
    [
        (
            "T1 torchrun",
            T1,
            ("torchelastic", JOIN, "127.0.0.1", 29500, 2, 1, 1),
        ),
        (
            "T2 torchrun inside an srun step",
            dict(
                T1,
                SLURM_JOB_ID="9",
                SLURM_STEP_ID="0",
                SLURM_PROCID="0",
                SLURM_LOCALID="0",
                SLURM_NTASKS="1",
                SLURM_STEP_NODELIST="n1",
            ),
            ("torchelastic", JOIN, "127.0.0.1", 29500, 2, 1, 1),
        ),
        ("T3 srun step", T3, ("slurm", JOIN, "node001", T3_PORT, 4, 3, 1)),
        (
            "T4 srun step, MASTER_ADDR/PORT win",
            dict(T3, MASTER_ADDR="10.0.0.5", MASTER_PORT="1234"),
            ("slurm", JOIN, "10.0.0.5", 1234, 4, 3, 1),
        ),
        (
            "T5 sbatch body / salloc shell: no step",
            {
                "SLURM_JOB_ID": "123",
                "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
            },
            ("local", SINGLE, None, None, 1, 0, 0),
        ),
        (
            "T7 Open MPI inside SLURM",
            dict(
                T3,
                OMPI_MCA_orte_hnp_uri=OMPI_URI,
                OMPI_COMM_WORLD_SIZE="4",
                OMPI_COMM_WORLD_RANK="2",
                OMPI_COMM_WORLD_LOCAL_RANK="0",
            ),
            ("openmpi", JOIN, "10.96.0.1", 62624, 4, 2, 0),
        ),
        (
            "T8 Open MPI 5 with MASTER_ADDR/PORT",
            {
                "PRTE_LAUNCHED": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "MASTER_ADDR": "h0",
                "MASTER_PORT": "2345",
            },
            ("openmpi", JOIN, "h0", 2345, 2, 1, 1),
        ),
        (
            "T9 MPICH / Intel MPI",
            {
                "PMI_RANK": "1",
                "PMI_SIZE": "2",
                "MPI_LOCALRANKID": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29501",
            },
            ("pmi", JOIN, "127.0.0.1", 29501, 2, 1, 1),
        ),
        (
            "MPICH under srun --mpi=pmi2: SLURM's address",
            dict(T3, PMI_RANK="3", PMI_SIZE="4", MPI_LOCALRANKID="1"),
            ("pmi", JOIN, "node001", T3_PORT, 4, 3, 1),
        ),
        (
            "T10 MVAPICH2",
            {
                "MV2_COMM_WORLD_RANK": "0",
                "MV2_COMM_WORLD_SIZE": "2",
                "MV2_COMM_WORLD_LOCAL_RANK": "0",
                "MASTER_ADDR": "h0",
                "MASTER_PORT": "2345",
            },
            ("mvapich", JOIN, "h0", 2345, 2, 0, 0),
        ),
        (
            "T12 Kubeflow PyTorchJob, one process per pod",
            {
                "MASTER_ADDR": "pj-master-0",
                "MASTER_PORT": "23456",
                "WORLD_SIZE": "3",
                "RANK": "1",
                "PET_MASTER_ADDR": "pj-master-0",
                "PET_MASTER_PORT": "23456",
                "PET_NODE_RANK": "1",
                "PET_NNODES": "3",
                "KUBERNETES_SERVICE_HOST": "10.0.0.1",
                "PYTHONUNBUFFERED": "1",
            },
            # No LOCAL_RANK: counted on the rendezvous store (rendezvous).
            ("generic", JOIN, "pj-master-0", 23456, 3, 1, None),
        ),
        (
            "T14 Kubeflow Trainer v2, one device",
            {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "auto",
                "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "tj-node-0-0.tj",
                "PET_MASTER_PORT": "29500",
            },
            ("pet", JOIN, "tj-node-0-0.tj", 29500, 2, 1, 0),
        ),
        (
            "T15 Lightning child",
            {
                "LOCAL_RANK": "1",
                "NODE_RANK": "0",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29502",
            },
            ("generic", JOIN, "127.0.0.1", 29502, 2, 1, 1),
        ),
        (
            "generic, node rank x local world size + local rank",
            {
                "LOCAL_RANK": "1",
                "NODE_RANK": "2",
                "LOCAL_WORLD_SIZE": "2",
                "WORLD_SIZE": "6",
                "MASTER_ADDR": "m",
                "MASTER_PORT": "1",
            },
            ("generic", JOIN, "m", 1, 6, 5, 1),
        ),
        (
            "T16 Indexed Job",
            {
                "JOB_COMPLETION_INDEX": "2",
                "WORLD_SIZE": "4",
                "MASTER_ADDR": "m",
                "MASTER_PORT": "1",
            },
            ("generic", JOIN, "m", 1, 4, 2, None),
        ),
        (
            "T19 KTD_CLUSTER=none",
            dict(T3, KTD_CLUSTER="none"),
            ("local", SINGLE, None, None, 1, 0, 0),
        ),
        (
            "KTD_CLUSTER forces a row under a more inner one",
            dict(T1, **T3, KTD_CLUSTER="slurm"),
            ("slurm", JOIN, "127.0.0.1", 29500, 4, 3, 1),
        ),
        ("T20 nothing, CPU", {}, ("local", SINGLE, None, None, 1, 0, 0)),
        (
            "T24 a started process never starts again",
            dict(T1, KTD_LAUNCHED="1"),
            ("torchelastic", JOIN, "127.0.0.1", 29500, 2, 1, 1),
        ),
        (
            "world of one",
            dict(T3, SLURM_NTASKS="1", SLURM_PROCID="0"),
            ("slurm", SINGLE, None, None, 1, 0, 0),
        ),
    ],
)
def test_each_launcher_is_detected(case, env, expected):
    assert _where(detect(env)) == expected


def test_generic_and_torchelastic_hand_torch_env_and_others_a_tcp_url():
    assert detect(T1).init_method == "env://"
    assert detect(T3).init_method == f"tcp://node001:{T3_PORT}"
    lightning_child = {
        "LOCAL_RANK": "1",
        "NODE_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "::1",
        "MASTER_PORT": "29502",
    }
    # Without RANK, torch's env:// could not read the rank: a URL with it.
    assert detect(lightning_child).init_method == "tcp://[::1]:29502"


def test_lsf_reads_the_first_compute_host_of_its_rank_file(tmp_path):
    rank_file = tmp_path / "ranks"
    rank_file.write_text(
        "launch\nh1\nh1\nh2\nh2\n"
    )  # read by Outside().read_text
    env = {
        "LSB_JOBID": "4242",
        "LSB_DJOB_RANKFILE": str(rank_file),
        "JSM_NAMESPACE_SIZE": "4",
        "JSM_NAMESPACE_RANK": "2",
        "JSM_NAMESPACE_LOCAL_RANK": "0",
    }
    assert _where(detect(env)) == ("lsf", JOIN, "h1", 10242, 4, 2, 0)  # T11
    # The body of an LSF batch script (no jsrun) is no job of several.
    assert (
        detect({"LSB_JOBID": "4242", "LSB_DJOB_RANKFILE": str(rank_file)}).start
        == SINGLE
    )


# ---------------------------------------------------------------------------
# Explicit values: arguments and KERAS_DISTRIBUTION_* win, detection fills in
# ---------------------------------------------------------------------------


def test_explicit_values_win_over_every_launcher():
    keras_env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:2345",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    }
    launch = detect(dict(T3, **keras_env))  # T17
    assert (
        launch.environment,
        launch.init_method,
        launch.world,
        launch.rank,
    ) == ("explicit", "tcp://10.0.0.1:1234", 2, 1)
    with pytest.raises(
        ValueError, match=r"^job_addresses lists 2 jobs but num_processes=3"
    ):
        detect(
            dict(T3, **dict(keras_env, KERAS_DISTRIBUTION_NUM_PROCESSES="3"))
        )
    # Arguments win over the variables.
    launch = detect(
        keras_env, job_addresses="h:1", num_processes=4, process_id=3
    )
    assert (launch.init_method, launch.world, launch.rank) == (
        "tcp://h:1",
        4,
        3,
    )


def test_an_explicit_launch_takes_local_rank_or_leaves_it_to_be_counted():
    """M2: no LOCAL_RANK is no local rank 0 (every process of a host would
    take GPU 0): None, counted on the store by rendezvous; a given one is read
    and a bad one refused."""
    given = dict(job_addresses="h:1", num_processes=4, process_id=3)
    assert detect({}, **given).local_rank is None
    assert detect({"LOCAL_RANK": "1"}, **given).local_rank == 1
    with pytest.raises(ValueError, match=r"LOCAL_RANK='x'"):
        detect({"LOCAL_RANK": "x"}, **given)
    assert (
        detect(
            {}, job_addresses="h:1", num_processes=1, process_id=0
        ).local_rank
        == 0
    )


def test_detection_fills_what_is_not_given():
    """T18: the number of processes is given, the rest comes from SLURM."""
    launch = detect(dict(T3, KERAS_DISTRIBUTION_NUM_PROCESSES="4"))
    assert _where(launch) == ("slurm", JOIN, "node001", T3_PORT, 4, 3, 1)
    # An address given replaces the derived one.
    launch = detect(T3, job_addresses="10.1.1.1:555")
    assert (launch.init_method, launch.rank) == ("tcp://10.1.1.1:555", 3)
    with pytest.raises(
        ValueError,
        match=(
            r"^initialize\(num_processes=2\) but slurm started 4 processes "
            r"\(SLURM_JOB_ID=123456, .*\). Pass num_processes=4 or none.$"
        ),
    ):
        detect(T3, num_processes=2)
    with pytest.raises(
        ValueError,
        match=r"^initialize\(process_id=0\) but slurm made this "
        r"process rank 3",
    ):
        detect(T3, process_id=0)
    with pytest.raises(
        ValueError,
        match=r"^initialize\(num_processes=4\) but torchrun started "
        r"WORLD_SIZE=2 processes",
    ):
        detect(T1, num_processes=4)


# ---------------------------------------------------------------------------
# Starting the processes of a node
# ---------------------------------------------------------------------------


def _spawned(launch):
    return (
        launch.environment,
        launch.start,
        launch.nnodes,
        launch.node_rank,
        launch.nproc,
        launch.world,
        launch.address,
        launch.port,
    )


def test_one_srun_task_per_node_starts_one_process_per_device():
    """T6: 2 nodes x 1 task, 4 GPUs each: ranks 4-7 of 8 here."""
    env = dict(
        T3,
        SLURM_NTASKS="2",
        SLURM_PROCID="1",
        SLURM_LOCALID="0",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
    )
    launch = detect(env, local_devices=4)
    assert _spawned(launch) == ("slurm", SPAWN, 2, 1, 4, 8, "node001", T3_PORT)
    # Where processes cannot be started: one per node, as srun started them.
    assert _where(launch.fallback) == (
        "slurm",
        JOIN,
        "node001",
        T3_PORT,
        2,
        1,
        0,
    )
    with pytest.raises(
        ValueError,
        match=r"^initialize\(process_id=1\) but this process "
        r"starts the 4 processes of node 1 for slurm",
    ):
        detect(env, local_devices=4, process_id=1)
    # Without devices (or with one), the task is the process.
    assert detect(env, local_devices=1).start == JOIN
    # KTD_SPAWN=N asks for N processes per node, on CPU too.
    assert _spawned(detect(dict(env, KTD_SPAWN="2"))) == (
        "slurm",
        SPAWN,
        2,
        1,
        2,
        4,
        "node001",
        T3_PORT,
    )


def test_kubeflow_node_launchers_start_their_processes():
    # T13: Kubeflow v1 with nprocPerNode 2: RANK is the pod's (node's) rank.
    v1 = {
        "WORLD_SIZE": "6",
        "RANK": "1",
        "PET_NODE_RANK": "1",
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "2",
        "MASTER_ADDR": "m",
        "MASTER_PORT": "23456",
    }
    assert _spawned(detect(v1, local_devices=2)) == (
        "pet",
        SPAWN,
        3,
        1,
        2,
        6,
        "m",
        23456,
    )
    # On CPU, 1 per node: WORLD_SIZE=6 then disagrees, which is said.
    with pytest.raises(
        IncompleteEnvironmentError,
        match=(
            r"^WORLD_SIZE=6 but PET_NNODES=3 nodes x 1 processes per node make "
            r"3 .*set KTD_SPAWN=N to start N CPU processes per node"
        ),
    ):
        detect(v1)
    # Trainer v2, 8 GPUs, "auto".
    v2 = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "tj-node-0-0.tj",
        "PET_MASTER_PORT": "29500",
    }
    assert _spawned(detect(v2, local_devices=8)) == (
        "pet",
        SPAWN,
        2,
        1,
        8,
        16,
        "tj-node-0-0.tj",
        29500,
    )
    # On a CPU pod Trainer v2 writes the CPU count: still one process per pod.
    assert detect(dict(v2, PET_NPROC_PER_NODE="16")).start == JOIN
    with pytest.raises(
        IncompleteEnvironmentError,
        match=r"PET_NNODES='1:4' asks for an "
        r"elastic number of nodes.*torchrun",
    ):
        detect(dict(v2, PET_NNODES="1:4"))


def test_a_machine_without_launcher():
    # T21: 2 GPUs, no launcher: start one process per GPU (or fall back to one).
    launch = detect({}, local_devices=2)
    assert _spawned(launch) == ("local", SPAWN, 1, 0, 2, 2, None, None)
    assert launch.fallback.start == SINGLE
    # initialize(num_processes=3) asked for them: no fallback (an error where
    # they cannot start), also on CPU.
    launch = detect({}, num_processes=3)
    assert _spawned(launch) == ("explicit", SPAWN, 1, 0, 3, 3, None, None)
    assert launch.fallback is None
    assert detect({"KERAS_DISTRIBUTION_NUM_PROCESSES": "2"}).nproc == 2
    assert detect({}, num_processes=1).start == SINGLE
    with pytest.raises(
        ValueError,
        match=r"^initialize\(num_processes=2, process_id=1\) needs "
        r"job_addresses='host:port' of process 0",
    ):
        detect({}, num_processes=2, process_id=1)
    with pytest.raises(
        ValueError,
        match=r"^initialize\(job_addresses='h:1'\) also needs "
        r"num_processes and process_id",
    ):
        detect({}, job_addresses="h:1")


# ---------------------------------------------------------------------------
# Incomplete or inconsistent variables: an error, never a process alone
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {
                "SLURM_JOB_ID": "1",
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "4",
                "SLURM_STEP_NODELIST": "n1",
            },
            (
                r"^This process looks started by SLURM \(an srun step\) "
                r"\(SLURM_JOB_ID=1, SLURM_STEP_ID=0, SLURM_NTASKS=4, "
                r"SLURM_STEP_NODELIST=n1\), but SLURM_PROCID, SLURM_LOCALID "
                r"are missing, so it cannot join the other processes. Start "
                r"the script with srun inside the allocation, e.g. `srun "
                r"python train.py` \(srun sets all of them\). Or set "
                r"KTD_CLUSTER=none to run one process and ignore these "
                r"variables.$"
            ),
        ),
        (
            {
                "PRTE_LAUNCHED": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            },
            (
                r"^Open MPI started this process as rank 1 of 2 "
                r"\(OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=1, "
                r"OMPI_COMM_WORLD_LOCAL_RANK=1\), but nothing says where "
                r"process 0 is: MASTER_ADDR is missing \(and mpi4py, which "
                r"could ask rank 0, is not installed\). Set MASTER_ADDR "
                r".*`mpirun -x MASTER_ADDR=\$\(hostname\) -x MASTER_PORT=29500 "
                r"...`"
            ),
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "2"},
            r"by Open MPI \(OMPI_COMM_WORLD_SIZE=2\), but "
            r"OMPI_COMM_WORLD_RANK is missing",
        ),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2"},
            r"^MPICH / Intel MPI started this process as rank 0 "
            r"of 2 .*MASTER_ADDR is missing",
        ),
        (
            {"JSM_NAMESPACE_RANK": "1"},
            r"by LSF jsrun \(JSM_NAMESPACE_RANK=1\), but LSB_JOBID, "
            r"LSB_DJOB_RANKFILE, JSM_NAMESPACE_SIZE, "
            r"JSM_NAMESPACE_LOCAL_RANK are missing",
        ),
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "0"},
            r"by a PET_\* node launcher \(Kubeflow\) "
            r"\(PET_NNODES=2, PET_NODE_RANK=0\), but "
            r"MASTER_ADDR, MASTER_PORT are missing",
        ),
        (
            {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"},
            (
                r"by torchrun \(WORLD_SIZE=2, TORCHELASTIC_RUN_ID=x\), but "
                r"RANK, MASTER_ADDR, MASTER_PORT are missing"
            ),
        ),
        (
            {"WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"},
            (
                r"^WORLD_SIZE=2 says this process is one of 2, but the "
                r"environment lacks RANK \(or NODE_RANK, LOCAL_WORLD_SIZE and "
                r"LOCAL_RANK\) to join the others"
            ),
        ),
        (
            dict(T3, SLURM_PROCID="7"),
            r"^slurm made this process rank 7 of 4 processes",
        ),
        (
            dict(T3, KTD_CLUSTER="openmpi"),
            r"by Open MPI \(nothing set\), but OMPI_COMM_WORLD_SIZE, "
            r"OMPI_COMM_WORLD_RANK are missing",
        ),
        (
            dict(T3, SLURM_STEP_NODELIST="node[3-1]"),
            r"^SLURM host list 'node\[3-1\]' is malformed: "
            r"range '3-1' runs backwards",
        ),
    ],
)
def test_incomplete_variables_are_an_error_naming_them(env, message):
    with pytest.raises(
        IncompleteEnvironmentError
        if "malformed" not in message
        else ValueError,
        match=message,
    ):
        detect(env, outside=_WithoutMpi4py())


class _WithoutMpi4py(Outside):
    def mpi_address(self):
        return None


class _FakeComm:
    def __init__(self, rank, told):
        self.rank, self.told, self.sent = rank, told, []

    def Get_rank(self):
        return self.rank

    def bcast(self, value, root):
        self.sent.append((value, root))
        return self.told


def test_mpi_ranks_without_an_address_ask_rank_0_through_mpi4py(monkeypatch):
    """Open MPI 5 / MPICH tell no address: with mpi4py, rank 0 broadcasts
    its host name and a free port (every rank calls it, in initialize())."""
    ompi5 = {
        "PRTE_LAUNCHED": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }
    comm = _FakeComm(1, ("rank0-host", 45678))
    package = types.ModuleType("mpi4py")
    package.MPI = types.SimpleNamespace(COMM_WORLD=comm)
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    assert _where(detect(ompi5)) == (
        "openmpi",
        JOIN,
        "rank0-host",
        45678,
        2,
        1,
        1,
    )
    assert comm.sent == [(None, 0)]  # rank 1 receives
    # Rank 0 sends its own host name and a port it found free.
    comm.rank = 0
    detect(dict(ompi5, OMPI_COMM_WORLD_RANK="0"))
    (host, port), root = comm.sent[1]
    assert (host, root) == (socket.gethostname(), 0) and 0 < port < 2**16
    # MASTER_ADDR / MASTER_PORT win: MPI is not asked.
    launch = detect(dict(ompi5, MASTER_ADDR="m", MASTER_PORT="7"))
    assert (launch.address, launch.port, len(comm.sent)) == ("m", 7, 2)


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"KTD_CLUSTER": "k8s"},
            r"^KTD_CLUSTER='k8s' names no environment: set one of "
            r"torchelastic, generic, openmpi, pmi, mvapich, lsf, slurm, pet, "
            r"or none",
        ),
        (
            {"KTD_SPAWN": "all"},
            r"^KTD_SPAWN='all' is not a number of local processes",
        ),
        (
            dict(T3, SLURM_NTASKS="four"),
            r"^SLURM_NTASKS='four' is not a number of processes",
        ),
        (dict(T3, MASTER_PORT="70000"), r"^MASTER_PORT='70000' is not a port"),
    ],
)
def test_bad_values_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        detect(env)


# ---------------------------------------------------------------------------
# SLURM host lists (T25)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, first",
    [
        # Lightning's table
        ("127.0.0.1", "127.0.0.1"),
        ("alpha,beta,gamma", "alpha"),
        ("alpha beta gamma", "alpha"),
        ("1.2.3.[100-110]", "1.2.3.100"),
        ("1.2.3.[089, 100-110]", "1.2.3.089"),
        ("host[22]", "host22"),
        ("host[1,5-9]", "host1"),
        ("host[5-9,1]", "host5"),
        ("alpha, host[5-9], gamma", "alpha"),
        ("alpha[3,1], beta", "alpha3"),
        # and the design note's
        ("node[001-004,007]", "node001"),
        ("gpu-a100-[09-12]", "gpu-a100-09"),
        ("rack[1-2]-node[01-04]", "rack1-node01"),
        ("n1 n2", "n1"),
    ],
)
def test_first_host_of_a_slurm_host_list(text, first):
    assert hostlist.first_host(text) == first


def test_host_lists_expand_every_group_with_its_padding():
    assert list(hostlist.hosts("rack[1-2]-node[01-02],x[9-10]")) == [
        "rack1-node01",
        "rack1-node02",
        "rack2-node01",
        "rack2-node02",
        "x9",
        "x10",
    ]
    for bad in ("node[1-2", "node]1[", "node[a-b]", ""):
        with pytest.raises(
            ValueError, match=r"SLURM host list .*(malformed|names no host)"
        ):
            hostlist.first_host(bad)


def test_the_slurm_port_differs_between_steps_of_one_job():
    ports = {
        detect(dict(T3, SLURM_STEP_ID=str(step))).port for step in range(20)
    }
    assert len(ports) == 20 and all(61440 <= p < 65536 for p in ports)
