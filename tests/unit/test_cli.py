"""The `ktd` parser (keras_torch_distribution_cli): `--help` on every
command (exit 0), `--version`, exit 2 for every usage error, and no heavy
import before a command needs it (`ktd --help` imports neither torch nor
Keras nor keras_torch_distribution)."""

import os
import subprocess
import sys
import time

import pytest

from keras_torch_distribution_cli import main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--help"], ["usage: ktd", "run", "env", "report", "plan"]),
        (["-h"], ["usage: ktd"]),
        (
            ["run", "--help"],
            [
                "usage: ktd run [-n N] [torchrun options] SCRIPT",
                "torchrun --help",
            ],
        ),
        (["run", "-n", "2", "-h"], ["usage: ktd run"]),
        (["env", "--help"], ["usage: ktd env", "every KTD_* setting"]),
        (["report", "-h"], ["usage: ktd report", "CHECKPOINT"]),
        (["plan", "--help"], ["usage: ktd plan", "--world N", "--json PATH"]),
    ],
)
def test_every_command_has_help(argv, words, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("ktd ")


@pytest.mark.parametrize(
    "argv, said",
    [
        ([], "ktd: give a command (run, env, report, plan)"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["env", "extra"], "unrecognized arguments: extra"),
        (["report"], "the following arguments are required: CHECKPOINT"),
        (["plan", "train.py"], "the following arguments are required: --world"),
        (["plan", "--world", "two", "x.py"], "invalid int value: 'two'"),
        (["run"], "ktd run: give a script to run"),
        (["run", "-n", "0", "x.py"], "ktd run: -n 0 is not a number"),
    ],
)
def test_usage_errors_exit_2(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err


def test_a_script_argument_named_help_is_the_scripts():
    from keras_torch_distribution_cli import _asks_run_help

    assert _asks_run_help(["-n", "2", "-h"])
    assert _asks_run_help(["--nnodes", "1", "--help", "x.py"])
    assert not _asks_run_help(["-n", "2", "train.py", "--help"])
    assert not _asks_run_help(["-n", "2", "--standalone", "train.py", "-h"])


def test_help_imports_nothing_heavy_and_is_quick():
    """`ktd --help` and `ktd run --help` in a fresh interpreter: neither
    torch, Keras nor the package is imported; under 1 s on an idle
    machine (asserted under 3 s: this machine may be busy)."""
    code = (
        "import sys; from keras_torch_distribution_cli import main\n"
        "assert main(['--help']) == 0 and main(['run', '--help']) == 0\n"
        "heavy = [m for m in ('torch', 'keras', 'keras_torch_distribution')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = dict(os.environ, KTD_LOG_LEVEL="loud")  # a bad setting: no crash
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert time.perf_counter() - start < 3
