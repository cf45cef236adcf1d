"""Helpers shared by several test files: test files import from here, never
from one another.

`tests/` is on sys.path (tests/conftest.py puts it there), so test modules
import this one as `helpers`, and so do the pool's worker processes (spawned
workers get the parent's sys.path) when they unpickle a function defined
here. A script run in a subprocess puts `TESTS` on its own sys.path first.
Functions that run on the ranks import keras / torch inside.
"""

import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import zlib

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(
    TESTS
)  # the repository: the working directory of launches
# What torchrun sets for each rank (tests clear them, or check none leaks).
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class LogRecords(logging.Handler):
    """The package logger's messages on this rank, while attached (rank 0
    only speaks): `messages`, formatted."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def data(rows=64, features=6, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = rng.normal(size=(rows, outputs)).astype("float32")
    return x, y


def max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
        for p, q in zip(a, b)
    )


def job_env(keep_backend=False, **extra):
    """The environment of a job a test launches (`ktd run`, torchrun): one
    thread per process, CPU, no rank or rendezvous variables of an outer
    launcher; KERAS_BACKEND left out unless `keep_backend`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu")
    env.update(extra)
    if not keep_backend:
        env.pop("KERAS_BACKEND", None)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    return env


def each_case(names, run):
    """{name: run(name)} for each of `names`, each in a fresh Keras session
    with no distribution set first; a case that raises gives ("error", its
    type and message, its traceback) and the others go on (a pool call
    reports every failing case by name)."""
    import traceback

    import keras

    results = {}
    for name in names:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
        try:
            results[name] = run(name)
        except Exception as error:  # reported by name, the others go on
            results[name] = (
                "error",
                f"{type(error).__name__}: {error}",
                traceback.format_exc(),
            )
    keras.distribution.set_distribution(None)
    return results


# How long a pool waits for its ranks to answer one `run` before it names
# them and kills the pool: a bound for a hang, not a speed. A compiled step
# (inductor building C++ on the CPU) took over 180 s on a loaded 2-core
# machine (tools/flakes, issue 49).
POOL_TIMEOUT_S = 600

_PORT_CHOICE = random.SystemRandom()


def _ephemeral_ports():
    """The kernel's range for ports it picks itself (outgoing connections,
    bind to port 0): (low, high), Linux's default when unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            low, high = (int(part) for part in file.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A TCP port on 127.0.0.1, free now, below the kernel's ephemeral range.

    A port the kernel picked (bind to port 0) and let go of is in the range
    it hands out next to every outgoing connection (gloo's, the TCP
    store's clients'), so one of them could take it before the test's
    process listens there; below that range only another test picking at
    random could (one chance in thousands)."""
    low, _ = _ephemeral_ports()
    candidates = range(10000, low) if low > 11000 else ()
    for _ in range(100):
        # Not the `random` module's state: tests seed it (Keras' seeds do).
        port = _PORT_CHOICE.choice(candidates) if candidates else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free port below the ephemeral range in 100 tries")


def node_args(node, endpoint, run_id, nnodes=2, nproc=1):
    """`ktd run` options that make this launch node `node` of `nnodes`
    (`nproc` processes each) meeting at the c10d rendezvous `endpoint`."""
    return (
        f"--nnodes {nnodes} --node-rank {node} --rdzv-backend c10d "
        f"--rdzv-endpoint {endpoint} --rdzv-id {run_id} -n {nproc}"
    ).split()


# The c10d rendezvous of the elastic tests (e2e/test_elastic_shrink.py,
# hosts/test_hosts.py): a dead node is dropped after 2 missed 1 s
# heartbeats, and a round with the minimum of nodes closes after 5 s.
SHRINK_RDZV_CONF = (
    "join_timeout=60,last_call_timeout=5,close_timeout=10,"
    "keep_alive_interval=1,keep_alive_max_attempt=2"
)


def shrink_command(endpoint, rdzv_id, rdzv_conf, *script_args):
    """`ktd run` of tests/scripts/shrink_fit.py as one node of an elastic
    job (`--nnodes 1:2`, 2 processes, one restart) at `endpoint`."""
    return [
        sys.executable,
        "-m",
        "keras_torch_distribution",
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        rdzv_conf,
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        os.path.join(TESTS, "scripts", "shrink_fit.py"),
        *map(str, script_args),
    ]


def finish(process, timeout):
    """CompletedProcess of `process`, started in a session of its own
    (start_new_session=True); on timeout that session is killed and the
    test fails with the output so far."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session the test started
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{process.args} did not finish within {timeout} s:\n"
            f"{stdout[-2000:]}\n"
            f"{stderr[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(
        process.args, process.returncode, stdout, stderr
    )


def finish_all(processes, timeout):
    """`finish` for launches that run together (the nodes of one job):
    their CompletedProcesses; if one fails to finish, the sessions of all
    those still running are killed before the test fails."""
    try:
        return [finish(process, timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()


# ---------------------------------------------------------------------------
# Errors raised on the ranks, returned to the pytest process
# ---------------------------------------------------------------------------


def error_of(function, *args, **kwargs):
    """(type name, message) of what `function` raised, or None."""
    try:
        function(*args, **kwargs)
    except (ValueError, RuntimeError, TypeError) as error:
        return type(error).__name__, str(error)
    return None


def assert_error(found, kind, pattern):
    assert found is not None, (
        f"expected {kind} matching {pattern!r}, nothing raised"
    )
    assert found[0] == kind, found
    assert re.search(pattern, found[1], re.S), found[1]


def model_parallel(
    devices, rules, shape=None, axis_names=("model",), batch_dim_name=None
):
    """ModelParallel over `devices` on a mesh of `shape` (default: all of
    them on one axis), with a LayoutMap of {pattern: axes} `rules`, its
    batch axis `batch_dim_name` (default: Keras', the mesh's first)."""
    import keras

    mesh = keras.distribution.DeviceMesh(
        shape or (len(devices),), list(axis_names), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in rules.items():
        layout_map[pattern] = axes
    if batch_dim_name is None:
        return keras.distribution.ModelParallel(layout_map=layout_map)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=batch_dim_name
    )


# ---------------------------------------------------------------------------
# Training numbers: fit / evaluate / predict against one process
# (multiprocess/test_training.py, multiprocess/test_compile.py)
# ---------------------------------------------------------------------------

FEATURES, OUTPUTS = 6, 3


def set_distribution(kind):
    """None (no distribution), "dp", "mp" (a ("model",) mesh over every
    process) or "hybrid" (2 x N/2 ("batch", "model")), with rules for a
    model whose layers are named "hidden" and "out"."""
    import keras

    devices = keras.distribution.list_devices()
    if kind == "dp":
        keras.distribution.set_distribution(keras.distribution.DataParallel())
    elif kind in ("mp", "hybrid"):
        if kind == "mp":
            mesh = keras.distribution.DeviceMesh(
                (len(devices),), ["model"], devices
            )
        else:
            mesh = keras.distribution.DeviceMesh(
                (2, len(devices) // 2), ["batch", "model"], devices
            )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*hidden.*kernel"] = (None, "model")
        layout_map[".*hidden.*bias"] = ("model",)
        layout_map[".*out.*kernel"] = ("model", None)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )


def assert_same_training(results, reference, atol=2e-5):
    """Each rank's (weights, history, evaluation, predictions) against one
    process's; every rank reports identical logs."""
    ref_weights, ref_history, ref_eval, ref_pred = reference
    for rank, (weights, history, evaluation, predictions) in enumerate(results):
        for w, r in zip(weights, ref_weights):
            np.testing.assert_allclose(
                w, r, atol=atol, rtol=1e-4, err_msg=f"rank {rank}"
            )
        assert history.keys() == ref_history.keys()
        for key in ref_history:
            np.testing.assert_allclose(
                history[key], ref_history[key], rtol=1e-4, atol=atol
            )
        np.testing.assert_allclose(evaluation, ref_eval, rtol=1e-4, atol=atol)
        np.testing.assert_allclose(predictions, ref_pred, rtol=1e-4, atol=atol)
    # Every rank reports identical logs.
    for weights, history, evaluation, _ in results[1:]:
        assert history == results[0][1]
        assert evaluation == results[0][2]


# ---------------------------------------------------------------------------
# Sharded checkpoints (unit/test_checkpoint_files.py,
# multiprocess/test_checkpoint*.py, e2e/test_checkpoint_process_exit.py)
# ---------------------------------------------------------------------------

SAVE_RULES = {
    r".*col/kernel": (None, "model"),
    r".*col/bias": ("model",),
    r".*row/kernel": ("model", None),
}


def checkpoint_model(width=16, last="row"):
    """A compiled 6 -> width -> 4 model with dropout, seeded."""
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(width, activation="relu", name="col"),
            keras.layers.Dropout(0.25, seed=7, name="drop"),
            keras.layers.Dense(4, name=last),
        ],
        name="net",
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def distribute(rules, mesh_shape=None, axis_names=("model",)):
    """Set ModelParallel with {pattern: axes} `rules` (None: no
    distribution)."""
    import keras

    if rules is None:
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    keras.distribution.set_distribution(
        model_parallel(devices, rules, mesh_shape, axis_names)
    )


def checkpoint_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return x, y


def checkpoint_values(model):
    """{checkpoint key: global value} of the model's and optimizer's variables.
    Collective: call on every rank."""
    from keras_torch_distribution import checkpoint

    return {
        k: np.asarray(v) for k, v in checkpoint.variables_by_key(model).items()
    }


def placements_of(model):
    """{variable path: str(placements)} of the model's DTensor variables."""
    from torch.distributed.tensor import DTensor

    return {
        v.path: str(v.value.placements)
        for v in model.variables
        if isinstance(v.value, DTensor)
    }


def assert_same_values(got, want):
    """Two {key: value} dicts hold the same keys and exactly equal values."""
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def train_and_save(path, rules=SAVE_RULES):
    """On the ranks: fit 2 epochs, save to `path`, fit one more. (values
    saved, values after the extra epoch, placements)."""
    from keras_torch_distribution import checkpoint

    distribute(rules)
    model = checkpoint_model()
    x, y = checkpoint_data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    checkpoint.save(model, path, extra={"epoch": 2, "step": 8})
    saved = checkpoint_values(model)
    # Training on from here is what a resumed run must reproduce.
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return saved, checkpoint_values(model), placements_of(model)


EPOCHS = 5
KILL_AFTER_EPOCH = 2


def resume_fit(backup_dir, record, kill, epochs=EPOCHS):
    """fit with BackupAndRestore(backup_dir): (epochs run, values). `kill`:
    rank 1 kills itself (SIGKILL) after epoch KILL_AFTER_EPOCH. `record`:
    rank 0 also writes record.npz (values) and record.json (epochs run,
    whether the backup is left)."""
    import keras

    from keras_torch_distribution._processes import runtime

    distribute(SAVE_RULES)
    model = checkpoint_model()
    x, y = checkpoint_data()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            if (
                kill
                and epoch + 1 == KILL_AFTER_EPOCH
                and runtime.process_id() == 1
            ):
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [keras.callbacks.BackupAndRestore(backup_dir), Record()]
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    values = checkpoint_values(model)
    if record and runtime.process_id() == 0:
        np.savez(
            record + ".npz",
            **{k.replace("/", "|"): v for k, v in values.items()},
        )
        with open(record + ".json", "w") as f:
            json.dump(
                {"seen": seen, "backup_left": os.path.exists(backup_dir)}, f
            )
    return seen, values


def rewrite_marker(path, change):
    """Apply `change` to the checkpoint's marker (its JSON, as a dict)."""
    from keras_torch_distribution import checkpoint

    marker_path = os.path.join(path, checkpoint.MARKER)
    with open(marker_path) as f:
        marker = json.load(f)
    change(marker)
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def record_file(path, name):
    """Make the marker agree with the file `name` as it now is (what someone
    who alters a checkpoint on purpose would do)."""
    data = open(os.path.join(path, name), "rb").read()

    def change(marker):
        if "files" in marker:  # (absent in checkpoints older than checksums)
            marker["files"][name].update(
                bytes=len(data), crc32=f"{zlib.crc32(data):08x}"
            )

    rewrite_marker(path, change)


# ---------------------------------------------------------------------------
# Where tensors are made (whole variables never on a device)
# ---------------------------------------------------------------------------


class Allocations:
    """Records the device and size of every plain tensor the ops run inside
    `with Allocations() as made:` produce: `made.largest(device_type)` is
    the most elements one of them held there. On a CPU machine a test makes
    "meta" stand for the accelerator (Keras' torch device), so that what
    went to the device is told apart from what stayed on the host."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        records = self.records = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                for value in out if isinstance(out, (tuple, list)) else (out,):
                    if type(value) in (torch.Tensor, torch.nn.Parameter):
                        records.append(
                            (value.device.type, value.numel(), str(func))
                        )
                return out

        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._mode.__exit__(*exc_info)

    def largest(self, device_type):
        return max(
            (n for kind, n, _ in self.records if kind == device_type), default=0
        )


# ---------------------------------------------------------------------------
# Preemption (multiprocess/test_preemption.py, e2e/test_preemption_restarts.py,
# tests/scripts/preempt_fit.py)
# ---------------------------------------------------------------------------

PREEMPT_EPOCHS = 3
PREEMPT_BATCHES = 5  # per epoch: 40 rows, batches of 8


def preempt_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8 * PREEMPT_BATCHES, 6)).astype("float32")
    y = rng.normal(size=(8 * PREEMPT_BATCHES, 4)).astype("float32")
    return x, y


def preempt_fit(out, attempt, how="none", step=0, rank=1, save_freq="epoch"):
    """A 2-process DataParallel fit (shuffled, dropout) with
    BackupAndRestore(out/backup, save_freq). In attempt 0, after its
    `step`-th batch (1-based, counted over epochs), rank `rank`:
    `term-self` / `usr1-self` signals itself; `term-outside` writes its
    pid to out/pid and from then on sleeps 0.3 s per batch (the caller
    sends the signal); `kill` SIGKILLs itself; `crash` raises. With
    `kill-while-saving` the fit saves with ShardedCheckpoint(out/backup,
    save_freq=1, async_save=True, restore=True) instead, and rank `rank`
    SIGKILLs itself in the middle of writing the save of that step. Rank 0
    of a run that finishes writes out/attempt<N>.npz (values) and .json
    (the (epoch, batch) pairs trained). Returns (seen, values)."""
    import time

    import keras

    from keras_torch_distribution._processes import runtime
    from keras_torch_distribution.checkpoint import ShardedCheckpoint
    from keras_torch_distribution.checkpoint import _streams

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = checkpoint_model()
    x, y = preempt_data()
    seen = []
    me = runtime.process_id()

    class Act(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            seen.append((self.epoch, batch))
            if attempt != 0 or me != rank:
                return
            if len(seen) == step:
                if how == "term-self":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif how == "usr1-self":
                    os.kill(os.getpid(), signal.SIGUSR1)
                elif how == "term-outside":
                    with open(os.path.join(out, "pid.tmp"), "w") as f:
                        f.write(str(os.getpid()))
                    os.rename(
                        os.path.join(out, "pid.tmp"), os.path.join(out, "pid")
                    )
                elif how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif how == "crash":
                    raise RuntimeError(f"crash after step {step}")
            if how == "term-outside" and len(seen) >= step:
                time.sleep(0.3)

    if how == "kill-while-saving":
        backup = ShardedCheckpoint(
            os.path.join(out, "backup"),
            save_freq=1,
            async_save=True,
            restore=True,
        )
        if attempt == 0 and me == rank:
            real_open = _streams._open

            def dying_open(path, mode):
                if f"ckpt-{step:09d}" in str(path):
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_open(path, mode)

            _streams._open = dying_open
    else:
        backup = keras.callbacks.BackupAndRestore(
            os.path.join(out, "backup"), save_freq=save_freq
        )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=PREEMPT_EPOCHS,
        verbose=0,
        callbacks=[backup, Act()],
    )
    values = checkpoint_values(model)
    if me == 0:
        np.savez(
            os.path.join(out, f"attempt{attempt}.npz"),
            **{k.replace("/", "|"): v for k, v in values.items()},
        )
        with open(os.path.join(out, f"attempt{attempt}.json"), "w") as f:
            json.dump({"seen": seen}, f)
    return seen, values
