"""The `ktd` command: `ktd run -n N script.py [args]`, `ktd env`, `ktd
report`, `ktd plan`."""

from __future__ import annotations

import os
import platform
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

USAGE = (
    "usage:\n"
    "  ktd run -n N [torchrun options] SCRIPT [ARGS]"
    "   run SCRIPT on N processes\n"
    "  ktd env                                        "
    " versions, devices, settings, and the\n"
    "                                                 "
    " job initialize() would join here\n"
    "  ktd report CHECKPOINT                          "
    " each variable's shards in a checkpoint\n"
    "  ktd plan --world N [--json PATH] SCRIPT [ARGS] "
    " per-rank memory, collectives\n"
    "                                                 "
    " of SCRIPT at N, simulated\n"
)


def print_env() -> int:
    """Print the versions, devices and settings, then what initialize()
    would do here (`print_launch`); its exit status."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import torch

    import keras_torch_distribution

    lines = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "keras_torch_distribution": keras_torch_distribution.__version__,
        "supported keras": keras_torch_distribution.SUPPORTED_KERAS_TEXT,
        "cuda available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))
        if torch.cuda.is_available()
        else None,
        "gpu count": torch.cuda.device_count(),
        "gloo available": torch.distributed.is_gloo_available(),
    }
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "KERAS_BACKEND",
        "KTD_TIMEOUT_SECONDS",
        "KTD_DEVICE",
        "KTD_CLUSTER",
        "KTD_SPAWN",
        "KTD_MAX_RESTARTS",
        "KTD_PREEMPTION_SIGNALS",
        "KTD_PREEMPTION_WAIT",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
    ):
        lines[key] = os.environ.get(key)
    lines.update(_host_lines())
    for key, value in lines.items():
        print(f"{key:26} {value}")
    return print_launch()


def _host_lines():
    """This host's name and the address gloo gives its peers for it (a
    loopback one is right on one host only: see _processes.interfaces)."""
    import socket

    from keras_torch_distribution._processes import interfaces

    hostname = socket.gethostname()
    address = interfaces.gloo_address(hostname)
    if interfaces.is_loopback(address):
        address = (
            f"{address} (loopback: across hosts the package picks an interface)"
        )
    return {"host name": hostname, "gloo address": address}


def print_launch() -> int:
    """What keras.distribution.initialize() would do in this process (which
    launcher, address, port, world, rank, local rank), starting nothing.
    1 when the environment is incomplete (the error is printed)."""
    from keras_torch_distribution._processes import join

    print("\ninitialize() here:")
    try:
        launch = join.detect_launch()
    except (ValueError, RuntimeError) as error:
        print(f"  error: {error}")
        return 1
    for key, value in launch.describe().items():
        print(f"  {key:24} {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The `ktd` command on `argv` (default: `sys.argv[1:]`); its exit
    status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from keras_torch_distribution.launch import _torchrun

        try:
            _torchrun.run(rest)
        except _torchrun.Signalled as stopped:
            print(stopped.message, file=sys.stderr)
            return stopped.code
        return 0
    if command == "env":
        return print_env()
    if command == "plan":
        from keras_torch_distribution.plan import _command as plan_command

        status, text = plan_command.run(rest)
        print(text, file=sys.stderr if status else sys.stdout)
        return status
    if command == "report":
        if len(rest) != 1:
            print(
                f"ktd report: give one checkpoint directory\n{USAGE}",
                file=sys.stderr,
            )
            return 2
        from keras_torch_distribution._report import checkpoint_table
        from keras_torch_distribution._report import format_checkpoint_table
        from keras_torch_distribution.checkpoint import NotACheckpointError

        try:
            print(format_checkpoint_table(checkpoint_table(rest[0])))
        except NotACheckpointError as error:
            print(f"ktd report: {error}", file=sys.stderr)
            return 2
        return 0
    print(f"ktd: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
