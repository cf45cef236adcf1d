"""What `ktd env` and `ktd report` do. The `ktd` command's parser is
`keras_torch_distribution_cli` (a package of its own, so that `ktd --help`
and `ktd run` import neither torch nor Keras), which calls these: this
module never imports it."""

from __future__ import annotations

import os
import platform
import sys


def print_env(shell_backend=None) -> int:
    """Print the versions, devices and settings, then what initialize()
    would do here (`print_launch`); its exit status. `shell_backend`: the
    KERAS_BACKEND the shell gave `ktd`, which runs Keras on torch itself."""
    if shell_backend is None:
        shell_backend = os.environ.get("KERAS_BACKEND")
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import torch

    import keras_torch_distribution

    lines = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "keras_hub": _installed_version("keras-hub"),
        "keras_torch_distribution": keras_torch_distribution.__version__,
        "supported keras": keras_torch_distribution.SUPPORTED_KERAS_TEXT,
        "KERAS_BACKEND": _backend_shown(shell_backend),
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
        *_KERAS_DISTRIBUTION_VARIABLES,
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
    ):
        lines[key] = os.environ.get(key)
    lines.update(_host_lines())
    width = max(map(len, lines)) + 1
    for key, value in lines.items():
        print(f"{key:{width}} {value}")
    bad = print_settings()
    return print_launch() or bad


# What keras.distribution.initialize() reads before any launcher's variables.
_KERAS_DISTRIBUTION_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


def _installed_version(distribution):
    """An installed distribution's version, read without importing it."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _backend_shown(shell_backend):
    """The shell's KERAS_BACKEND, with a note where it is not torch."""
    if not shell_backend:
        return "unset (ktd and the package use torch)"
    if shell_backend == "torch":
        return "torch"
    return (
        f"{shell_backend} (note: ktd, and the ranks of `ktd run`, run Keras "
        "on torch, the backend keras_torch_distribution distributes)"
    )


def setting_rows():
    """(name, shown value, error or None) for every KTD_* setting that
    docs/launching.md lists: its value, or "(default: ...)" when unset."""
    from keras_torch_distribution import _env
    from keras_torch_distribution._processes import environments
    from keras_torch_distribution._processes import record

    errors = dict(_env.setting_errors())
    try:
        record.spawn_setting(os.environ)
    except ValueError as error:
        errors["KTD_SPAWN"] = str(error)
    cluster = os.environ.get("KTD_CLUSTER", "").strip().lower()
    names = [name for name, _ in environments.ROWS]
    if cluster and cluster != "none" and cluster not in names:
        errors["KTD_CLUSTER"] = (
            f"KTD_CLUSTER={os.environ['KTD_CLUSTER']!r} names no environment: "
            f"set one of {', '.join(names)}, or none (no detection), or unset "
            "it (detect)."
        )
    defaults = [(name, default) for name, default, _ in _env.SETTINGS]
    defaults += [
        ("KTD_CLUSTER", "detect"),
        ("KTD_SPAWN", "one process per local GPU"),
    ]
    rows = []
    for name, default in defaults:
        value = os.environ.get(name)
        shown = f"(default: {default})" if value is None else value
        rows.append((name, shown, errors.get(name)))
    return rows


def print_settings() -> int:
    """Print every KTD_* setting, each bad one flagged with its fix, and
    the KTD_* variables that are no setting but look like one; 1 when a
    setting is bad."""
    from keras_torch_distribution import _env

    print("\nsettings:")
    bad = 0
    for name, shown, error in setting_rows():
        print(f"  {name:24} {shown}")
        if error:
            print(f"  {'':24} ^ BAD: {error}")
            bad = 1
    for name, meant in _env.misspelled():
        print(f"  {name:24} {os.environ[name]}")
        print(
            f"  {'':24} ^ UNKNOWN: no such setting, ignored; did you mean "
            f"{meant}?"
        )
    return bad


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


def report(path) -> int:
    """`ktd report CHECKPOINT`: each variable's shards; 2 (after the error)
    when `path` is no checkpoint."""
    from keras_torch_distribution._report import checkpoint_table
    from keras_torch_distribution._report import format_checkpoint_table
    from keras_torch_distribution.checkpoint import NotACheckpointError

    try:
        print(format_checkpoint_table(checkpoint_table(path)))
    except NotACheckpointError as error:
        print(f"ktd report: {error}", file=sys.stderr)
        return 2
    return 0
