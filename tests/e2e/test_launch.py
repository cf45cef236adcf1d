"""`ktd run` starts scripts on local processes: the README's demo, the
examples, an unchanged Keras script, a script that never calls
initialize(), 2 simulated nodes, and failing ranks; bad arguments and
settings are refused before any rank starts.

Every launch runs in its own session with a timeout; on timeout that
session (the launcher and the ranks it started) is killed.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_torch_distribution import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu", **extra)
    env.pop("KERAS_BACKEND", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _start(args, env):
    """`ktd ARGS` in a new session (so that it and its ranks can be killed)."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_torch_distribution", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )


def _finish(process, timeout):
    """CompletedProcess of a started launch; kills its session on timeout."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session this test started
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"ktd did not finish within {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _ktd_run(*args, n=2, timeout=240, **env):
    return _finish(_start(["run", "-n", str(n), *args], _env(**env)), timeout)


@pytest.mark.slow
def test_demo_trains_with_both_distributions_and_shows_shards():
    result = _ktd_run("examples/demo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "devices: ['cpu:0', 'cpu:1']" in out
    dp = [line for line in out.splitlines() if line.startswith("DataParallel loss")]
    mp = [line for line in out.splitlines() if line.startswith("ModelParallel loss")]
    assert len(dp) == len(mp) == 1  # printed by rank 0 only
    losses = eval(dp[0].split(":", 1)[1])  # a printed list of floats
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]
    assert eval(mp[0].split(":", 1)[1]) == losses  # same numbers, other layout
    assert "(32, 128)        (32, 128)" in out  # "up" kernel, column-sharded
    assert "param bytes per rank" in out


@pytest.mark.slow
def test_unchanged_keras_script_runs_on_torch():
    result = _ktd_run("tests/scripts/unchanged_keras_script.py")
    assert result.returncode == 0, result.stderr[-3000:]
    # Both ranks print one report each (their writes may interleave).
    reports = re.findall(r"processes=(\d+) backend=(\w+) loss=(\d+\.\d{6})", result.stdout)
    assert len(reports) == 2, result.stdout
    assert all(r[:2] == ("2", "torch") for r in reports)
    assert reports[0][2] == reports[1][2]


# --------------------------------------------------------------------------
# Arguments handed to torchrun
# --------------------------------------------------------------------------

_LAUNCH = ["-m", "keras_torch_distribution.launch"]


def test_torchrun_arguments_one_node_is_standalone():
    assert launch.torchrun_arguments(["-n", "2", "train.py", "--lr", "0.1"]) == [
        "--nproc-per-node", "2", "--standalone", *_LAUNCH, "train.py", "--lr", "0.1"
    ]
    assert launch.torchrun_arguments(["-n=2", "--nnodes=1", "--max-restarts", "1",
                                      "train.py"]) == [
        "--nproc-per-node=2", "--nnodes=1", "--max-restarts", "1", "--standalone",
        *_LAUNCH, "train.py",
    ]
    # A flag (no value) before the script is not mistaken for taking it.
    assert launch.torchrun_arguments(["--virtual-local-rank", "-n", "2", "t.py"]) == [
        "--virtual-local-rank", "--nproc-per-node", "2", "--standalone", *_LAUNCH, "t.py"
    ]


def test_torchrun_arguments_several_nodes_use_the_given_rendezvous():
    argv = ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:29400", "-n", "1", "train.py", "-x"]
    assert launch.torchrun_arguments(argv) == [
        "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:29400", "--nproc-per-node", "1",
        *_LAUNCH, "train.py", "-x",
    ]
    # One node at a given address (static rendezvous): no --standalone either.
    assert "--standalone" not in launch.torchrun_arguments(
        ["--master-addr", "10.0.0.1", "--master_port=29500", "-n", "2", "t.py"]
    )


@pytest.mark.parametrize("argv, message", [
    (["-n", "2"], r"give a script to run, e.g. `ktd run -n 2 train.py`"),
    (["-n"], r"option --nproc-per-node needs a value"),
    (["-m", "pkg.train"], r"torchrun's -m is not supported: `ktd run` runs a Python script"),
    (["--no-python", "echo"], r"torchrun's --no-python is not supported"),
    (["-n", "0", "t.py"], r"^ktd run: -n 0 is not a number of processes per node: give a "
                          r"whole number of at least 1, e.g. `ktd run -n 2 train.py` \(or "
                          r"one of torchrun's auto, cpu, gpu, xpu\).$"),
    (["-n", "-1", "t.py"], r"^ktd run: -n -1 is not a number of processes per node"),
    (["--nproc-per-node=two", "t.py"], r"^ktd run: --nproc-per-node two is not a number"),
])
def test_torchrun_arguments_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        launch.torchrun_arguments(argv)


@pytest.fixture
def no_launch(monkeypatch):
    """`launch.run` must refuse before torchrun starts anything."""
    from torch.distributed import run as torch_run

    def must_not_start(arguments):
        raise AssertionError(f"torchrun was started with {arguments}")

    monkeypatch.setattr(torch_run, "main", must_not_start)
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # run() sets it when unset
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.mark.parametrize("value", ["nan", "inf", "1e30", "abc", "-5"])
def test_bad_timeout_setting_is_refused_before_ranks_start(no_launch, monkeypatch, value):
    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", value)
    with pytest.raises(SystemExit, match=(
        rf"^ktd run: KTD_TIMEOUT_SECONDS='{value}' is not a positive number of seconds "
        r"up to 604800 \(one week\).*Set it to a number in \(0, 604800\]")):
        launch.run(["-n", "2", "train.py"])


class _HeldPort:
    """A port another program holds: a listening socket on 127.0.0.1."""

    def __enter__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(1)
        return self.socket.getsockname()[1]

    def __exit__(self, *exc_info):
        self.socket.close()


def _port_in_use_message(port):
    return (
        rf"^ktd run: --master-port {port} is in use on this machine \(.+\), and "
        r"this node \(node rank 0\) must host the rendezvous there. Give a free port "
        r"with --master-port \(the same on every node\), stop the program that holds "
        rf"it \(`ss -ltnp 'sport = :{port}'` names it\), or, on one machine, leave "
        r"out --master-addr and --master-port: `ktd run` then picks a free port.$"
    )


def test_a_held_master_port_is_refused_before_ranks_start(no_launch):
    with _HeldPort() as port:
        for argv in (["--master-port", str(port), "-n", "2", "t.py"],
                     ["--master-addr=127.0.0.1", f"--master_port={port}", "-n", "2", "t.py"]):
            with pytest.raises(SystemExit, match=_port_in_use_message(port)):
                launch.run(argv)


def test_a_master_port_taken_after_the_check_is_named_too(monkeypatch):
    """The port is free when checked but taken before torchrun binds it."""
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torch_run

    port = _free_port()

    def taken(arguments):
        raise DistNetworkError(
            "The server socket has failed to listen on any local network address. "
            f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: "
            "address already in use"
        )

    monkeypatch.setattr(torch_run, "main", taken)
    with pytest.raises(SystemExit, match=_port_in_use_message(port)):
        launch.run(["--master-port", str(port), "-n", "2", "t.py"])
    # Other nodes host nothing: their torchrun runs unchecked.
    seen = []
    monkeypatch.setattr(torch_run, "main", seen.append)
    with _HeldPort() as held:
        launch.run(["--master-port", str(held), "--nnodes", "2", "--node-rank", "1",
                    "-n", "1", "t.py"])
    assert len(seen) == 1


# --------------------------------------------------------------------------
# The one-line failure summary
# --------------------------------------------------------------------------

_LOST_PEER = (
    "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:16296: Connection reset by peer. This is typically caused by a "
    "remote worker hanging or bugs in the application."
)
_KERAS_LAYER_ERROR = (
    "ValueError: Exception encountered when calling Dense.call().\n\n"
    "\x1b[1mInvalid dtype: foo\nmore detail\x1b[0m\n\n"
    "Arguments received by Dense.call():\n  \u2022 inputs=tensor\n  \u2022 training=False"
)


def _failure(tmp_path, local_rank, exitcode, timestamp, message=None):
    """torchrun's record of a failed rank; `message`: the exception the rank
    recorded in its error file (None: it recorded none, e.g. killed)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = str(tmp_path / f"error_{local_rank}.json")
    if message is not None:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": "Traceback ...", "timestamp": str(timestamp)}}}, f)
    failure = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank,
                             exitcode=exitcode, error_file=error_file)
    failure.timestamp = timestamp  # a rank without a file: when torchrun saw it
    return failure


def test_failure_summary_prefers_a_killed_rank_to_one_that_lost_it(tmp_path):
    """Rank 1 was SIGKILLed; rank 0 then failed on the broken connection and
    was stopped by torchrun. torchrun's own order (whole seconds, rank 0's
    record earlier) blames rank 0."""
    failures = {
        0: _failure(tmp_path, 0, -signal.SIGTERM, 100, _LOST_PEER),
        1: _failure(tmp_path, 1, -signal.SIGKILL, 101),
    }
    summary = launch.failure_summary(failures)
    assert summary == (
        "ktd run: rank 1 (local rank 1) died first, by signal SIGKILL (exit code -9). "
        "It was killed from outside Python (the kernel's out-of-memory killer: see "
        "`dmesg`; a scheduler's time or memory limit; or `kill`), so it left no "
        "traceback. torchrun stopped the other processes."
    )
    # Alone, the rank that lost its peer is named, with what that means.
    summary = launch.failure_summary({0: failures[0]})
    assert summary.startswith(
        "ktd run: rank 0 (local rank 0) failed first, exit code -15 (SIGTERM): "
        "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:16296: Connection reset by peer. This is typically caused by a "
        "remote worker hanging or bugs in the application. It lost its connection to "
        "another rank"
    ), summary


def test_failure_summary_orders_and_words_each_kind_of_failure(tmp_path):
    raised = _failure(tmp_path, 1, 1, 100, _KERAS_LAYER_ERROR)
    # A rank torchrun stopped (SIGTERM, nothing recorded) in the same second
    # as the one that raised is not blamed.
    stopped = _failure(tmp_path, 0, -signal.SIGTERM, 100)
    summary = launch.failure_summary({0: stopped, 1: raised})
    # The exception's type and first line, and for a Keras layer error the
    # error itself, not the last line (an argument of the call).
    assert summary.startswith(
        "ktd run: rank 1 (local rank 1) failed first, exit code 1: ValueError: "
        "Exception encountered when calling Dense.call(). Invalid dtype: foo. torchrun "
        "stopped the other processes; that rank's traceback is above."
    ), summary
    assert "training=False" not in summary
    crashed = _failure(tmp_path, 2, -signal.SIGSEGV, 100)
    assert launch.failure_summary({2: crashed}) == (
        "ktd run: rank 2 (local rank 2) died first, by signal SIGSEGV (exit code -11). "
        "That is a crash in native code, not a Python exception, so it left no Python "
        "traceback; its last output above may say why. torchrun stopped the other "
        "processes."
    )
    exited = _failure(tmp_path, 3, 3, 100)
    assert launch.failure_summary({3: exited}).startswith(
        "ktd run: rank 3 (local rank 3) failed first, exit code 3, without a Python "
        "exception on record"
    )
    # Two ranks that both lost a peer: the earlier one.
    late = _failure(tmp_path, 4, 1, 105, _LOST_PEER)
    early = _failure(tmp_path, 5, 1, 104, _LOST_PEER)
    assert launch.failure_summary({4: late, 5: early}).startswith("ktd run: rank 5 ")


# --------------------------------------------------------------------------
# Two nodes x 1 process on this machine (c10d rendezvous)
# --------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_NUMBERS = re.compile(r"rank=(\d) world=(\d) losses=(\[[^\]]*\]) weight_sums=(\[[^\]]*\])")


def _numbers(output):
    return sorted(_NUMBERS.findall(output))


@pytest.mark.slow
def test_two_nodes_give_the_numbers_of_one_node():
    script = "tests/scripts/dp_train.py"
    one_node = _ktd_run(script)
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    expected = _numbers(one_node.stdout)
    assert [r[:2] for r in expected] == [("0", "2"), ("1", "2")], one_node.stdout

    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        _start(["run", "--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "ktd-test", "-n", "1", script],
               _env())
        for node in (0, 1)
    ]
    try:
        results = [_finish(node, 180) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    got = _numbers("".join(r.stdout for r in results))
    assert [r[:2] for r in got] == [("0", "2"), ("1", "2")], [r.stdout for r in results]
    # Same losses and weights, printed to 6 decimals.
    assert [r[2:] for r in got] == [r[2:] for r in expected]


# --------------------------------------------------------------------------
# A failing rank never leaves the others waiting
# --------------------------------------------------------------------------


def _failed_launch(*args, timeout, **env):
    """(last line of stderr, seconds taken, stderr) of a launch that must
    fail before any rank finishes its script."""
    start = time.monotonic()
    result = _ktd_run(*args, timeout=timeout, **env)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stdout[-3000:]
    assert "finished" not in result.stdout, result.stdout[-3000:]
    return result.stderr.strip().splitlines()[-1], elapsed, result.stderr


@pytest.mark.slow
def test_a_rank_that_raises_mid_fit_ends_the_job():
    summary, elapsed, stderr = _failed_launch("tests/scripts/rank_fails.py", "raise",
                                              timeout=90)
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert summary.startswith(
        "ktd run: rank 1 (local rank 1) failed first, exit code 1: RuntimeError: "
        "deliberate failure on rank 1 after epoch 1."
    ), stderr[-3000:]
    assert "torchrun stopped the other processes" in summary


@pytest.mark.slow
def test_a_rank_that_stops_answering_times_out():
    """Rank 1 sleeps instead of training: rank 0's gradient all-reduce gives
    up after KTD_TIMEOUT_SECONDS (the process group's timeout), and torchrun
    then stops rank 1."""
    summary, elapsed, _ = _failed_launch("tests/scripts/rank_fails.py", "stall",
                                         timeout=120, KTD_TIMEOUT_SECONDS="5")
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert summary.startswith("ktd run: rank 0 (local rank 0) failed first"), summary
    assert "Timed out waiting 5000ms" in summary, summary


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_it():
    """Rank 1 SIGKILLs itself; rank 0 then fails on the broken connection.
    A monitor interval of 3 s lets torchrun see both failures, rank 0's
    recorded first (in whole seconds), as happens by chance with the
    default 0.1 s."""
    summary, _, stderr = _failed_launch(
        "--monitor-interval", "3", "tests/scripts/rank_killed.py", timeout=180)
    assert summary.startswith(
        "ktd run: rank 1 (local rank 1) died first, by signal SIGKILL (exit code -9). "
        "It was killed from outside Python"
    ), stderr[-3000:]
    assert "traceback is above" not in summary


# --------------------------------------------------------------------------
# A script that never calls keras.distribution.initialize()
# --------------------------------------------------------------------------

_RESULT = re.compile(r"world=(\d) losses=(\[[^\]]*\]) weight_sums=(\[[^\]]*\])")


@pytest.mark.slow
def test_a_script_that_never_calls_initialize_starts_the_group_on_first_use():
    """Single-host JAX scripts never call initialize(): under `ktd run` the
    first list_devices() starts the process group (once, logged at INFO by
    rank 0), and DataParallel training gives one-process numbers."""
    script = ["tests/scripts/dp_train.py", "--without-initialize"]
    launched = _start(["run", "-n", "2", *script], _env(KTD_LOG_LEVEL="INFO"))
    # The same script in one plain process (no launcher environment).
    alone = subprocess.Popen(
        [sys.executable, "-m", "keras_torch_distribution.launch", *script],
        cwd=ROOT, env=_env(KERAS_BACKEND="torch"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    launched, alone = _finish(launched, 240), _finish(alone, 240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "devices=['cpu:0']" in alone.stdout
    assert launched.stdout.count("devices=['cpu:0', 'cpu:1']") == 2, launched.stdout
    started = [line for line in launched.stderr.splitlines()
               if "keras.distribution.initialize() was not called" in line]
    assert len(started) == 1, launched.stderr[-3000:]
    assert started[0].startswith(
        "[ktd rank 0] INFO: keras.distribution.initialize() was not called: "
        "list_devices() starts the process group now from the launcher's "
        "environment (RANK=0, WORLD_SIZE=2, MASTER_ADDR="
    ), started
    (reference,) = _RESULT.findall(alone.stdout)
    got = _RESULT.findall(launched.stdout)
    assert reference[0] == "1" and [r[0] for r in got] == ["2", "2"], launched.stdout
    for world, losses, weight_sums in got:
        np.testing.assert_allclose(eval(losses), eval(reference[1]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(eval(weight_sums), eval(reference[2]),
                                   rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------


def _losses(output, label="loss per epoch:"):
    lines = [line for line in output.splitlines() if line.startswith(label)]
    assert len(lines) == 1, output  # printed by rank 0 only
    return eval(lines[0][len(label):])  # a printed list of floats


@pytest.mark.slow
def test_example_data_parallel_classifier():
    result = _ktd_run("examples/data_parallel_classifier.py", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(result.stdout)
    assert losses[-1] < losses[0] / 2
    accuracy = float(re.search(r"test loss \S+ accuracy (\S+)", result.stdout).group(1))
    assert accuracy > 0.9
    assert "predictions (512, 4)" in result.stdout


@pytest.mark.slow
def test_example_transformer_language_model():
    result = _ktd_run("examples/transformer_lm.py", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(result.stdout)
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 2
    out = result.stdout
    # vocabulary-, head- and column/row-sharded, each rank holding half
    assert re.search(r"token_embedding/embeddings +\(64, 32\) +\('model', None\) "
                     r"+\(32, 32\) +\(32, 32\)", out), out
    assert re.search(r"block0_attention/query/kernel +\(32, 4, 8\) .* +\(32, 2, 8\) "
                     r"+\(32, 2, 8\)", out), out
    assert re.search(r"block1_mlp_down/kernel +\(64, 32\) +\('model', None\) "
                     r"+\(32, 32\) +\(32, 32\)", out), out


@pytest.mark.slow
def test_example_hybrid_2d_mesh_on_4_processes():
    result = _ktd_run("examples/hybrid_2d_mesh.py", n=4, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh {'batch': 2, 'model': 2} over 4 processes" in result.stdout
    losses = _losses(result.stdout)
    assert losses == sorted(losses, reverse=True)
    assert re.search(r"up/kernel +\(32, 128\) +\(None, 'model'\)( +\(32, 64\)){4}",
                     result.stdout), result.stdout
