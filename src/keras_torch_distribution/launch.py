"""`ktd run`: start a script on N processes with torch's own launcher.

`ktd run -n 2 train.py --lr 0.1` is `torchrun --nproc-per-node 2 train.py
--lr 0.1` (standalone rendezvous on this machine unless --nnodes or
--rdzv-endpoint say otherwise; every other torchrun option passes through),
plus: KERAS_BACKEND=torch, OMP_NUM_THREADS=1 per process unless set, and the
script runs with this package installed into Keras even if it never imports
it, so an unchanged Keras-on-JAX distribution script runs on torch.
"""

import os
import runpy
import sys

_OWN_OPTIONS = {"-n": "--nproc-per-node", "--nproc": "--nproc-per-node"}


def torchrun_arguments(argv):
    """torch.distributed.run arguments for `ktd run` arguments."""
    arguments = []
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index]
        name, sep, value = option.partition("=")
        name = _OWN_OPTIONS.get(name, name)
        arguments.append(name + (sep + value if sep else ""))
        if not sep and index + 1 < len(argv) and not argv[index + 1].startswith("-") \
                and name not in ("--standalone", "--no-python", "--run-path"):
            arguments.append(argv[index + 1])
            index += 1
        index += 1
    if index >= len(argv):
        raise SystemExit("ktd run: give a script to run, e.g. `ktd run -n 2 train.py`")
    multi_node = any(a.startswith(("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint",
                                   "--master-addr", "--master_addr")) for a in arguments)
    if not multi_node and "--standalone" not in arguments:
        arguments.append("--standalone")
    script, script_args = argv[index], argv[index + 1:]
    return arguments + ["-m", "keras_torch_distribution.launch", script] + script_args


def run(argv):
    os.environ.setdefault("KERAS_BACKEND", "torch")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed import run as torch_run

    torch_run.main(torchrun_arguments(argv))


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
    _run_script(sys.argv[1:])
