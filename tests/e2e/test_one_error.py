"""What a user sees under `ktd run -n 2` (issue 39): one error once, a
one-line Ctrl-C, rank 0 speaking for the job.

The five configuration errors a first user makes (tests/scripts/
user_mistakes.py), Ctrl-C and the warnings script run together, as one
batch of launches started at once (module fixture): each failing launch
prints its first failure's traceback once, one line for the other rank
and the summary, at most 40 lines with the fix in the last line.
Refusals before any rank starts (a missing script, a CUDA request without
CUDA, a bad setting) are one line with exit 2, also here; the parser's
own `--help` and usage errors are tests/unit/test_cli.py's.
"""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from helpers import finish_all
from helpers import job_env

SCRIPT = os.path.join(ROOT, "tests", "scripts", "user_mistakes.py")
# Each mistake, and the words of its fix the last line must hold.
MISTAKES = {
    "batch": "use a multiple of 2, e.g. 126.",
    "mesh": "build it from keras.distribution.list_devices() with a shape "
    "whose product is 2",
    "axis": "Valid axis names: {'batch'}, Got {'model'}",
    "load": "pass such a directory",
    "gpu": "Use keras.distribution.list_devices() for this run's devices",
}


def _env(**extra):
    return job_env(keep_backend=True, **extra)


def _ktd(*args, cwd, **env):
    """`ktd ARGS` in a session of its own (killed on timeout)."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_torch_distribution_cli", *args],
        cwd=cwd,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


# Refusals before any rank starts: (ktd arguments, settings).
REFUSALS = {
    "missing": (["run", "-n", "2", "no_such_script.py"], {}),
    "cuda": (["run", "-n", "2", SCRIPT, "batch"], {"KTD_DEVICE": "cuda"}),
    "n gpu": (["run", "-n", "gpu", SCRIPT, "batch"], {}),
    "fsdp": (["run", "-n", "2", SCRIPT, "batch"], {"KTD_FSDP_GROUP": "big"}),
    "env": (["env"], {"KTD_LOG_LEVEL": "loud", "KTD_FSDP_GROUP": "big"}),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """name -> CompletedProcess: `ktd run -n 2 user_mistakes.py MODE` for
    each mode, and each of REFUSALS, all started at once; "sleep" gets
    Ctrl-C (SIGINT to its session, as a terminal sends it) once both ranks
    are ready."""
    cwd = str(tmp_path_factory.mktemp("mistakes"))
    modes = [*MISTAKES, "speak", "sleep"]
    processes = [_ktd("run", "-n", "2", SCRIPT, m, cwd=cwd) for m in modes]
    sleeper = processes[-1]
    processes += [
        _ktd(*args, cwd=cwd, **env) for args, env in REFUSALS.values()
    ]
    seen = ""  # the ranks' prints may share a line: "readyready 1\n 0"
    try:
        while seen.count("ready") < 2:
            line = sleeper.stdout.readline()
            assert line, "the sleeping ranks ended before they were ready"
            seen += line
        os.killpg(sleeper.pid, signal.SIGINT)
    finally:
        results = finish_all(processes, timeout=300)
    return dict(zip([*modes, *REFUSALS], results, strict=True)), cwd


@pytest.mark.parametrize("mode", list(MISTAKES))
def test_a_mistake_is_said_once_with_the_fix_last(launched, mode):
    if mode == "gpu" and torch.cuda.is_available():
        pytest.skip("a gpu mesh is no mistake here")
    result = launched[0][mode]
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr
    assert len(lines) <= 40, result.stderr
    assert MISTAKES[mode] in lines[-1], lines[-1]
    assert re.match(
        r"ktd run: rank \d \(local rank \d\) failed first", lines[-1]
    )
    # One traceback, the user's own line in it and no launcher frame.
    assert result.stderr.count("Traceback (most recent call last)") == 1
    assert "user_mistakes.py" in result.stderr
    for hidden in ("runpy", "launch/__main__.py", "_install.py", "elastic"):
        assert hidden not in result.stderr, result.stderr
    # The other rank, in one line; torchrun's SIGTERM is nobody's cause.
    assert sum(line.startswith("rank ") for line in lines) == 2, lines
    assert "SIGTERM" not in lines[-1]
    # Every rank's whole traceback is kept in a file.
    (path,) = re.findall(r"whole traceback is in (\S+) ", result.stderr)
    with open(path) as file:
        kept = file.read()
    os.remove(path)
    assert kept.count("Traceback (most recent call last)") == 2
    assert "launch/__main__.py" in kept


def test_ctrl_c_is_one_line_and_exit_130(launched):
    result = launched[0]["sleep"]
    assert result.returncode == 130, result.stderr
    assert result.stderr.splitlines() == [
        "ktd run: got SIGINT; torchrun passed it on to the ranks and stopped "
        "them. Exiting with 130, as a process ended by SIGINT."
    ]


def test_rank_0_speaks_for_the_job(launched):
    result = launched[0]["speak"]
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert err.count("a warning of the script") == 2  # the warning, its line
    assert re.search(r"user_mistakes\.py:\d+: UserWarning: a warning", err)
    assert err.count("another library's warning") == 1
    assert "[ktd rank 0] WARNING: the package's warning before" in err
    # The prefix survives another library's logging.basicConfig(), without
    # basicConfig's own "WARNING:keras_torch_distribution:" (issue 48).
    assert (
        "[ktd rank 0] WARNING: the package's warning after basicConfig" in err
    )
    # Keras' warning from under the patched data adapter, at the user's line.
    assert re.search(
        r"user_mistakes\.py:\d+: UserWarning: `shuffle=True` was passed", err
    ), err
    assert err.count("`shuffle=True` was passed") == 1
    assert "adapter.py" not in err
    assert "rank 1" not in err
    out = result.stdout.splitlines()
    assert out.count("printed by rank 0 only") == 1
    assert sorted(line for line in out if line.startswith("done")) == [
        "done 0",
        "done 1",
    ]


def test_a_missing_script_is_one_line_exit_2(launched):
    result = launched[0]["missing"]
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"ktd run: no script 'no_such_script.py' (looked for "
        f"{os.path.join(launched[1], 'no_such_script.py')}): give the path of "
        "a Python file, e.g. `ktd run -n 2 train.py`."
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
@pytest.mark.parametrize("name", ["cuda", "n gpu"])
def test_a_cuda_request_without_cuda_is_refused(launched, name):
    result = launched[0][name]
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert "asks for CUDA, but CUDA is not available here: torch " in line
    assert "sees 0 CUDA device(s), CUDA_VISIBLE_DEVICES is" in line


def test_a_bad_setting_is_refused_before_launch_and_flagged_by_env(launched):
    result = launched[0]["fsdp"]
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("ktd run: KTD_FSDP_GROUP='big' is not an FSDP group")
    # `ktd env` shows every setting, the bad ones flagged, and does not crash.
    result = launched[0]["env"]
    assert result.returncode == 1, result.stderr
    for name in (
        "KTD_LOG_LEVEL",
        "KTD_FSDP_GROUP",
        "KTD_FAST_OPS",
        "KTD_SPAWN",
    ):
        assert re.search(rf"^  {name} ", result.stdout, flags=re.M), name
    assert result.stdout.count("^ BAD: ") == 2
    assert "^ BAD: KTD_LOG_LEVEL='loud' is not a logging level" in result.stdout
