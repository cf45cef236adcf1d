"""`ktd run`: start a script on N processes with torch's own launcher.

`ktd run -n 2 train.py --lr 0.1` is `torchrun --nproc-per-node 2 train.py
--lr 0.1` (standalone rendezvous on this machine unless --nnodes or
--rdzv-endpoint say otherwise; every other torchrun option passes through),
plus: KERAS_BACKEND=torch, OMP_NUM_THREADS=1 per process unless set, and the
script runs with this package installed into Keras even if it never imports
it, so an unchanged Keras-on-JAX distribution script runs on torch.

When a rank fails, torchrun stops the others and `ktd run` exits non-zero
with a last line naming the rank that failed first and its exception.
"""

import os
import runpy
import sys

_OWN_OPTIONS = {"-n": "--nproc-per-node", "--nproc": "--nproc-per-node"}
# Options that tell torchrun where the other nodes are: with any of them (or
# more than one node), `ktd run` does not add --standalone.
_RENDEZVOUS_OPTIONS = (
    "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend",
    "--rdzv-id", "--rdzv_id", "--master-addr", "--master_addr",
    "--master-port", "--master_port",
)
# torchrun options that change what is run: `ktd run` always runs a script
# file through keras_torch_distribution.launch, so they cannot be combined.
_UNSUPPORTED_OPTIONS = ("-m", "--module", "--no-python", "--no_python",
                        "--run-path", "--run_path")


def _flag_options():
    """torchrun options that take no value (from torchrun's own parser)."""
    from torch.distributed import run as torch_run

    flags = set()
    for action in torch_run.get_args_parser()._actions:
        if action.option_strings and action.nargs == 0:
            flags.update(action.option_strings)
    return flags


def torchrun_arguments(argv):
    """torch.distributed.run arguments for `ktd run` arguments.

    `-n N` is `--nproc-per-node N`; every other option before the script is
    torchrun's and passes through unchanged. One node (no rendezvous option,
    `--nnodes` absent or 1) gets `--standalone`, a private rendezvous on a
    free port; otherwise torchrun's rendezvous options decide, e.g.
    `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint host:port`.
    """
    flags = _flag_options()
    arguments = []
    nnodes = "1"
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index]
        name, sep, value = option.partition("=")
        name = _OWN_OPTIONS.get(name, name)
        if name in _UNSUPPORTED_OPTIONS:
            raise SystemExit(
                f"ktd run: torchrun's {name} is not supported: `ktd run` runs a "
                "Python script file with the backend installed, e.g. `ktd run "
                "-n 2 train.py`. Use torchrun directly for modules or "
                "non-Python programs (and `import keras_torch_distribution` "
                "in them)."
            )
        if not sep and name not in flags:
            if index + 1 >= len(argv):
                raise SystemExit(
                    f"ktd run: option {name} needs a value, e.g. "
                    "`ktd run -n 2 train.py`."
                )
            value = argv[index + 1]
            arguments.extend([name, value])
            index += 2
        else:
            arguments.append(name + (sep + value if sep else ""))
            index += 1
        if name == "--nnodes":
            nnodes = value
    if index >= len(argv):
        raise SystemExit("ktd run: give a script to run, e.g. `ktd run -n 2 train.py`")
    multi_node = nnodes not in ("1", "1:1") or any(
        a.split("=")[0] in _RENDEZVOUS_OPTIONS for a in arguments
    )
    if not multi_node and "--standalone" not in arguments:
        arguments.append("--standalone")
    script, script_args = argv[index], argv[index + 1:]
    return arguments + ["-m", "keras_torch_distribution.launch", script] + script_args


def run(argv):
    os.environ.setdefault("KERAS_BACKEND", "torch")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    arguments = torchrun_arguments(argv)
    try:
        torch_run.main(arguments)
    except ChildFailedError as error:
        # torchrun stopped every other process when this one failed; say
        # which rank failed first, without the launcher's own traceback.
        rank, failure = error.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # read from the rank's error file
            message = message.get("message", "")
        lines = [line.strip() for line in str(message).splitlines() if line.strip()]
        cause = f": {lines[-1]}" if lines else ""
        raise SystemExit(
            f"{error}\nktd run: rank {rank} (local rank {failure.local_rank}) "
            f"failed first, exit code {failure.exitcode}{cause}. torchrun "
            "stopped the other processes; that rank's traceback is above. If "
            "a rank hangs instead, KTD_TIMEOUT_SECONDS bounds how long "
            "collectives wait for it."
        ) from None


def _run_script(argv):
    """Inside each process: install the backend, then run the script."""
    if not argv:
        raise SystemExit("usage: python -m keras_torch_distribution.launch SCRIPT [ARGS]")
    import keras_torch_distribution  # noqa: F401  (installs into Keras)

    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: a failing rank writes its error where torchrun's failure
    # summary shows it, so the summary names the exception, not only "rank 1".
    record(_run_script)(sys.argv[1:])
