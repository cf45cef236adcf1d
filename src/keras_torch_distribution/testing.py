"""Run functions on N local processes (gloo, CPU) for tests, and count the
ops a step dispatches.

    with ProcessGroupPool(2) as pool:
        results = pool.run(my_module_level_function, arg1, arg2)

Each worker process starts once (importing torch and Keras costs seconds),
joins a file-based rendezvous (no fixed ports) and then runs any number of
module-level functions; `run` returns each rank's result, in rank order. A
rank that raises makes `run` raise `WorkerError` with that rank's traceback;
ranks that do not answer within `timeout` seconds are killed and
`TimeoutError` names them.

`count_ops()` counts, in a block, the aten ops dispatched and among them
the ones that make the host wait for a GPU (`OpCounts.syncs`): exact
counts, the same on every machine, so that a CPU test can assert what a
GPU step would do. The calling process gets no process group and no
environment variable from the workers. Each worker gets LOCAL_RANK=<its
rank> (all run on one host), unless `env` sets LOCAL_RANK: on a GPU
machine (a `env` that drops KTD_DEVICE / CUDA_VISIBLE_DEVICES) each then
computes on its own GPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from typing import TYPE_CHECKING
from typing import Any

from keras_torch_distribution._processes.spawn import PARENT_PID_VARIABLE

# Ops that make the host wait for the device when their operand lives on a
# GPU: a value read on the host (`float(t)`, `if t:`, `t.item()`, a
# data-dependent shape), and host data made a tensor (`lift_fresh`: on CUDA
# a copy from pageable host memory). On the CPU they cost nothing, which is
# why a CPU run counts them instead of timing them.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "nonzero",
        "equal",
        "_assert_async",
        "lift_fresh",
    }
)
# Host reads that dispatch no aten op on the CPU (`np.array(t)`,
# `t.tolist()`): counted by wrapping these `torch.Tensor` methods.
HOST_READS = ("numpy", "tolist")
# Ops that only make views (no kernel on a GPU).
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "reshape",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "slice",
        "select",
        "alias",
        "as_strided",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "unflatten",
        "view_as_real",
        "view_as_complex",
        "movedim",
        "diagonal",
        "narrow",
    }
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from collections.abc import Iterator
    from collections.abc import Mapping

WORKER_ENV = {
    "KERAS_BACKEND": "torch",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "KTD_DEVICE": "cpu",
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONWARNINGS": "ignore",
}


class WorkerError(RuntimeError):
    """A function raised on one of the worker ranks."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} raised:\n{remote_traceback}")


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set environment variables (None unsets one) for the block, then
    restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker(rank, world_size, rendezvous, initialize, connection):
    """Worker loop: initialize, then run each function received. Dies with
    the process that started the pool (a killed pytest leaves none behind)."""
    import keras

    from keras_torch_distribution.launch.__main__ import die_with_parent

    die_with_parent()

    try:
        if initialize:
            keras.distribution.initialize(
                job_addresses=f"file://{rendezvous}",
                num_processes=world_size,
                process_id=rank,
            )
        connection.send(("ready", None))
    except BaseException:  # reported to the parent, which raises it
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        message = connection.recv()
        if message is None:
            break
        function, args, kwargs = message
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
        try:
            result = function(*args, **kwargs)
        except BaseException:  # reported to the parent, which raises it
            connection.send(("error", traceback.format_exc()))
            continue
        connection.send(("ok", result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupPool:
    """N worker processes that form one torch.distributed world."""

    def __init__(
        self,
        world_size: int = 2,
        timeout: float = 120.0,
        initialize: bool = True,
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._directory = tempfile.mkdtemp(prefix="ktd-pool-")
        self._processes = []
        self._connections = []
        self.env = dict(WORKER_ENV, **(env or {}))
        self.env[PARENT_PID_VARIABLE] = str(os.getpid())
        context = multiprocessing.get_context("spawn")
        rendezvous = os.path.join(self._directory, "rendezvous")
        with environment(self.env):
            for rank in range(world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=_worker,
                    args=(rank, world_size, rendezvous, initialize, child_end),
                    daemon=True,
                )
                local = (
                    {}
                    if "LOCAL_RANK" in self.env
                    else {"LOCAL_RANK": str(rank)}
                )
                with environment(local):
                    process.start()
                child_end.close()
                self._processes.append(process)
                self._connections.append(parent_end)
        self._collect(self.timeout + 60.0)

    @property
    def alive(self) -> bool:
        """True while every worker process runs."""
        return bool(self._processes) and all(
            p.is_alive() for p in self._processes
        )

    def run(
        self,
        function: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """`function(*args, **kwargs)` on every rank; results in rank order."""
        if not self.alive:
            raise RuntimeError("the process pool was closed after a failure")
        for connection in self._connections:
            connection.send((function, args, kwargs))
        return self._collect(timeout or self.timeout)

    def _collect(self, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            for rank in sorted(pending):
                connection = self._connections[rank]
                if not connection.poll(0.05):
                    if not self._processes[rank].is_alive():
                        self.close(kill=True)
                        raise WorkerError(
                            rank,
                            "process exited with code "
                            f"{self._processes[rank].exitcode}",
                        )
                    continue
                try:
                    status, value = connection.recv()
                except EOFError:  # the worker died (e.g. while starting up)
                    self._processes[rank].join(timeout=5)
                    code = self._processes[rank].exitcode
                    self.close(kill=True)
                    raise WorkerError(
                        rank,
                        f"process closed its pipe and exited with code {code} "
                        "before answering; see its output above",
                    ) from None
                if status == "error":
                    self.close(kill=True)
                    raise WorkerError(rank, value)
                results[rank] = value
                pending.discard(rank)
            if pending and time.monotonic() > deadline:
                self.close(kill=True)
                raise TimeoutError(
                    f"ranks {sorted(pending)} did not answer within "
                    f"{timeout:.0f} s"
                )
        return results

    def close(self, kill: bool = False) -> None:
        """Stop the workers (killing any that hang) and remove the files."""
        for connection, process in zip(self._connections, self._processes):
            if kill and process.is_alive():
                process.kill()
            elif process.is_alive():
                try:
                    connection.send(None)
                except (BrokenPipeError, OSError):
                    process.kill()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        for connection in self._connections:
            connection.close()
        self._processes, self._connections = [], []
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> ProcessGroupPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run(
    function: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run `function` once on `world_size` fresh processes."""
    with ProcessGroupPool(world_size, timeout=timeout) as pool:
        return pool.run(function, *args, **kwargs)


@dataclasses.dataclass
class OpCounts:
    """What `count_ops()` saw: aten op name -> times dispatched, and the
    host reads (`HOST_READS`) by method name."""

    ops: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )
    host_reads: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )
    # (op or host read, "file:line" of the innermost frame outside torch's
    # dispatch machinery) -> times: where each sync was issued.
    sync_sources: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        """Ops that are not views: about the kernels a GPU would run."""
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)

    @property
    def syncs(self) -> dict[str, int]:
        """The ops and host reads that would make the host wait for a GPU,
        by name (empty when there were none)."""
        found = {op: n for op, n in self.ops.items() if op in SYNC_OPS}
        found.update(self.host_reads)
        return found


@contextlib.contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count the aten ops dispatched in the block (a `TorchDispatchMode`)
    and the tensors read on the host; yields the `OpCounts`, filled when
    the block ends."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = OpCounts()

    class _Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts.ops[func._opname] += 1
            if func._opname in SYNC_OPS:
                counts.sync_sources[(func._opname, _issuer())] += 1
            return func(*args, **(kwargs or {}))

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    own = {name for name in HOST_READS if name in vars(torch.Tensor)}

    def counted(name):
        method = saved[name]

        def read(tensor, *args, **kwargs):
            counts.host_reads[name] += 1
            counts.sync_sources[(name, _issuer())] += 1
            return method(tensor, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _Counting():
            yield counts
    finally:
        for name, method in saved.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)


# Frames of torch's dispatch machinery and of the counting itself, skipped
# when naming where a sync was issued.
_MACHINERY = (
    os.path.join("torch", "utils", "_python_dispatch.py"),
    os.path.join("torch", "_ops.py"),
    os.path.join("torch", "_tensor.py"),
    os.path.join("torch", "_compile.py"),
    os.path.join("torch", "_dynamo", "eval_frame.py"),
    os.path.join("torch", "_jit_internal.py"),
    os.path.join("torch", "utils", "_contextlib.py"),
    __file__,
)


def _issuer() -> str:
    """ "path:line" of the innermost frame outside the dispatch machinery,
    the path from its `site-packages` (or the package) on."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.endswith(_MACHINERY):
            path = frame.filename.replace(os.sep, "/")
            for marker in ("site-packages/", "src/"):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            return f"{path}:{frame.lineno}"
    return "?"
