"""`ktd plan --world N [--json PATH|-] [--step fake|real|no] SCRIPT
[ARGS]`.

`main(argv)` is the whole command: it prints and returns the exit status.
`plan_and_print(...)` is the same on arguments already parsed (the CLI's
parser calls it). `run(argv)` is the older form: (status, text).
"""

import contextlib
import os
import sys
import time

USAGE = (
    "usage: ktd plan --world N [--json PATH|-] [--step fake|real|no] "
    "SCRIPT [ARGS]"
)
# The JSON's layout: a reader checks it (`_output` lists the fields).
FORMAT_VERSION = 1


def parse(argv):
    """(options, script, script args); a ValueError names a bad argument."""
    options = {"world": None, "json": None, "step": "auto"}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, _, value = argv[i][2:].partition("=")
        if name not in options:
            raise ValueError(
                f"ktd plan: unknown option --{name}: expected --world, "
                f"--json or --step before the script.\n{USAGE}"
            )
        if not value:
            if i + 1 >= len(argv):
                raise ValueError(f"ktd plan: --{name} needs a value.\n{USAGE}")
            value = argv[i + 1]
            i += 1
        options[name] = value
        i += 1
    if options["world"] is None:
        raise ValueError(
            f"ktd plan: give the world size to plan for: --world N.\n{USAGE}"
        )
    if i >= len(argv):
        raise ValueError(f"ktd plan: give the script to plan.\n{USAGE}")
    return options, argv[i], argv[i + 1 :]


def check_json_path(path):
    """A ValueError naming `path` where the JSON could not be written
    there: checked before planning, which can take minutes. "-" is
    stdout."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    problem = None
    if os.path.isdir(path):
        problem = "is a folder"
    elif not os.path.isdir(folder):
        problem = f"is in a folder that does not exist ({folder})"
    elif not os.access(folder, os.W_OK) or (
        os.path.exists(path) and not os.access(path, os.W_OK)
    ):
        problem = "cannot be written"
    if problem:
        raise ValueError(
            f"ktd plan: --json {path!r} {problem}: give a file path in an "
            "existing, writable folder, or --json - for stdout."
        )


def stderr_progress():
    """A progress printer: one line per phase on stderr, with the seconds
    since it was made."""
    started = time.perf_counter()

    def progress(text):
        elapsed = time.perf_counter() - started
        print(
            f"ktd plan [{elapsed:5.1f} s] {text}", file=sys.stderr, flush=True
        )

    return progress


@contextlib.contextmanager
def _stdout_to_stderr():
    """Within the block, whatever writes to stdout (the script's prints,
    Keras', native code's) goes to stderr: stdout carries the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def make_plan(
    world, script, args=(), step="auto", json_path=None, progress=None
):
    """The plan's dict, its JSON written to `json_path` ("-": stdout, the
    script's own prints kept off it). A ValueError or `PlanError` says
    what is wrong; the path is checked before planning. `progress(text)`
    hears each phase (default: `stderr_progress()`)."""
    from keras_torch_distribution.plan import _world

    world = _world.check_world(world)
    check_json_path(json_path)
    os.environ.setdefault("KERAS_BACKEND", "torch")
    from keras_torch_distribution.plan import _output
    from keras_torch_distribution.plan import _runner

    progress = progress or stderr_progress()
    quiet = (
        _stdout_to_stderr() if json_path == "-" else contextlib.nullcontext()
    )
    with quiet:
        plan = _runner.plan(world, script, args, step=step, progress=progress)
    plan = {"format_version": FORMAT_VERSION, **plan}
    if json_path:
        _output.write_json(plan, json_path)
    return plan


def plan_and_print(world, script, args=(), step="auto", json_path=None):
    """`ktd plan` on parsed arguments: the text plan on stdout (on stderr
    with --json -, whose JSON is stdout's), progress and errors on
    stderr; the exit status (2: the error printed)."""
    from keras_torch_distribution.plan import _runner

    try:
        plan = make_plan(world, script, args, step, json_path)
    except (_runner.PlanError, ValueError) as error:
        print(str(error), file=sys.stderr)
        return 2
    from keras_torch_distribution.plan import _output

    text = _output.format_text(plan)
    print(text, file=sys.stderr if json_path == "-" else sys.stdout)
    return 0


def main(argv):
    """`ktd plan ARGV`: prints, and returns the exit status."""
    try:
        options, script, args = parse(argv)
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    return plan_and_print(
        options["world"], script, args, options["step"], options["json"]
    )
