"""Preemption with real processes under `ktd run -n 2`
(tests/scripts/preempt_fit.py: a shuffled DataParallel fit with dropout and
BackupAndRestore, 3 epochs of 5 batches):

- `kill -TERM` from outside to one rank mid-epoch: every rank stops at one
  step, writes the backup there and exits with 143; launched again, the
  job trains only the batches that were left and ends with the weights of
  an uninterrupted run.
- `--max-restarts 1` with a rank that SIGTERMs itself, SIGKILLs itself or
  crashes: torchrun restarts the workers, which resume (from the agreed
  step; from the newest periodic backup after a kill or a crash) and end
  with the uninterrupted run's weights.
- `initialize(num_processes=2)` with KTD_MAX_RESTARTS=1 does the same
  without a launcher.
- A rank SIGKILLed while an async `ShardedCheckpoint` save is being
  written: the save cut short is never read; launched again, the job
  resumes from the save before it.

The uninterrupted run is the same function on the session's pool.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import PREEMPT_BATCHES
from helpers import PREEMPT_EPOCHS
from helpers import ROOT
from helpers import TESTS
from helpers import assert_same_values
from helpers import preempt_fit

SCRIPT = os.path.join(TESTS, "scripts", "preempt_fit.py")
EVERY_BATCH = [
    (e, b) for e in range(PREEMPT_EPOCHS) for b in range(PREEMPT_BATCHES)
]
LIMIT_S = 600  # a bound for a hang, not a speed


def _environment(**settings):
    """The workers' environment: CPU, one thread, a 60 s timeout, no
    attempt number of the caller's; `settings` added."""
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        KTD_DEVICE="cpu",
        KTD_TIMEOUT_SECONDS="60",
        PYTHONWARNINGS="ignore",
        **settings,
    )
    env.pop("PREEMPT_ATTEMPT", None)
    return env


def _launch(out, how, step, *options, save_freq=None, attempt=None):
    env = _environment()
    if attempt is not None:
        env["PREEMPT_ATTEMPT"] = str(attempt)
    command = [
        sys.executable,
        "-m",
        "keras_torch_distribution",
        "run",
        "-n",
        "2",
        *options,
        SCRIPT,
        str(out),
        how,
        str(step),
    ]
    if save_freq is not None:
        command.append(str(save_freq))
    # Its own session, so that a timeout ends the launcher and its workers.
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process):
    try:
        stdout, stderr = process.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(f"no end within {LIMIT_S} s:\n{stderr[-4000:]}")
    return process.returncode, stdout + stderr


def _values(path):
    return {k.replace("|", "/"): v for k, v in np.load(path).items()}


def _seen(out, attempt):
    report = json.loads((out / f"attempt{attempt}.json").read_text())
    return [tuple(pair) for pair in report["seen"]]


_REFERENCE = {}


@pytest.fixture
def reference(pool2, tmp_path_factory):
    """The uninterrupted run's values (computed once per module)."""
    if not _REFERENCE:
        out = str(tmp_path_factory.mktemp("uninterrupted"))
        seen, values = pool2.run(preempt_fit, out, 0)[0]
        assert [tuple(pair) for pair in seen] == EVERY_BATCH
        _REFERENCE.update(values)
    return _REFERENCE


@pytest.mark.slow
def test_kill_term_from_outside_then_launched_again(reference, tmp_path):
    process = _launch(tmp_path, "term-outside", 7)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + LIMIT_S
    while not pid_file.exists():
        assert process.poll() is None, _finish(process)[1][-4000:]
        assert time.monotonic() < deadline, "rank 1 never reached step 7"
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)
    signalled = time.monotonic()
    code, output = _finish(process)
    seconds = time.monotonic() - signalled
    assert code != 0, output[-4000:]
    # Both ranks stop at the same step; rank 0 says so for the job, naming
    # the signal and rank 1.
    lines = [
        line
        for line in output.splitlines()
        if "preempted by SIGTERM (received by rank(s) [1])" in line
    ]
    assert len(lines) == 1 and lines[0].startswith("[ktd rank 0]"), output[
        -4000:
    ]
    assert "Exiting with 143" in lines[0]
    assert sorted(os.listdir(tmp_path / "backup")) == ["latest.ckpt"]
    print(f"signal to launcher exit: {seconds:.1f} s")
    code, output = _finish(_launch(tmp_path, "none", 0, attempt=1))
    assert code == 0, output[-4000:]
    seen = _seen(tmp_path, 1)
    # Rank 1 went on with 0.3 s per batch after step 7 until the signal was
    # agreed on: the resumed run starts right after the agreed step.
    assert seen == EVERY_BATCH[len(EVERY_BATCH) - len(seen) :]
    assert 0 < len(seen) <= len(EVERY_BATCH) - 7
    assert not (tmp_path / "backup").exists()
    assert_same_values(_values(tmp_path / "attempt1.npz"), reference)


RESTARTS = [
    # (how, step, save_freq, the step the restart resumes after). A kill
    # ("kill", 7, 3, 6) and a crash ("crash", 8, 3, 6) pass too; restarts
    # after both are in test_restarts.py, and a resume from a periodic
    # save after a crash in multiprocess/test_preemption.py.
    ("term-self", 7, None, 7),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "how,step,save_freq,resumed_after", RESTARTS, ids=[r[0] for r in RESTARTS]
)
def test_max_restarts_resumes_by_itself(
    reference, tmp_path, how, step, save_freq, resumed_after
):
    process = _launch(
        tmp_path,
        how,
        step,
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        save_freq=save_freq,
    )
    code, output = _finish(process)
    assert code == 0, output[-4000:]
    assert not (tmp_path / "attempt0.json").exists()  # attempt 0 stopped
    assert _seen(tmp_path, 1) == EVERY_BATCH[resumed_after:], output[-4000:]
    assert not (tmp_path / "backup").exists()
    assert_same_values(_values(tmp_path / "attempt1.npz"), reference)


@pytest.mark.slow
def test_a_rank_killed_during_an_async_save_resumes_from_the_save_before(
    reference, tmp_path
):
    # Rank 1 dies while writing the checkpoint of step 7; launched again,
    # the job resumes from step 6's and never reads the one cut short.
    code, output = _finish(_launch(tmp_path, "kill-while-saving", 7))
    assert code != 0, output[-4000:]
    # The survivor's exit sequence runs whole (no atexit traceback).
    assert "Exception ignored in atexit" not in output, output[-4000:]
    names = sorted(os.listdir(tmp_path / "backup"))
    assert "ckpt-000000007.incomplete" in names, names
    assert "ckpt-000000006" in names, names
    code, output = _finish(_launch(tmp_path, "kill-while-saving", 7, attempt=1))
    assert code == 0, output[-4000:]
    assert _seen(tmp_path, 1) == EVERY_BATCH[6:]
    names = sorted(os.listdir(tmp_path / "backup"))
    assert not [n for n in names if n.endswith(".incomplete")], names
    assert_same_values(_values(tmp_path / "attempt1.npz"), reference)


@pytest.mark.slow
def test_initialize_spawn_restarts_and_resumes_by_itself(reference, tmp_path):
    # No launcher: initialize(num_processes=2) starts the processes through
    # torch's elastic agent, which restarts them (KTD_MAX_RESTARTS=1) after
    # rank 1's SIGTERM; they resume at the agreed step.
    env = _environment(KTD_MAX_RESTARTS="1", PREEMPT_SPAWN="1")
    process = subprocess.Popen(
        [sys.executable, SCRIPT, str(tmp_path), "term-self", "7"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    code, output = _finish(process)
    assert code == 0, output[-4000:]
    assert "preempted by SIGTERM (received by rank(s) [1])" in output
    assert _seen(tmp_path, 1) == EVERY_BATCH[7:], output[-4000:]
    assert_same_values(_values(tmp_path / "attempt1.npz"), reference)
