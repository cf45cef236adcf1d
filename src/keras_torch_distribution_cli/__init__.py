"""The `ktd` command's parser: `ktd run`, `ktd env`, `ktd report`, `ktd plan`.

A package of its own, beside `keras_torch_distribution` and above it (that
package never imports this one, but for `python -m keras_torch_distribution`),
so that `ktd --help`, `ktd --version` and every usage error answer without
importing torch, Keras or `keras_torch_distribution` (whose `__init__`
imports both and installs the backend into Keras: 5 s and more). Each
subcommand imports what it needs only once its arguments are parsed; its
work is done in `keras_torch_distribution.cli` (env, report), `.launch`
(run) and `.plan`. `ktd env`, `report` and `plan` run Keras on torch under
any KERAS_BACKEND; `ktd run` never imports Keras: it loads the package's
launch modules without the package's `__init__` (`_light`), and each rank
it starts runs `_rank` first.

Exit status: 0 on success and for `--help`, 2 for a usage error or an
argument refused before anything starts, 130 on Ctrl-C, otherwise the
subcommand's.
"""

import argparse
import os
import sys

from keras_torch_distribution_cli import _light

PROGRAM = "ktd"
_RUN_EPILOG = (
    "Every other option before SCRIPT is torchrun's and passes through "
    "unchanged (see `torchrun --help`), e.g. --nnodes, --rdzv-endpoint, "
    "--max-restarts, --local-ranks-filter 0 (only rank 0's output), --tee 3 "
    "(each rank's output to files as well). One node without rendezvous "
    "options gets --standalone. Settings (KTD_*): `ktd env`."
)


def version():
    """This package's installed version (no import of the package)."""
    from importlib import metadata

    try:
        return metadata.version("keras_torch_distribution")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROGRAM,
        description=(
            "keras.distribution on PyTorch: run a script on N processes, "
            "show this machine's setup, read a sharded checkpoint, or plan "
            "a job's memory and collectives."
        ),
        epilog="`ktd COMMAND --help` shows each command's options.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}"
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True
    )
    run = commands.add_parser(
        "run",
        help="run SCRIPT on N processes (over torchrun)",
        description=(
            "Run SCRIPT on N processes with torchrun, with this package "
            "installed into Keras in each (an unchanged Keras script runs "
            "on torch), KERAS_BACKEND=torch and OMP_NUM_THREADS=1 unless "
            "set. When ranks fail, the first failure is printed once."
        ),
        epilog=_RUN_EPILOG,
        usage="%(prog)s [-n N] [torchrun options] SCRIPT [ARGS ...]",
    )
    run.add_argument(
        "-n",
        "--nproc",
        "--nproc-per-node",
        metavar="N",
        help="processes on this node: a number, or gpu, cpu, xpu, auto",
    )
    run.add_argument("script", metavar="SCRIPT", help="a Python script file")
    run.add_argument(
        "args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments"
    )
    commands.add_parser(
        "env",
        help="versions, devices, settings, and the job initialize() joins",
        description=(
            "Print the versions, devices and every KTD_* setting (bad values "
            "flagged), then what keras.distribution.initialize() would join "
            "here, starting nothing. Exit 1 when a setting or the launcher's "
            "environment is wrong."
        ),
    )
    report = commands.add_parser(
        "report",
        help="each variable's shards in a sharded checkpoint",
        description="Show each variable's blocks and writers in a checkpoint.",
    )
    report.add_argument("checkpoint", metavar="CHECKPOINT")
    plan = commands.add_parser(
        "plan",
        help="per-rank memory and collectives of SCRIPT at N, simulated",
        description=(
            "Run SCRIPT's model building and one step on a simulated world of "
            "N processes on this CPU, and print each rank's memory and the "
            "collectives a step issues."
        ),
    )
    plan.add_argument("--world", metavar="N", required=True, type=int)
    plan.add_argument(
        "--json",
        metavar="PATH",
        help="also write the plan as JSON to PATH, or - for stdout",
    )
    plan.add_argument(
        "--step",
        choices=("fake", "real", "no"),
        help="how the training step is simulated",
    )
    plan.add_argument("script", metavar="SCRIPT")
    plan.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER)
    return parser


def _asks_run_help(rest):
    """True when -h/--help comes before `ktd run`'s script (after it, the
    script's own arguments)."""
    previous = None
    for token in rest:
        if token in ("-h", "--help"):
            return True
        if not token.startswith("-"):
            value_of_option = (
                previous is not None
                and previous.startswith("-")
                and "=" not in previous
                and not token.endswith(".py")
            )
            if not value_of_option:
                return False
        previous = token
    return False


def main(argv=None):
    """The `ktd` command on `argv`; its exit status. Without `argv` (the
    `ktd` program itself: `sys.argv[1:]`), `ktd run` ends the process as
    soon as torchrun returns (`_end_now`)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_usage(sys.stderr)
        print(
            f"{PROGRAM}: give a command (run, env, report, plan); "
            f"`{PROGRAM} --help` says more.",
            file=sys.stderr,
        )
        return 2
    try:
        if argv[0] == "run" and not _asks_run_help(argv[1:]):
            # torchrun's options pass through: argparse only answers --help
            # (a missing script is `run`'s own one-line error).
            code = _run(argv[1:])
            return _end_now(code) if program else code
        try:
            parsed = parser.parse_args(argv)
        except SystemExit as stop:  # --help, --version, usage errors
            return stop.code if isinstance(stop.code, int) else 2
        shell_backend = _keras_on_torch()
        if parsed.command == "env":
            from keras_torch_distribution import cli

            return cli.print_env(shell_backend)
        if parsed.command == "report":
            from keras_torch_distribution import cli

            return cli.report(parsed.checkpoint)
        if shell_backend not in (None, "torch"):
            with _light.package_without_keras():
                from keras_torch_distribution.launch import _torchrun

                note = _torchrun.backend_note(shell_backend, "the script")
            print(note, file=sys.stderr)
        from keras_torch_distribution.plan import _command as plan_command

        return plan_command.plan_and_print(
            parsed.world,
            parsed.script,
            parsed.args,
            parsed.step or "auto",
            parsed.json,
        )
    except KeyboardInterrupt:
        print(f"{PROGRAM}: interrupted (Ctrl-C).", file=sys.stderr)
        return 130


def _keras_on_torch():
    """KERAS_BACKEND=torch in this process, before anything imports Keras
    (`ktd env`, `report` and `plan` import the package, which runs Keras on
    torch only); the shell's KERAS_BACKEND, or None."""
    said = os.environ.get("KERAS_BACKEND", "").strip() or None
    os.environ["KERAS_BACKEND"] = "torch"
    return said


def _run(rest):
    if not rest:  # said before torch is imported
        print(
            "ktd run: give a script to run, e.g. `ktd run -n 2 train.py` "
            "(`ktd run --help` says more)",
            file=sys.stderr,
        )
        return 2
    return _launch(rest)


def _launch(rest):
    """`_torchrun.run(rest)`, its modules loaded without the package's
    front (which imports Keras): `ktd run` checks and starts torchrun; the
    ranks import Keras. Its exit status."""
    with _light.package_without_keras():
        from keras_torch_distribution.launch import _torchrun

        try:
            _torchrun.run(rest)
        except (
            _torchrun.Failed,
            _torchrun.Signalled,
            _torchrun.Refused,
        ) as stopped:
            print(stopped.message, file=sys.stderr)
            return stopped.code
    return 0


def _end_now(code):
    """End the `ktd run` process with `code`, its output flushed, without
    the interpreter's teardown: once torchrun has returned there is nothing
    left to do, and tearing down torch's modules and the agent's store
    takes 0.5 to 2 s, after the ranks are gone (Ctrl-C included)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
