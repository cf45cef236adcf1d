"""When `initialize()` starts this node's processes, and what it does where
it must not (T21, T22, T24, T26 of design/clusters.md): torch's process
group and the elastic agent are replaced, nothing starts. The launches
themselves are in e2e/test_clusters.py.
"""

import logging
import os
import sys
import threading
import types
from unittest import mock

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import pytest  # noqa: E402

from helpers import LAUNCHER_VARIABLES  # noqa: E402
from keras_torch_distribution._processes import environments  # noqa: E402
from keras_torch_distribution._processes import join  # noqa: E402
from keras_torch_distribution._processes import rendezvous  # noqa: E402
from keras_torch_distribution._processes import runtime  # noqa: E402
from keras_torch_distribution._processes import spawn  # noqa: E402


class _Started(Exception):
    """Raised by the replaced start_processes / init_process_group."""


@pytest.fixture
def machine(monkeypatch):
    """A machine with 2 local GPUs and no launcher, where starting
    processes or a process group records the call and raises _Started."""
    for key in (
        LAUNCHER_VARIABLES
        + environments.KERAS_VARIABLES
        + (
            "TORCHELASTIC_RUN_ID",
            spawn.LAUNCHED_VARIABLE,
            environments.SPAWN_VARIABLE,
            environments.CLUSTER_VARIABLE,
        )
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime, "local_device_count", lambda: 2)
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "3"])
    calls = mock.Mock()
    calls.start_processes.side_effect = _Started
    calls.init_process_group.side_effect = _Started
    monkeypatch.setattr(spawn, "start_processes", calls.start_processes)
    monkeypatch.setattr(
        rendezvous, "_init_process_group", calls.init_process_group
    )
    return calls


def test_a_script_on_a_machine_with_2_gpus_starts_2_processes(machine):
    """T21: initialize() hands the elastic agent one process per GPU."""
    with pytest.raises(_Started):
        keras.distribution.initialize()
    ((launch, timeout), _) = machine.start_processes.call_args
    assert (launch.environment, launch.nproc, launch.nnodes, launch.world) == (
        "local",
        2,
        1,
        2,
    )
    assert timeout == runtime.timeout_seconds()
    machine.init_process_group.assert_not_called()


@pytest.mark.parametrize(
    "where, reason",
    [
        (
            {"argv": ["-c"]},
            (
                "Python runs a program given by -c or on stdin, which cannot "
                "be run again"
            ),
        ),
        (
            {"argv": [""]},
            (
                "Python runs a program given by -c or on stdin, which cannot "
                "be run again"
            ),
        ),
        ({"ps1": ">>> "}, "the Python session is interactive"),
        ({"module": "ipykernel"}, "it runs in a Jupyter kernel"),
        ({"env": {"KTD_SPAWN": "0"}}, "KTD_SPAWN=0 is set"),
        (
            {"env": {"KTD_LAUNCHED": "1"}},
            "this process was itself started by a launcher",
        ),
    ],
)
def test_no_processes_start_where_the_script_cannot_run_again(
    machine, monkeypatch, caplog, where, reason
):
    """T22, T24: one process on one GPU, with one warning naming `ktd run`."""
    if "argv" in where:
        monkeypatch.setattr(sys, "argv", where["argv"])
    if "ps1" in where:
        monkeypatch.setattr(sys, "ps1", where["ps1"], raising=False)
    if "module" in where:
        monkeypatch.setitem(
            sys.modules, where["module"], types.ModuleType(where["module"])
        )
    for key, value in where.get("env", {}).items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="keras_torch_distribution"):
        with pytest.raises(_Started):
            keras.distribution.initialize()
    machine.start_processes.assert_not_called()
    assert machine.init_process_group.call_args.kwargs["world_size"] == 1
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    ]
    assert warnings == [
        (
            "2 processes could run on this node (local: one per device), but "
            f"{reason}: this process runs alone, on one device. Start the "
            "script with `ktd run -n 2 script.py` (or torchrun "
            "--nproc-per-node 2) to use every device."
        )
    ]


def test_first_use_never_starts_processes(machine, caplog):
    """A mesh built before initialize() (the script is already running):
    one process, with the warning; asked-for processes are an error."""
    with caplog.at_level(logging.WARNING, logger="keras_torch_distribution"):
        with pytest.raises(_Started):
            join.ensure_initialized("a DeviceMesh")
    machine.start_processes.assert_not_called()
    (warning,) = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    ]
    assert (
        "but a DeviceMesh started the process group on first use, with the "
        "script already running: this process runs alone"
    ) in warning
    assert warning.endswith(
        ", or call keras.distribution.initialize() at its top to use "
        "every device."
    )
    os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"] = "2"
    try:
        with pytest.raises(
            ValueError,
            match=(
                r"^initialize\(num_processes=2\) would start 2 local "
                r"processes, but list_devices\(\) started the process group on "
                r"first use"
            ),
        ):
            join.ensure_initialized("list_devices()")
    finally:
        del os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"]


def test_one_task_per_node_without_spawning_joins_one_process_per_node(
    machine, monkeypatch, caplog
):
    """An srun step of 1 task per node on 2-GPU nodes, started by `python -c`:
    each task joins as one process per node (never alone), with the warning."""
    for key, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "MASTER_PORT": "1234",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["-c"])
    with caplog.at_level(logging.WARNING, logger="keras_torch_distribution"):
        with pytest.raises(_Started):
            keras.distribution.initialize()
    assert machine.init_process_group.call_args.kwargs == {
        "init_method": "tcp://n1:1234",
        "world_size": 2,
        "rank": 1,
        "timeout": mock.ANY,
        "local_rank": 0,
    }
    assert (
        "this process runs as rank 1 of 2, one process per node, on one device"
        in caplog.text
    )


def test_an_existing_process_group_is_adopted(monkeypatch):
    """T26: initialize() with torch.distributed running reads nothing else."""
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 2)
    monkeypatch.setattr(
        environments, "detect", mock.Mock(side_effect=AssertionError)
    )
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # would be an incomplete srun step
    keras.distribution.initialize()
    keras.distribution.initialize(num_processes=4, process_id=2)
    with pytest.raises(
        ValueError,
        match=r"initialize\(num_processes=2\) but torch.distributed "
        r"already runs 4 processes",
    ):
        keras.distribution.initialize(num_processes=2)


def test_why_not_outside_the_main_thread(monkeypatch):
    monkeypatch.delenv(spawn.LAUNCHED_VARIABLE, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    found = []
    thread = threading.Thread(
        target=lambda: found.append(spawn.why_not(environ={}))
    )
    thread.start()
    thread.join()
    assert found == ["initialize() was called outside the main thread"]
    assert spawn.why_not(environ={}) is None


def test_the_started_processes_run_the_script_again():
    runner = ["-m", "keras_torch_distribution.launch"]
    script = types.SimpleNamespace(__spec__=None, __file__="/x/train.py")
    command = spawn.child_command(["train.py", "--lr", "1"], script)
    assert command[0] == "-u" and command[-5:] == [
        *runner,
        os.path.join(os.getcwd(), "train.py"),
        "--lr",
        "1",
    ]
    # `python -m pkg.train` and `python -m pkg` run as modules again.
    for name, module in (("pkg.train", "pkg.train"), ("pkg.__main__", "pkg")):
        main = types.SimpleNamespace(__spec__=types.SimpleNamespace(name=name))
        assert spawn.child_command(["/x/pkg/train.py", "a"], main)[-5:] == [
            *runner,
            "-m",
            module,
            "a",
        ]


def test_ktd_env_shows_what_initialize_would_do(machine, monkeypatch, capsys):
    from keras_torch_distribution import cli

    step = {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "n[7-8]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
    }
    for key, value in step.items():
        monkeypatch.setenv(key, value)
    port = environments.detect(step).port
    assert cli.print_launch() == 0
    shown = [
        line.split(None, 1) for line in capsys.readouterr().out.splitlines()[2:]
    ]
    assert shown[:8] == [
        ["environment", "slurm"],
        ["start", "join"],
        ["world", "4"],
        ["rank", "3"],
        ["local_rank", "1"],
        ["address", "n7"],
        ["port", str(port)],
        ["init_method", f"tcp://n7:{port}"],
    ]
    machine.start_processes.assert_not_called()
    machine.init_process_group.assert_not_called()
    monkeypatch.delenv("SLURM_PROCID")
    assert cli.print_launch() == 1
    assert (
        "  error: This process looks started by SLURM (an srun step)"
        in capsys.readouterr().out
    )
