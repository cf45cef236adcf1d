"""`ktd run` starts scripts on 2 local processes (the README's demo too)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ktd_run(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu")
    env.pop("KERAS_BACKEND", None)
    return subprocess.run(
        [sys.executable, "-m", "keras_torch_distribution", "run", "-n", "2", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


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
