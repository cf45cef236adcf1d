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


_REFUSE = """
import sys
from keras_torch_distribution_cli import main
code = main(sys.argv[1:])
heavy = [m for m in ('torch', 'keras', 'keras_torch_distribution')
         if m in sys.modules]
print(code, heavy)
"""


def _ktd_refusal(tmp_path, *args):
    """`ktd ARGS` in a fresh interpreter under a JAX user's shell: (exit
    status, modules it imported of torch / Keras / the package, stderr
    lines)."""
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run(
        [sys.executable, "-c", _REFUSE, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    code, heavy = done.stdout.split(" ", 1)
    return int(code), heavy.strip(), done.stderr.splitlines()


def test_a_missing_script_a_directory_and_a_syntax_error_are_refused_light(
    tmp_path,
):
    """Issue 48: `ktd run` checks the script before it imports torch (or
    Keras, or the package's front): one line with the fix, exit 2; a
    syntax error is Python's own message once and a last line, exit 1."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "bad.py").write_text("import os\ndef f(:\n    pass\n")
    code, heavy, lines = _ktd_refusal(tmp_path, "run", "-n", "2", "no.py")
    assert (code, heavy, len(lines)) == (2, "[]", 1), lines
    assert lines[0].startswith("ktd run: no script 'no.py' (looked for ")
    assert lines[0].endswith(
        "give the path of a Python file, e.g. `ktd run -n 2 train.py`."
    )
    code, heavy, lines = _ktd_refusal(tmp_path, "run", "-n", "2", "examples")
    assert (code, heavy, len(lines)) == (2, "[]", 1), lines
    assert "'examples' is a directory, not a script" in lines[0]
    code, heavy, lines = _ktd_refusal(tmp_path, "run", "-n", "2", "bad.py")
    assert (code, heavy, len(lines)) == (1, "[]", 5), lines
    assert lines[0] == '  File "bad.py", line 2'
    assert lines[3].startswith("SyntaxError: ")
    assert lines[4] == (
        "ktd run: bad.py does not compile (above); no process was started. "
        "Fix that line, then run it again."
    )


def test_torchrun_flags_are_the_options_of_torchrun_without_a_value():
    """`ktd run` finds the script without importing torch: its list of
    torchrun's flags must be torchrun's (on every torch CI runs)."""
    from torch.distributed import run as torch_run

    from keras_torch_distribution.launch import _torchrun

    flags = set()
    for action in torch_run.get_args_parser()._actions:
        if action.option_strings and action.nargs == 0:
            flags.update(action.option_strings)
    assert flags == set(_torchrun.TORCHRUN_FLAGS)


def test_ktd_and_cli_import_in_one_direction():
    """The parser package imports the package's `cli` (lazily); the
    package never imports the parser (but `python -m keras_torch_distribution`,
    which is `ktd`)."""
    import ast
    import pathlib

    import keras_torch_distribution

    root = pathlib.Path(keras_torch_distribution.__file__).parent
    importers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.startswith("keras_torch_distribution_cli") for n in names):
                importers.append(str(path.relative_to(root)))
    assert importers == ["__main__.py"], importers
