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

import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from typing import TYPE_CHECKING
from typing import Any

from keras_torch_distribution._op_counts import HOST_READS  # noqa: F401
from keras_torch_distribution._op_counts import SYNC_OPS  # noqa: F401
from keras_torch_distribution._op_counts import VIEW_OPS  # noqa: F401
from keras_torch_distribution._op_counts import OpCounts  # noqa: F401
from keras_torch_distribution._op_counts import count_ops  # noqa: F401
from keras_torch_distribution._processes.spawn import PARENT_PID_VARIABLE

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
