"""This process in its job: facts, starting nothing.

Whether a process group runs, this process's rank and the number of
processes, the devices it computes on (CUDA, or the CPU under
KTD_DEVICE=cpu), the backend string of the group the package starts, the
group that carries small CPU-tensor collectives, and how long a wait for a
peer may last (KTD_TIMEOUT_SECONDS, see `_env`). Starting the group is
`join`'s (through `rendezvous`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from keras_torch_distribution import _env
from keras_torch_distribution._log import logger

DEFAULT_TIMEOUT_SECONDS = _env.DEFAULT_TIMEOUT_SECONDS

timeout_seconds = _env.timeout_seconds

_DEVICE_TYPES = ("cpu", "gpu")


def is_initialized() -> bool:
    """True when torch.distributed's process group is running."""
    return dist.is_available() and dist.is_initialized()


def uses_cuda() -> bool:
    """True when this process computes on CUDA: CUDA is available and
    KTD_DEVICE=cpu does not ask for CPU processes. Under KTD_DEVICE=cpu,
    Keras' own torch device is made "cpu" too (`keep_keras_on_cpu`), so
    that every tensor Keras makes is one gloo can carry."""
    request = _env.device_request()
    if request == "cpu":
        keep_keras_on_cpu()
        return False
    if request == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"KTD_DEVICE={os.environ.get('KTD_DEVICE')} asks for CUDA, but "
            f"{cuda_found()} Run on a machine with a GPU and a CUDA build of "
            "torch, or unset KTD_DEVICE (or set cpu) to run on CPU processes."
        )
    return torch.cuda.is_available()


def cuda_found() -> str:
    """What this process sees of CUDA, as a sentence: torch's build, the
    visible devices, CUDA_VISIBLE_DEVICES."""
    build = torch.version.cuda
    built = (
        f"torch {torch.__version__} is built with CUDA {build}"
        if build
        else f"torch {torch.__version__} is built without CUDA (a CPU build)"
    )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    count = torch.cuda.device_count() if build else 0
    return (
        f"CUDA is not available here: {built}, it sees {count} CUDA "
        f"device(s), CUDA_VISIBLE_DEVICES is {shown}."
    )


def keep_keras_on_cpu() -> None:
    """Make Keras' torch backend compute on the CPU (KTD_DEVICE=cpu): on a
    CUDA machine Keras otherwise puts every tensor on "cuda", which the
    gloo process group of a KTD_DEVICE=cpu run cannot carry. Refuses a
    KERAS_TORCH_DEVICE that asks for another device."""
    # (Here, not at the top: `ktd run` reads this module's `cuda_found`
    # without importing Keras.)
    from keras_torch_distribution import _keras

    current = str(_keras.default_torch_device())
    if current == "cpu":
        return
    asked = os.environ.get("KERAS_TORCH_DEVICE")
    if asked is not None and asked.strip().lower() != "cpu":
        raise ValueError(
            f"KTD_DEVICE=cpu asks for CPU processes (gloo), but "
            f"KERAS_TORCH_DEVICE={asked!r} makes Keras compute on another "
            "device, whose tensors gloo cannot carry. Unset KERAS_TORCH_DEVICE "
            "(or set it to cpu), or unset KTD_DEVICE to run on CUDA."
        )
    _keras.set_default_torch_device("cpu")
    logger.info(
        "KTD_DEVICE=cpu: Keras' torch device is 'cpu' (it was %r)", current
    )


def _backend():
    return "cpu:gloo,cuda:nccl" if uses_cuda() else "gloo"


def local_device_count() -> int:
    """The accelerators this process could use: the visible CUDA devices,
    or 0 on CPU (and with KTD_DEVICE=cpu)."""
    return torch.cuda.device_count() if uses_cuda() else 0


class CpuGroup:
    """The process group that carries this package's small CPU-tensor
    collectives (ranks agreeing before fit, stopping together, the shared
    shuffle's generator state, object collectives and barriers).

    The world group when it has a CPU backend (the package starts
    "cpu:gloo,cuda:nccl" or "gloo"); for an application's group without
    one (`init_process_group("nccl")` before keras.distribution), a gloo
    group of all ranks made once per world group. A gloo side group rather
    than moving these tensors to the GPU: they are read on the host right
    away (a flag per step under StopTogether), where an NCCL collective
    would make the host wait for every kernel queued before it, and gloo's
    object collectives and barriers need no current CUDA device.
    """

    def __init__(self) -> None:
        # world group -> the group for CPU tensors (why: made once)
        self._groups = {}

    def get(self) -> dist.ProcessGroup:
        """Collective the first time for a world group without a CPU
        backend (it makes a group): call on every rank."""
        world = dist.group.WORLD
        group = self._groups.get(world)
        if group is None:
            self._groups.clear()  # a group of a destroyed world is dead
            group = (
                world
                if carries_cpu_tensors(world)
                else dist.new_group(backend="gloo")
            )
            self._groups[world] = group
        return group

    def clear(self) -> None:
        self._groups.clear()


_cpu_group = CpuGroup()


def cpu_group() -> dist.ProcessGroup:
    """The process group for collectives on CPU tensors (see `CpuGroup`).
    Collective the first time (when it makes a group): call on every rank."""
    return _cpu_group.get()


def carries_cpu_tensors(group: dist.ProcessGroup) -> bool:
    """True when `group` has a backend for CPU tensors."""
    device_types = getattr(group, "_device_types", None)
    if device_types is not None:
        return torch.device("cpu") in device_types
    backend = str(dist.get_backend(group)).lower()
    return backend in ("gloo", "mpi") or "cpu:" in backend


def num_processes() -> int:
    """Return the number of processes for the current distribution setting.

    The number of processes in the running process group (1 when none has
    started), as `jax.process_count()`.

    Returns:
        The world size of the running process group, or 1.
    """
    if is_initialized():
        return dist.get_world_size()
    return 1


def is_multi_process() -> bool:
    """True when this process is one of several in a running process
    group: the test for collectives, barriers and per-rank files."""
    return num_processes() > 1


def process_id() -> int:
    """Return the current process ID for the distribution setting.

    This process's rank in the running process group (0 when none has
    started), as `jax.process_index()`.

    Returns:
        The global rank of this process, or 0.
    """
    if is_initialized():
        return dist.get_rank()
    return 0


def default_device_type() -> str:
    """ "gpu" when this process computes on CUDA, else "cpu"."""
    return "gpu" if uses_cuda() else "cpu"


def _normalize_device_type(device_type):
    if device_type is None:
        return default_device_type()
    kind = str(device_type).lower()
    kind = "gpu" if kind == "cuda" else kind
    if kind not in _DEVICE_TYPES + ("tpu",):
        raise ValueError(
            f"device_type={device_type!r} is not one of 'cpu', 'gpu' or "
            "'tpu' (or None for the default)."
        )
    return kind
