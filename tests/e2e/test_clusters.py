"""`initialize()` where schedulers start processes, on 2 CPU processes.

Each job is started the way its scheduler starts processes, without torchrun:
plain `python tests/scripts/dp_train.py` processes given the variables an
srun step, Open MPI's mpirun or MPICH's mpiexec sets; a script that never
calls initialize() under srun's variables; `KERAS_DISTRIBUTION_NUM_PROCESSES=2
python dp_train.py`, where initialize() starts the 2 processes itself (as
on a machine with 2 GPUs); two Kubeflow-style nodes that each start 2. Each
trains DataParallel and must end with the losses and weights of one process
on the global batch (`reference`, one plain process). Then failures: a
started process that raises ends the command in bounded time, naming it,
and no process is left; SIGKILLing the launcher kills the processes it
started. Which variables mean what is unit-tested in
unit/test_environments.py.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from helpers import ROOT
from helpers import finish_all
from helpers import free_port
from keras_torch_distribution._processes import environments

_SCRIPT = "tests/scripts/dp_train.py"
_NUMBERS = re.compile(
    r"rank=(\d+) world=(\d+) losses=(\[[^\]]*\]) weight_sums=(\[[^\]]*\])"
)
# Variables of launchers that must not leak from the test's own environment.
_LAUNCHER_PREFIXES = (
    "SLURM_",
    "OMPI_",
    "PMI_",
    "MV2_",
    "JSM_",
    "LSB_",
    "PET_",
    "TORCHELASTIC_",
    "KERAS_DISTRIBUTION_",
    "KTD_",
)
_LAUNCHER_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "JOB_COMPLETION_INDEX",
)


@pytest.fixture
def marker():
    """A variable every process of the test inherits, to find them in /proc."""
    return f"ktd-test-{uuid.uuid4()}"


def _env(marker, **extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES
    }
    env.update(
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        KTD_DEVICE="cpu",
        KTD_TIMEOUT_SECONDS="120",
        KTD_TEST_MARKER=marker,
    )
    env.update(extra)
    return env


def _start(args, env):
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _run_all(envs, args=(_SCRIPT,), timeout=300):
    """Start one process per environment (a scheduler's processes), wait for
    all."""
    return finish_all([_start(args, env) for env in envs], timeout)


def _marked_processes(marker):
    """Pids of live processes (zombies aside) whose environment holds
    `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"KTD_TEST_MARKER={marker}".encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found.append(int(name))
    return found


def _processes_left(marker, within=30):
    """The marked processes still alive after waiting up to `within` seconds
    for them to go (a process the kernel kills with its parent, or one its
    launcher stopped, may take a moment to end): [] once all are gone."""
    deadline = time.monotonic() + within
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _marked_processes(marker)


def _numbers(results):
    for result in results:
        assert result.returncode == 0, (
            result.stdout[-2000:],
            result.stderr[-4000:],
        )
    return sorted(_NUMBERS.findall("".join(r.stdout for r in results)))


@pytest.fixture(scope="module")
def reference():
    """(losses, weight sums) of one plain process on the global batch."""
    (result,) = _run_all([_env("reference")])
    ((rank, world, losses, weights),) = _numbers([result])
    assert (rank, world) == ("0", "1"), result.stdout
    return eval(losses), eval(weights)  # printed lists of floats


def _assert_one_process_numbers(results, reference, world=2):
    got = _numbers(results)
    assert [g[:2] for g in got] == [
        (str(r), str(world)) for r in range(world)
    ], got
    for _, _, losses, weights in got:
        np.testing.assert_allclose(
            eval(losses), reference[0], rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            eval(weights), reference[1], rtol=1e-5, atol=1e-5
        )


def _id_with_a_free_port(environment, make_env):
    """An id for make_env(id) whose derived port (as detect() derives it,
    in this process) is free here."""
    for _ in range(50):
        job_id = str(uuid.uuid4().int % 10**6)
        launch = environments.detect(make_env(job_id))
        assert (
            launch.environment == environment and launch.address == "127.0.0.1"
        )
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", launch.port))
            except OSError:
                continue
        return job_id
    raise AssertionError("no free derived port in 50 tries")


def _slurm_step(job_id, rank):
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [[_SCRIPT], [_SCRIPT, "--without-initialize"]],
    ids=["initialize", "never-calls-initialize"],
)
def test_srun_step(reference, marker, script):
    """`srun -n 2 python train.py`: address from the step's node list, port
    from the job and step ids, ranks from SLURM_PROCID; a script that never
    calls initialize() joins on its first list_devices()."""
    job = _id_with_a_free_port("slurm", lambda job_id: _slurm_step(job_id, 0))
    results = _run_all(
        [_env(marker, **_slurm_step(job, rank)) for rank in (0, 1)], script
    )
    _assert_one_process_numbers(results, reference)


@pytest.mark.slow
def test_open_mpi(reference, marker):
    """`mpirun -np 2 python train.py` (Open MPI 4): address and port from
    the launcher's URI, as JAX reads them; no MASTER_ADDR given."""

    def ompi(job_id, rank=0):
        return {
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_MCA_orte_hnp_uri": f"{int(job_id) * 4096}.0;tcp://127.0.0.1:34911",
        }

    job = _id_with_a_free_port("openmpi", ompi)
    results = _run_all([_env(marker, **ompi(job, rank)) for rank in (0, 1)])
    _assert_one_process_numbers(results, reference)


@pytest.mark.slow
def test_mpich_pmi(reference, marker):
    """`mpiexec -n 2 python train.py` (MPICH / Intel MPI's Hydra), with
    MASTER_ADDR and MASTER_PORT exported to every process."""
    port = str(free_port())
    envs = [
        _env(
            marker,
            PMI_RANK=str(rank),
            PMI_SIZE="2",
            MPI_LOCALRANKID=str(rank),
            MPI_LOCALNRANKS="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for rank in (0, 1)
    ]
    _assert_one_process_numbers(_run_all(envs), reference)


@pytest.mark.slow
def test_num_processes_starts_the_local_processes(reference, marker):
    """`KERAS_DISTRIBUTION_NUM_PROCESSES=2 python train.py`: initialize()
    starts 2 processes running the script (as one per GPU on a machine with
    2 GPUs) and exits 0 with them; the launcher itself prints nothing."""
    (result,) = _run_all([_env(marker, KERAS_DISTRIBUTION_NUM_PROCESSES="2")])
    _assert_one_process_numbers([result], reference)
    assert _processes_left(marker) == []


@pytest.mark.slow
def test_kubeflow_nodes_each_start_their_processes(reference, marker):
    """Two pods of a Kubeflow TrainJob (PET_* only), each starting 2
    processes (KTD_SPAWN=2 on CPU): ranks node_rank * 2 + local index of a
    world of 4, joined at node 0's rendezvous."""
    port = str(free_port())
    envs = [
        _env(
            marker,
            PET_NNODES="2",
            PET_NODE_RANK=str(node),
            PET_NPROC_PER_NODE="auto",
            PET_MASTER_ADDR="127.0.0.1",
            PET_MASTER_PORT=port,
            KTD_SPAWN="2",
        )
        for node in (0, 1)
    ]
    _assert_one_process_numbers(_run_all(envs, timeout=400), reference, world=4)


@pytest.mark.slow
def test_a_started_process_that_raises_ends_the_command(marker):
    """Process 1 raises after its first epoch: the agent stops process 0,
    and the command exits non-zero in bounded time, its last line naming
    process 1 and its exception; no process is left."""
    # A hang would last the process group's timeout (600 s here): the
    # command must end within 400 s.
    (result,) = _run_all(
        [
            _env(
                marker,
                KERAS_DISTRIBUTION_NUM_PROCESSES="2",
                KTD_TIMEOUT_SECONDS="600",
            )
        ],
        ("tests/scripts/rank_fails.py", "raise"),
        timeout=400,
    )
    assert result.returncode != 0, result.stdout[-3000:]
    assert "finished training" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "keras.distribution.initialize(): rank 1 (local rank 1) failed first, "
        "exit code 1: RuntimeError: deliberate failure on rank 1 after epoch 1."
    ), result.stderr[-4000:]
    # The error once: rank 1's traceback, a line for rank 0, the summary.
    assert result.stderr.count("Traceback (most recent call last)") == 1, (
        result.stderr[-4000:]
    )
    assert "rank 1: Traceback (most recent call last)" in result.stderr
    assert _processes_left(marker) == []


@pytest.mark.slow
def test_started_processes_die_with_a_killed_launcher(marker):
    """SIGKILL to the process that started them (no handler can run): the
    kernel kills the started processes too (PR_SET_PDEATHSIG)."""
    launcher = _start(
        ["tests/scripts/wait_after_initialize.py"],
        _env(marker, KERAS_DISTRIBUTION_NUM_PROCESSES="2"),
    )
    try:
        ready = []
        deadline = time.monotonic() + 240
        while len(ready) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if not line:
                break
            ready += re.findall(r"ready rank=(\d) pid=(\d+)", line)
        assert sorted(r[0] for r in ready) == ["0", "1"], (
            launcher.stderr.read()[-3000:]
        )
        assert sorted(_marked_processes(marker)) == sorted(
            [launcher.pid] + [int(pid) for _, pid in ready]
        )
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        assert _processes_left(marker) == []
    finally:
        for pid in _marked_processes(marker):
            os.kill(pid, signal.SIGKILL)  # started by this test
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()
