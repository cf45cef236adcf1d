"""Processes and devices: torch.distributed's process group, started once.

Environment variables read here:
- torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT;
- KTD_TIMEOUT_SECONDS: how long a collective or the rendezvous may wait for a
  peer before failing (default 300).
"""

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from keras_torch_distribution.log import logger

DEFAULT_TIMEOUT_SECONDS = 300.0
_DEVICE_TYPES = ("cpu", "gpu")


def timeout_seconds():
    text = os.environ.get("KTD_TIMEOUT_SECONDS")
    if text is None:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"KTD_TIMEOUT_SECONDS={text!r} is not a positive number of "
            "seconds. Set it to e.g. 300, or unset it."
        )
    return value


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def launched_world_size():
    """WORLD_SIZE set by torchrun (or our launcher), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def uses_cuda():
    return torch.cuda.is_available() and os.environ.get("KTD_DEVICE", "") != "cpu"


def _backend():
    return "cpu:gloo,cuda:nccl" if uses_cuda() else "gloo"


def _init_method(job_addresses):
    """torch init_method from Keras' job_addresses ("host:port,..." or a URL)."""
    first = job_addresses.split(",")[0].strip()
    if "://" in first:
        return first
    host, sep, port = first.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"job_addresses={job_addresses!r} is not 'host:port' (the "
            "coordinator, process 0, first) nor an init URL such as "
            "'tcp://host:port' or 'file:///path'."
        )
    return f"tcp://{host}:{port}"


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Start torch.distributed. Idempotent.

    With no arguments, reads torchrun's environment; in a plain `python`
    run it starts a world of one process. Collective: call on every rank.
    """
    if is_initialized():
        _check_matches_running(num_processes, process_id)
        return
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if job_addresses:
        if num_processes is None or process_id is None:
            raise ValueError(
                f"initialize(job_addresses={job_addresses!r}) also needs "
                f"num_processes and process_id (got num_processes="
                f"{num_processes}, process_id={process_id})."
            )
        addresses = [a for a in job_addresses.split(",") if a.strip()]
        if len(addresses) > 1 and len(addresses) != num_processes:
            raise ValueError(
                f"job_addresses lists {len(addresses)} jobs but "
                f"num_processes={num_processes}; give one address per process "
                "or only the coordinator's."
            )
        _check_rank(num_processes, process_id)
        _init_process_group(
            init_method=_init_method(job_addresses),
            world_size=int(num_processes),
            rank=int(process_id),
            timeout=timeout,
        )
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if num_processes is not None and int(num_processes) != world:
            raise ValueError(
                f"initialize(num_processes={num_processes}) but torchrun "
                f"started WORLD_SIZE={world} processes."
            )
        _init_process_group(init_method="env://", timeout=timeout)
    else:
        if num_processes not in (None, 1):
            raise ValueError(
                f"initialize(num_processes={num_processes}) needs "
                "job_addresses='host:port' of process 0, or a launch by "
                "torchrun / `ktd run -n N`, which sets the environment."
            )
        _init_process_group(
            store=dist.HashStore(), world_size=1, rank=0, timeout=timeout
        )
    if uses_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())
                                  % torch.cuda.device_count()))
    from keras_torch_distribution import seeds

    seeds.initialize_rng()
    logger.info(
        "initialized rank %d of %d (%s)",
        dist.get_rank(),
        dist.get_world_size(),
        _backend(),
    )


def _check_rank(num_processes, process_id):
    if int(num_processes) < 1 or not 0 <= int(process_id) < int(num_processes):
        raise ValueError(
            f"process_id={process_id} must be in [0, num_processes="
            f"{num_processes})."
        )


def _check_matches_running(num_processes, process_id):
    world, rank = dist.get_world_size(), dist.get_rank()
    if num_processes is not None and int(num_processes) != world:
        raise ValueError(
            f"initialize(num_processes={num_processes}) but torch.distributed "
            f"already runs {world} processes."
        )
    if process_id is not None and int(process_id) != rank:
        raise ValueError(
            f"initialize(process_id={process_id}) but this process already "
            f"is rank {rank}."
        )


def _shutdown():
    """Leave the process group cleanly at exit (gloo aborts otherwise)."""
    if is_initialized():
        dist.destroy_process_group()


def _init_process_group(**kwargs):
    try:
        dist.init_process_group(backend=_backend(), **kwargs)
        atexit.register(_shutdown)
    except (RuntimeError, ValueError, TimeoutError) as error:
        raise RuntimeError(_start_failure_message(error, kwargs)) from error


def _start_failure_message(error, kwargs):
    """Why the process group did not start, with what was tried and the fix."""
    init_method = kwargs.get("init_method")
    if init_method == "env://":
        init_method = (
            f"env:// (MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')!r})"
        )
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    else:
        rank, world = kwargs.get("rank"), kwargs.get("world_size")
        if init_method is None:
            init_method = "an in-process store (a world of one process)"
    seconds = kwargs["timeout"].total_seconds()
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return (
        f"torch.distributed could not start process {rank} of {world} at "
        f"{init_method} within KTD_TIMEOUT_SECONDS={seconds:g} s: "
        f"{first_line} Check that every process was started with the same "
        "coordinator address (process 0's host:port, reachable from every "
        "process, with the port free on process 0's host) and the same number "
        "of processes, that all of them were started, and raise "
        "KTD_TIMEOUT_SECONDS if peers start slowly."
    )


def ensure_initialized():
    """World size, starting a one-process world when nothing was launched."""
    if not is_initialized():
        if launched_world_size() > 1:
            raise RuntimeError(
                f"This process is one of WORLD_SIZE={launched_world_size()} "
                "processes, but torch.distributed is not initialized yet. "
                "Call keras.distribution.initialize() first, on every process."
            )
        initialize()
    return dist.get_world_size()


def num_processes():
    if is_initialized():
        return dist.get_world_size()
    return 1


def process_id():
    if is_initialized():
        return dist.get_rank()
    return 0


def default_device_type():
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


def list_devices(device_type=None):
    """One device per process, named by global rank: ["cpu:0", "cpu:1", ...]."""
    kind = _normalize_device_type(device_type)
    if kind == "tpu" or (kind == "gpu" and not torch.cuda.is_available()):
        return []
    if not is_initialized() and launched_world_size() > 1:
        raise RuntimeError(
            f"This process is one of WORLD_SIZE={launched_world_size()} "
            "processes, but torch.distributed is not initialized yet, so the "
            "global devices are unknown. Call keras.distribution.initialize() "
            "first, on every process."
        )
    return [f"{kind}:{rank}" for rank in range(num_processes())]


def get_device_count(device_type=None):
    return len(list_devices(device_type))


def torch_device():
    """The torch device this process computes on."""
    if uses_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
