"""The habits users bring from JAX, DDP and torchrun (issue 48), under
`ktd run -n 2`, started together as one batch (module fixture):

- a JAX user's shell (KERAS_BACKEND=jax, in a Python where jax cannot be
  imported, as in a torch-only environment): `ktd run` trains an
  unchanged Keras script with one note line, `ktd env` exits 0 showing
  the shell's backend with the note; a misspelled KTD_* name is said once;
- `if rank == 0: model.save(...)` (tests/scripts/user_mistakes.py `save`),
  and the same followed by a `fit` on every rank: every rank ends, the
  error names model.save and the fix in a few lines, no hang;
- a script that never imports Keras: its ranks start without importing
  torch, Keras or the package; Ctrl-C gives the prompt back right after
  the ranks are gone; `sys.exit(3)` on every rank is said with its code
  and line, and `ktd run` exits 3.

Refusals before any rank starts (a missing script, a directory, a syntax
error) are tests/unit/test_cli.py's.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT
from helpers import finish_all
from helpers import job_env

MISTAKES = os.path.join(ROOT, "tests", "scripts", "user_mistakes.py")
NO_KERAS = os.path.join(ROOT, "tests", "scripts", "no_keras.py")
UNCHANGED = os.path.join(ROOT, "tests", "scripts", "unchanged_keras_script.py")
NOTE = (
    "ktd: note: KERAS_BACKEND=jax in this shell; ktd runs the ranks with Keras "
    "on torch (KERAS_BACKEND=torch), the backend keras_torch_distribution "
    "distributes."
)
MISSPELLED = (
    "ktd run: KTD_LOG_LEVL (did you mean KTD_LOG_LEVEL?) is no KTD_* setting "
    "and is ignored: rename or unset it (`ktd env` lists every setting)."
)


def _ktd(*args, cwd, env):
    """`ktd ARGS` in a session of its own (killed on timeout)."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_torch_distribution_cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _jax_shell(tmp):
    """A JAX user's shell in a Python that cannot import jax."""
    blocked = tmp / "no_jax" / "jax"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'jax'\", name='jax')\n"
    )
    path = os.pathsep.join(
        p for p in (str(blocked.parent), os.environ.get("PYTHONPATH")) if p
    )
    return job_env(
        keep_backend=True,
        KERAS_BACKEND="jax",
        PYTHONPATH=path,
        KTD_LOG_LEVL="INFO",
    )


def _alive(pid):
    """False once `pid` has exited (a zombie not yet reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _interrupt(sleeper):
    """Ctrl-C (SIGINT to the session, as a terminal sends it) once both
    ranks are ready; seconds from the last rank's exit to `ktd`'s."""
    pids = []
    while len(pids) < 2:
        line = sleeper.stdout.readline()
        assert line, (
            f"the sleeping ranks ended before they were ready (exit status "
            f"{sleeper.wait()}): {sleeper.stderr.read()}"
        )
        pids.append(int(line.split()[2]))  # "ready RANK PID imported [...]"
    os.killpg(sleeper.pid, signal.SIGINT)
    gone = None
    while sleeper.poll() is None:
        if gone is None and not any(_alive(pid) for pid in pids):
            gone = time.monotonic()
        time.sleep(0.01)
    ended = time.monotonic()
    return ended - (gone or ended)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("habits")
    exits = tmp / "exits"
    exits.mkdir()
    jax = _jax_shell(tmp)
    plain = job_env(keep_backend=False)
    runs = {
        "jax run": (["run", "-n", "2", UNCHANGED], jax),
        "jax env": (["env"], jax),
        "save": (["run", "-n", "2", MISTAKES, "save"], plain),
        "save-fit": (["run", "-n", "2", MISTAKES, "save-fit"], plain),
        "no keras": (["run", "-n", "2", NO_KERAS], plain),
        "exit 3": (["run", "-n", "2", NO_KERAS, "exit", str(exits)], plain),
        "sleep": (["run", "-n", "2", NO_KERAS, "sleep"], plain),
    }
    processes = [_ktd(*args, cwd=tmp, env=env) for args, env in runs.values()]
    try:
        after_ranks = _interrupt(processes[-1])
    finally:
        results = finish_all(processes, timeout=300)
    return dict(zip(runs, results, strict=True)), after_ranks


def test_a_jax_shell_trains_on_torch_with_one_note(launched):
    result = launched[0]["jax run"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("processes=2 backend=torch") == 2, result.stdout
    # The note once, and the misspelled setting once (not by the ranks).
    assert result.stderr.splitlines() == [MISSPELLED, NOTE], result.stderr


def test_ktd_env_in_a_jax_shell_shows_jax_with_the_note(launched):
    result = launched[0]["jax env"]
    assert result.returncode == 0, result.stderr
    (line,) = [
        line for line in result.stdout.splitlines() if "KERAS_BACKEND" in line
    ]
    assert line.split()[:2] == ["KERAS_BACKEND", "jax"], line
    assert "(note: ktd, and the ranks of `ktd run`, run Keras on torch" in line
    for shown in ("keras_hub", "KERAS_DISTRIBUTION_NUM_PROCESSES"):
        assert f"\n{shown} " in result.stdout, result.stdout
    assert (
        "KTD_LOG_LEVL" in result.stdout
        and "^ UNKNOWN: no such setting, ignored; did you mean KTD_LOG_LEVEL?"
        in result.stdout
    ), result.stdout


@pytest.mark.parametrize("mode", ["save", "save-fit"])
def test_a_rank_0_only_save_ends_every_rank_naming_the_fix(launched, mode):
    result = launched[0][mode]
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr
    assert len(lines) <= 10, result.stderr
    assert "ranks [0] called model.save(); ranks [1] " in lines[-1], lines[-1]
    assert "call it" in lines[-1] or "call each" in lines[-1], lines[-1]
    assert (
        "on every rank" in lines[-1]
        and "not under `if rank == 0`" in (lines[-1])
    )
    if mode == "save":  # rank 1 ended its script: no signal, no blame
        assert "reached the end of the script" in lines[-1]
        assert "model.save(os.path.join" in result.stderr  # the user's line
        assert not any(line.startswith("rank 1") for line in lines), lines
    else:
        assert "ranks [1] called model.fit()" in lines[-1]
    assert "SIG" not in result.stderr and "out-of-memory" not in result.stderr


def test_a_script_without_keras_starts_without_it(launched):
    result = launched[0]["no keras"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("imported []") == 2, result.stdout
    assert result.stderr == ""


def test_ctrl_c_gives_the_prompt_back_right_after_the_ranks(launched):
    results, after_ranks = launched
    assert results["sleep"].returncode == 130, results["sleep"].stderr
    assert len(results["sleep"].stderr.splitlines()) == 1
    assert after_ranks < 2, after_ranks


def test_sys_exit_3_on_every_rank_is_said_once_and_exits_3(launched):
    result = launched[0]["exit 3"]
    lines = result.stderr.splitlines()
    assert result.returncode == 3, result.stderr
    assert len(lines) == 2, lines
    assert lines[0] in ("rank 0: same exit.", "rank 1: same exit."), lines
    assert "exited first with code 3 (sys.exit at " in lines[1], lines
    assert "no_keras.py:" in lines[1] and "did the same." in lines[1], lines
