"""Restarts inside one `ktd run` job (torchrun --max-restarts): rank 1 is
lost three times in a row (SIGKILL, SIGTERM, a Python exception), torchrun
starts both ranks again each time, and the last attempt resumes from the
backup and ends with the weights of an uninterrupted fit. And SIGUSR1 (a
SLURM job's warning before its end) sent to `ktd run` reaches the ranks.

Each restart finds torchrun's store as the attempts before left it (the
agent keeps one store for its whole life); without a key space of its own
per start (`_processes.agent_store`), gloo read the previous attempt's
addresses and failed (`connectFullMesh ... Connection refused`) or hung.
The launch runs in its own session with a timeout, and every wait of the
ranks is bounded by KTD_TIMEOUT_SECONDS. What is handed to torchrun, and
the key spaces, are tested without launching in
unit/test_launch_restarts.py.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT
from helpers import finish

_SCRIPT = "tests/scripts/restart_fit.py"
_ENDINGS = ("sigkill", "sigterm", "raise")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu", **extra)
    env.pop("KERAS_BACKEND", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    env.pop("MASTER_PORT", None)
    env.pop("PET_SIGNALS_TO_HANDLE", None)
    return env


def _ktd_run(*args, **env):
    """`ktd run -n 2 ARGS` in a session of its own (see helpers.finish)."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_torch_distribution", "run", "-n", "2"]
        + list(args),
        cwd=ROOT,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_restarts_after_sigkill_sigterm_and_an_exception_resume(tmp_path):
    backup = tmp_path / "backup"
    process = _ktd_run(
        "--max-restarts",
        str(len(_ENDINGS)),
        "--monitor-interval",
        "0.2",
        _SCRIPT,
        str(backup),
        ",".join(_ENDINGS),
        KTD_TIMEOUT_SECONDS="30",
    )
    result = finish(process, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-4000:]
    for attempt, how in enumerate(_ENDINGS):
        assert f"attempt={attempt} rank=1 ends by {how}" in out, out
    for attempt in range(len(_ENDINGS) + 1):  # every attempt started
        for rank in (0, 1):
            assert f"attempt={attempt} rank={rank} start=" in out, out
    finished = re.findall(
        r"attempt=(\d+) rank=(\d) resumed=(\S+) reference=(\S+) "
        r"same_weights=(True|False)\b",
        out,
    )
    last = str(len(_ENDINGS))
    assert sorted(rank for attempt, rank, *_ in finished) == ["0", "1"], out
    for attempt, _, resumed, reference, same in finished:
        # The last attempt resumed from the backup; its fit ends where an
        # uninterrupted one does, to the bit.
        assert (attempt, resumed, same) == (last, reference, "True"), out
    assert "connectFullMesh" not in result.stderr
    assert not backup.exists()  # BackupAndRestore deletes it when fit ends


@pytest.mark.slow
def test_sigusr1_to_ktd_run_reaches_the_ranks(tmp_path):
    """SIGUSR1's default action would end torchrun's agent (its ranks then
    die with it, unwarned): `ktd run` adds it to the signals the agent
    passes on, and exits with 138 once the ranks stopped."""
    process = _ktd_run("tests/scripts/restart_wait_signal.py", str(tmp_path))
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        if time.monotonic() > deadline or process.poll() is not None:
            finish(process, timeout=1)  # the output, on timeout
            raise AssertionError("the ranks never got ready")
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR1)  # `ktd run`: the agent itself
    result = finish(process, timeout=300)
    assert sorted(re.findall(r"rank=\d got=\w+", result.stdout)) == [
        "rank=0 got=SIGUSR1",
        "rank=1 got=SIGUSR1",
    ], result.stdout + result.stderr[-3000:]
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    assert result.stderr.rstrip().endswith(
        "ktd run: got SIGUSR1; torchrun passed it on to the ranks and stopped "
        "them. Exiting with 138, as a process ended by SIGUSR1."
    )
