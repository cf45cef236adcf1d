"""examples/checkpoint_resume.py: a first run stops after 2 epochs, a second run
resumes from the newest sharded checkpoint; `ktd report` shows the shards."""

import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT


def _ktd(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu")
    env.pop("KERAS_BACKEND", None)
    return subprocess.run(
        [sys.executable, "-m", "keras_torch_distribution", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_checkpoint_example_resumes_and_report_shows_shards(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = _ktd(
        "run", "-n", "2", "examples/checkpoint_resume.py", directory, "4"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "first run: epochs [0, 1]" in first.stdout
    second = _ktd(
        "run", "-n", "2", "examples/checkpoint_resume.py", directory, "4"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed: epochs [2, 3]" in second.stdout
    newest = sorted(os.listdir(directory))[-1]
    # the folder ShardedCheckpoint wrote in: its newest checkpoint
    report = _ktd("report", directory)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0].startswith(
        f"checkpoint {os.path.join(directory, newest)} (the newest of "
    )
    assert lines[1].startswith("epoch 4, step ")
    kernel = [line for line in lines if line.startswith("model/hidden/kernel")]
    assert kernel and kernel[0].endswith(
        "ranks 0-1: (16, 32) each, split on dim 1"
    )
    assert re.search(
        r"bytes written: rank 0: [\d.]+ KiB; rank 1: [\d.]+ KiB", report.stdout
    )
    missing = _ktd("report", str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert "is not a complete checkpoint: it does not exist" in missing.stderr
