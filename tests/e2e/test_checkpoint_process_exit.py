"""Checkpoints when real processes end.

- A rank killed mid-fit: a 2-process torchrun job (tests/scripts/resume_fit.py)
  is killed (rank 1, SIGKILL) after epoch 2 and launched again;
  BackupAndRestore resumes from its last backup and ends with the weights of
  an uninterrupted run on the session pool (dropout included).
- An `async_save` never completed with `.result()` is completed at exit: a
  one-process script really exits; on 2 ranks, what the exit hook does.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import EPOCHS
from helpers import KILL_AFTER_EPOCH
from helpers import ROOT
from helpers import SAVE_RULES
from helpers import TESTS
from helpers import assert_same_values
from helpers import checkpoint_data
from helpers import checkpoint_model
from helpers import checkpoint_values
from helpers import distribute
from helpers import resume_fit

# ---------------------------------------------------------------------------
# BackupAndRestore: kill rank 1 in the middle of fit, restart, compare.
# ---------------------------------------------------------------------------


def uninterrupted(backup_dir):
    return resume_fit(backup_dir, None, kill=False)


def _torchrun(tmp_path, attempt):
    """One launch of the 2-process job; returns (exit code, stderr)."""
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        KTD_DEVICE="cpu",
        KTD_TIMEOUT_SECONDS="60",
        PYTHONWARNINGS="ignore",
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        os.path.join(TESTS, "scripts", "resume_fit.py"),
        str(tmp_path / "backup"),
        str(tmp_path),
        str(attempt),
    ]
    # Its own session, so that a timeout ends torchrun and its workers.
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(f"torchrun did not finish within 600 s:\n{stderr[-4000:]}")
    return process.returncode, stderr


@pytest.mark.slow
def test_backup_and_restore_resumes_after_a_process_is_killed(pool2, tmp_path):
    # The job is launched, rank 1 is killed after epoch 2 (torchrun then
    # stops rank 0 and fails), and the job is launched again, as a scheduler
    # or torchrun's --max-restarts would.
    code, stderr = _torchrun(tmp_path, 0)
    assert code != 0 and "exitcode: -9" in stderr, stderr[-4000:]
    assert not (tmp_path / "attempt0.json").exists()  # killed before the end
    assert sorted(os.listdir(tmp_path / "backup")) == ["latest.ckpt"]
    code, stderr = _torchrun(tmp_path, 1)
    assert code == 0, stderr[-4000:]
    report = json.loads((tmp_path / "attempt1.json").read_text())
    # Resumed after the last backup (epoch 2), not from scratch.
    assert report["seen"] == list(range(KILL_AFTER_EPOCH, EPOCHS))
    assert report["backup_left"] is False  # deleted at the end, once
    resumed = {
        k.replace("|", "/"): v
        for k, v in np.load(tmp_path / "attempt1.npz").items()
    }
    seen, reference = pool2.run(uninterrupted, str(tmp_path / "reference"))[0]
    assert seen == list(range(EPOCHS))
    assert_same_values(resumed, reference)


# ---------------------------------------------------------------------------
# An async save never completed with .result(): completed at exit.
# ---------------------------------------------------------------------------


def async_never_completed(path):
    import logging

    from keras_torch_distribution import checkpoint
    from keras_torch_distribution._log import logger
    from keras_torch_distribution.checkpoint import _dcp

    distribute(SAVE_RULES)
    model = checkpoint_model()
    model.fit(
        *checkpoint_data(), batch_size=8, epochs=1, shuffle=False, verbose=0
    )
    checkpoint.async_save(model, path, extra={"epoch": 1})  # no .result()
    pending_early = checkpoint.is_checkpoint(path)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        _dcp.complete_at_exit()  # what atexit runs
    finally:
        logger.removeHandler(handler)
    return (
        pending_early,
        checkpoint.is_checkpoint(path),
        [r.getMessage() for r in records],
        checkpoint_values(model),
    )


def test_async_save_never_completed_is_completed_at_exit(pool2, tmp_path):
    from keras_torch_distribution import checkpoint

    # A real exit of a one-process script that never calls .result().
    script = (
        "import os, sys; os.environ['KERAS_BACKEND'] = 'torch'\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from helpers import checkpoint_model\n"
        "from keras_torch_distribution import checkpoint\n"
        "checkpoint.async_save(checkpoint_model(), sys.argv[1], "
        "extra={'epoch': 7})\n"
    )
    one = str(tmp_path / "one")
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    done = subprocess.run(
        [sys.executable, "-c", script, one, TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint.is_checkpoint(one), done.stderr[-3000:]
    assert checkpoint.read_extra(one) == {"epoch": 7}
    assert (
        "never completed with .result(); completing it at exit" in done.stderr
    )

    # On 2 ranks, what the exit hook does (the pool's ranks do not exit).
    path = str(tmp_path / "async")
    results = pool2.run(async_never_completed, path)
    for rank, (early, complete, messages, _) in enumerate(results):
        assert early is False and complete is True
        if rank == 0:  # the package logs from rank 0
            assert any(
                "never completed with .result()" in m for m in messages
            ), messages
    model = checkpoint_model()
    assert checkpoint.load(model, path) == {"epoch": 1}
    assert_same_values(checkpoint_values(model), results[0][3])
