"""The launcher without launching: the torchrun arguments `ktd run` builds,
bad arguments and settings refused before any rank starts (torchrun's main
is replaced), and the one-line summary of a failed job. Launches are in
e2e/test_launch.py.
"""

import json
import os
import re
import signal
import socket
import tempfile
import time

import pytest
import torch

from helpers import free_port
from keras_torch_distribution._processes.failures import failure_summary
from keras_torch_distribution.launch import _torchrun

# --------------------------------------------------------------------------
# Arguments handed to torchrun
# --------------------------------------------------------------------------

_LAUNCH = ["-m", "keras_torch_distribution_cli._rank"]
# torchrun's default signals and SIGUSR1, which `ktd run` adds
# (unit/test_launch_restarts.py).
_SIGNALS = ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


def test_torchrun_arguments_one_node_is_standalone():
    assert _torchrun.torchrun_arguments(
        ["-n", "2", "train.py", "--lr", "0.1"]
    ) == [
        "--nproc-per-node",
        "2",
        "--standalone",
        *_SIGNALS,
        *_LAUNCH,
        "train.py",
        "--lr",
        "0.1",
    ]
    assert _torchrun.torchrun_arguments(
        ["-n=2", "--nnodes=1", "--max-restarts", "1", "train.py"]
    ) == [
        "--nproc-per-node=2",
        "--nnodes=1",
        "--max-restarts",
        "1",
        "--standalone",
        *_SIGNALS,
        *_LAUNCH,
        "train.py",
    ]
    # A flag (no value) before the script is not mistaken for taking it.
    assert _torchrun.torchrun_arguments(
        ["--virtual-local-rank", "-n", "2", "t.py"]
    ) == [
        "--virtual-local-rank",
        "--nproc-per-node",
        "2",
        "--standalone",
        *_SIGNALS,
        *_LAUNCH,
        "t.py",
    ]


def test_torchrun_arguments_several_nodes_use_the_given_rendezvous():
    argv = [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "-n",
        "1",
        "train.py",
        "-x",
    ]
    assert _torchrun.torchrun_arguments(argv) == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--nproc-per-node",
        "1",
        *_SIGNALS,
        *_LAUNCH,
        "train.py",
        "-x",
    ]
    # One node at a given address (static rendezvous): no --standalone either.
    assert "--standalone" not in _torchrun.torchrun_arguments(
        ["--master-addr", "10.0.0.1", "--master_port=29500", "-n", "2", "t.py"]
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "2"], r"give a script to run, e.g. `ktd run -n 2 train.py`"),
        (["-n"], r"option --nproc-per-node needs a value"),
        (
            ["-m", "pkg.train"],
            r"torchrun's -m is not supported: `ktd run` runs a Python script",
        ),
        (["--no-python", "echo"], r"torchrun's --no-python is not supported"),
        (
            ["-n", "0", "t.py"],
            r"^ktd run: -n 0 is not a number of processes per node: give a "
            r"whole number of at least 1, e.g. `ktd run -n 2 train.py` \(or "
            r"one of torchrun's auto, cpu, gpu, xpu\).$",
        ),
        (
            ["-n", "-1", "t.py"],
            r"^ktd run: -n -1 is not a number of processes per node",
        ),
        (
            ["--nproc-per-node=two", "t.py"],
            r"^ktd run: --nproc-per-node two is not a number",
        ),
    ],
)
def test_torchrun_arguments_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        _torchrun.torchrun_arguments(argv)


_SCRIPT = __file__  # a script that exists (`run` refuses a missing one)


@pytest.fixture
def no_launch(monkeypatch):
    """`_torchrun.run` must refuse before torchrun starts anything."""
    from torch.distributed import run as torch_run

    def must_not_start(arguments):
        raise AssertionError(f"torchrun was started with {arguments}")

    monkeypatch.setattr(torch_run, "main", must_not_start)
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # run() sets it when unset
    monkeypatch.setenv(
        "OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1")
    )


@pytest.mark.parametrize("value", ["nan", "inf", "1e30", "abc", "-5"])
def test_bad_timeout_setting_is_refused_before_ranks_start(
    no_launch, monkeypatch, value
):
    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", value)
    with pytest.raises(
        SystemExit,
        match=(
            rf"^ktd run: KTD_TIMEOUT_SECONDS='{value}' is not a positive "
            r"number of seconds up to 604800 \(one week\).*Set it to a number "
            r"in \(0, 604800\]"
        ),
    ):
        _torchrun.run(["-n", "2", _SCRIPT])


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
        rf"^ktd run: --master-port {port} is in use on this machine \(.+\), "
        r"and this node \(node rank 0\) must host the rendezvous there. Give a "
        r"free port with --master-port \(the same on every node\), stop the "
        rf"program that holds it \(`ss -ltnp 'sport = :{port}'` names it\), "
        r"or, on one machine, leave out --master-addr and --master-port: `ktd "
        r"run` then picks a free port.$"
    )


def test_a_held_master_port_is_refused_before_ranks_start(no_launch):
    with _HeldPort() as port:
        for argv in (
            ["--master-port", str(port), "-n", "2", _SCRIPT],
            [
                "--master-addr=127.0.0.1",
                f"--master_port={port}",
                "-n",
                "2",
                _SCRIPT,
            ],
        ):
            with pytest.raises(SystemExit, match=_port_in_use_message(port)):
                _torchrun.run(argv)


def test_a_master_port_taken_after_the_check_is_named_too(monkeypatch):
    """The port is free when checked but taken before torchrun binds it."""
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torch_run

    port = free_port()

    def taken(arguments):
        raise DistNetworkError(
            "The server socket has failed to listen on any local network "
            f"address. port: {port}, useIpv6: false, code: -98, name: "
            "EADDRINUSE, message: address already in use"
        )

    monkeypatch.setattr(torch_run, "main", taken)
    with pytest.raises(SystemExit, match=_port_in_use_message(port)):
        _torchrun.run(["--master-port", str(port), "-n", "2", _SCRIPT])
    # Other nodes host nothing: their torchrun runs unchecked.
    seen = []
    monkeypatch.setattr(torch_run, "main", seen.append)
    with _HeldPort() as held:
        _torchrun.run(
            [
                "--master-port",
                str(held),
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "-n",
                "1",
                _SCRIPT,
            ]
        )
    assert len(seen) == 1


# --------------------------------------------------------------------------
# The one-line failure summary
# --------------------------------------------------------------------------

_LOST_PEER = (
    "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
    "error [127.0.0.1]:16296: Connection reset by peer. This is typically "
    "caused by a remote worker hanging or bugs in the application."
)
_KERAS_LAYER_ERROR = (
    "ValueError: Exception encountered when calling Dense.call().\n\n"
    "\x1b[1mInvalid dtype: foo\n"
    "more detail\x1b[0m\n\n"
    "Arguments received by Dense.call():\n"
    "  \u2022 inputs=tensor\n"
    "  \u2022 training=False"
)


def _failure(tmp_path, local_rank, exitcode, timestamp, message=None):
    """torchrun's record of a failed rank; `message`: the exception the rank
    recorded in its error file (None: it recorded none, e.g. killed)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = str(tmp_path / f"error_{local_rank}.json")
    if message is not None:
        with open(error_file, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {
                            "py_callstack": "Traceback ...",
                            "timestamp": str(timestamp),
                        },
                    }
                },
                f,
            )
    failure = ProcessFailure(
        local_rank=local_rank,
        pid=1000 + local_rank,
        exitcode=exitcode,
        error_file=error_file,
    )
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
    summary = failure_summary(failures)
    assert summary == (
        "ktd run: rank 1 (local rank 1) died first, by signal SIGKILL (exit "
        "code -9). It was killed from outside Python (the kernel's "
        "out-of-memory killer: see `dmesg`; a scheduler's time or memory "
        "limit; or `kill`), so it left no traceback. torchrun stopped the "
        "other processes."
    )
    # Alone, the rank that lost its peer is named, with what that means.
    # torchrun's SIGTERM, which stopped it after it raised, is no cause.
    summary = failure_summary({0: failures[0]})
    assert summary.startswith(
        "ktd run: rank 0 (local rank 0) failed first, exit code unknown "
        "(torchrun stopped it by SIGTERM after it raised): "
        "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
        "error [127.0.0.1]:16296: Connection reset by peer. This is typically "
        "caused by a remote worker hanging or bugs in the application. It lost "
        "its connection to another rank"
    ), summary


def test_failure_summary_orders_and_words_each_kind_of_failure(tmp_path):
    raised = _failure(tmp_path, 1, 1, 100, _KERAS_LAYER_ERROR)
    # A rank torchrun stopped (SIGTERM, nothing recorded) in the same second
    # as the one that raised is not blamed.
    stopped = _failure(tmp_path, 0, -signal.SIGTERM, 100)
    summary = failure_summary({0: stopped, 1: raised})
    # The exception's type and first line, and for a Keras layer error the
    # error itself, not the last line (an argument of the call).
    assert summary.startswith(
        "ktd run: rank 1 (local rank 1) failed first, exit code 1: ValueError: "
        "Exception encountered when calling Dense.call(). Invalid dtype: foo. "
        "torchrun stopped the other processes; that rank's traceback is above."
    ), summary
    assert "training=False" not in summary
    crashed = _failure(tmp_path, 2, -signal.SIGSEGV, 100)
    assert failure_summary({2: crashed}) == (
        "ktd run: rank 2 (local rank 2) died first, by signal SIGSEGV (exit "
        "code -11). That is a crash in native code, not a Python exception, so "
        "it left no Python traceback; its last output above may say why. "
        "torchrun stopped the other processes."
    )
    exited = _failure(tmp_path, 3, 3, 100)
    assert failure_summary({3: exited}).startswith(
        "ktd run: rank 3 (local rank 3) failed first, exit code 3, without a "
        "Python exception on record"
    )
    # Two ranks that both lost a peer: the earlier one.
    late = _failure(tmp_path, 4, 1, 105, _LOST_PEER)
    early = _failure(tmp_path, 5, 1, 104, _LOST_PEER)
    assert failure_summary({4: late, 5: early}).startswith("ktd run: rank 5 ")


def _raised(tmp_path, local_rank, message, exitcode_seen, exit_code=1):
    """torchrun's record of a rank whose exception `launch._record` wrote
    (it chose `exit_code`), seen by torchrun to exit with `exitcode_seen`."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from keras_torch_distribution.launch._record import record_failure

    error_file = str(tmp_path / f"error_{local_rank}.json")
    record_failure(
        RuntimeError(message),
        exit_code,
        environ={"TORCHELASTIC_ERROR_FILE": error_file},
    )
    return ProcessFailure(
        local_rank=local_rank,
        pid=1000 + local_rank,
        exitcode=exitcode_seen,
        error_file=error_file,
    )


@pytest.mark.parametrize(
    "seen",
    [1, -signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGKILL],
    ids=["exited", "stopped", "stopped-handled", "killed"],
)
@pytest.mark.parametrize(
    "peer", ["lost-peer-exited-first", "peer-stopped"], ids=str
)
def test_a_rank_that_raised_is_named_with_the_exit_code_it_chose(
    tmp_path, seen, peer
):
    """Rank 1 raised and recorded its exception; whatever reached torchrun
    first (rank 1's own exit, or rank 0's failure on the lost connection,
    after which torchrun stopped rank 1 while it was still exiting: SIGTERM,
    143 where a handler took it, SIGKILL after the grace period), the
    summary is the same line, naming the exit code rank 1 chose (issue 49:
    it was missing when torchrun's stop arrived first)."""
    failures = {1: _raised(tmp_path, 1, "deliberate failure", seen)}
    if peer == "lost-peer-exited-first":
        failures[0] = _raised(tmp_path, 0, _LOST_PEER[14:], 1)
    else:  # stopped by torchrun after rank 1 raised: the same second, or later
        failures[0] = _failure(tmp_path, 0, -signal.SIGTERM, int(time.time()))
    assert failure_summary(failures) == (
        "ktd run: rank 1 (local rank 1) failed first, exit code 1: "
        "RuntimeError: deliberate failure. torchrun stopped the other "
        "processes; that rank's traceback is above."
    )


def test_an_exception_without_its_exit_code_says_the_code_is_unknown(
    tmp_path,
):
    """An error file without the code (torch's own `record` wrote it) of a
    rank torchrun stopped after it raised: the code is unknown, and said
    so, with the signal that stopped it."""
    stopped = _failure(tmp_path, 1, -signal.SIGTERM, 100, "RuntimeError: x")
    other = _failure(tmp_path, 0, -signal.SIGTERM, 101)
    assert failure_summary({1: stopped, 0: other}) == (
        "ktd run: rank 1 (local rank 1) failed first, exit code unknown "
        "(torchrun stopped it by SIGTERM after it raised): RuntimeError: x. "
        "torchrun stopped the other processes; that rank's traceback is above."
    )


@pytest.mark.parametrize(
    "signal_name, meaning",
    [
        (
            "SIGXFSZ",
            (
                "The file-size limit (`ulimit -f`) was hit while it wrote a "
                "file (a checkpoint, a log): raise or lift that limit, or "
                "write less, e.g. to another directory. It left no traceback."
            ),
        ),
        (
            "SIGBUS",
            (
                "Memory it had mapped went away: shared memory or a "
                "memory-mapped file was full or truncated, most often /dev/shm "
                "(a container's small --shm-size; see `df -h /dev/shm`). It "
                "left no traceback."
            ),
        ),
        (
            "SIGXCPU",
            (
                "Its CPU-time limit (`ulimit -t`, or a scheduler's) ran out: "
                "raise the limit. It left no traceback."
            ),
        ),
        (
            "SIGABRT",
            (
                "Native code aborted it (a failed C++ check, or `terminate "
                "called ...`); its last output above says why. It left no "
                "traceback."
            ),
        ),
        (
            "SIGTERM",
            (
                "It was killed from outside Python (the kernel's out-of-memory "
                "killer: see `dmesg`; a scheduler's time or memory limit; or "
                "`kill`), so it left no traceback."
            ),
        ),
    ],
)
def test_failure_summary_says_what_a_signal_means(
    tmp_path, signal_name, meaning
):
    """A rank killed by a signal that names its cause is not called a crash
    in native code: the summary says what was hit and the fix."""
    number = getattr(signal, signal_name)
    killed = _failure(tmp_path, 1, -number, 100)
    assert failure_summary({1: killed}) == (
        f"ktd run: rank 1 (local rank 1) died first, by signal {signal_name} "
        f"(exit code -{int(number)}). {meaning} torchrun stopped the other "
        "processes."
    )
    # The processes initialize() starts are named as that launcher's.
    assert failure_summary(
        {1: killed}, launcher="keras.distribution.initialize()"
    ).startswith(
        "keras.distribution.initialize(): rank 1 (local rank 1) died first"
    )


def _recorded(tmp_path, local_rank, exitcode, timestamp, message, short):
    """A failure whose error file is `launch._record`'s: with the short
    traceback and the time to the microsecond."""
    failure = _failure(tmp_path, local_rank, exitcode, int(timestamp), message)
    with open(failure.error_file) as f:
        data = json.load(f)
    data["message"]["extraInfo"].update(ktd_traceback=short, ktd_time=timestamp)
    with open(failure.error_file, "w") as f:
        json.dump(data, f)
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(
        local_rank=local_rank,
        pid=1000 + local_rank,
        exitcode=exitcode,
        error_file=failure.error_file,
    )


def test_failure_report_says_the_error_once(tmp_path, monkeypatch):
    """The first failure's short traceback once (the earliest by the time
    to the microsecond: torchrun's whole seconds tie), a line for every
    other rank, where the whole tracebacks are, the summary last."""
    from keras_torch_distribution._processes.failures import failure_report

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    error = "ValueError: batch_size=127 ... e.g. 126."
    short = 'Traceback (most recent call last):\n  File "t.py"\n' + error
    failures = {
        0: _failure(tmp_path, 0, -signal.SIGTERM, 100),
        1: _recorded(tmp_path, 1, 1, 100.7, error, short),
        2: _recorded(tmp_path, 2, 1, 100.2, error, short),
        3: _recorded(tmp_path, 3, 1, 100.9, _LOST_PEER, "..."),
    }
    lines = failure_report(failures).splitlines()
    assert lines[:3] == [
        "rank 2: " + short.splitlines()[0],
        *short.splitlines()[1:],
    ]
    assert lines[3:6] == [
        "rank 0: stopped by the launcher after rank 2 failed.",
        "rank 1: same error.",
        "rank 3: lost its connection to a failed rank: " + _LOST_PEER,
    ]
    (path,) = re.findall(r"whole traceback is in (\S+) ", lines[6])
    assert open(path).read().count("=== rank ") == 3  # those with a record
    assert lines[7] == failure_summary(failures)
    assert lines[7].startswith("ktd run: rank 2 (local rank 2) failed first")
    assert len(lines) == 8
    # KTD_FULL_TRACEBACKS=1: the ranks printed theirs; the summary alone.
    assert failure_report(failures, full_tracebacks=True) == lines[7]


@pytest.mark.parametrize(
    "argv, env",
    [
        (["-n", "gpu"], {}),
        (["--nproc-per-node=gpu"], {}),
        (["--nproc_per_node", "gpu"], {}),
        (["-n", "2"], {"KTD_DEVICE": "gpu"}),
    ],
)
def test_a_cuda_request_without_cuda_is_refused(
    no_launch, monkeypatch, argv, env
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match="asks for CUDA, but CUDA is not") as e:
        _torchrun.run([*argv, _SCRIPT])
    assert e.value.code == 2


# --------------------------------------------------------------------------
# Issue 48, item 10: the same error everywhere, sys.exit(N), failure files
# --------------------------------------------------------------------------


def _exited_by(tmp_path, local_rank, code, exitcode_seen=None):
    """torchrun's record of a rank that ended by `sys.exit(code)` in a
    script (`launch._record.record_exit` wrote its file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from keras_torch_distribution.launch._record import record_exit

    error_file = str(tmp_path / f"error_{local_rank}.json")
    script = tmp_path / "train.py"
    script.write_text("import sys\n\nsys.exit(CODE)\n")
    try:
        exec(compile(script.read_text(), str(script), "exec"), {"CODE": code})
    except SystemExit as stop:
        record_exit(stop, environ={"TORCHELASTIC_ERROR_FILE": error_file})
    return ProcessFailure(
        local_rank=local_rank,
        pid=1000 + local_rank,
        exitcode=code if exitcode_seen is None else exitcode_seen,
        error_file=error_file,
    )


def test_every_rank_that_raised_the_same_error_is_said_so(tmp_path):
    """No "torchrun stopped the other processes" when every rank raised
    the error itself."""
    from keras_torch_distribution._processes.failures import failure_report

    failures = {
        0: _raised(tmp_path, 0, "same on every rank", 1),
        1: _raised(tmp_path, 1, "same on every rank", 1),
    }
    report = failure_report(failures).splitlines()
    assert report[-1] == (
        "ktd run: rank 0 (local rank 0) failed first, exit code 1: "
        "RuntimeError: same on every rank. Every other rank (rank 1) raised "
        "the same error; the traceback above is rank 0's."
    )
    assert "rank 1: same error." in report
    os.remove(re.findall(r"traceback is in (\S+) ", "\n".join(report))[0])


def test_sys_exit_on_every_rank_is_named_with_its_code_and_line(tmp_path):
    """`sys.exit(3)` on every rank: the code and the line, no "stopped by
    the launcher" (torchrun's SIGTERM reached rank 1 while it exited), and
    `ktd run` exits 3."""
    from keras_torch_distribution._processes.failures import failure_report
    from keras_torch_distribution._processes.failures import launcher_exit_code

    failures = {
        0: _exited_by(tmp_path, 0, 3),
        1: _exited_by(tmp_path, 1, 3, exitcode_seen=-signal.SIGTERM),
    }
    where = f"{tmp_path / 'train.py'}:3"
    assert failure_report(failures).splitlines() == [
        "rank 1: same exit.",
        f"ktd run: rank 0 (local rank 0) exited first with code 3 (sys.exit "
        f"at {where}). Every other rank (rank 1) did the same.",
    ]
    assert launcher_exit_code(failures) == 3
    alone = {0: failures[0]}
    assert failure_summary(alone).endswith(f"(sys.exit at {where}).")
    # A rank that raised: 1; killed by a signal: 1 (the signal is said).
    assert launcher_exit_code({0: _raised(tmp_path, 0, "x", 1)}) == 1
    assert launcher_exit_code({0: _failure(tmp_path, 0, -9, 100)}) == 1


def test_failure_files_are_kept_for_the_newest_runs_only(tmp_path, monkeypatch):
    """Every failed run writes its ranks' whole tracebacks to a file in the
    temporary directory; only the newest KEPT_FAILURE_FILES stay."""
    import tempfile

    from keras_torch_distribution._processes import failures as report

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = tmp_path / "someone-elses.txt"
    other.write_text("kept")
    failed = {0: _raised(tmp_path, 0, "boom", 1)}
    paths = []
    for age in range(report.KEPT_FAILURE_FILES + 3):
        paths.append(report._write_tracebacks(failed))
        os.utime(paths[-1], (1000 + age, 1000 + age))
    left = sorted(p.name for p in tmp_path.glob("ktd-failure-*.txt"))
    assert left == sorted(
        os.path.basename(p) for p in paths[-report.KEPT_FAILURE_FILES :]
    )
    assert other.read_text() == "kept"
