"""Shared helpers for the benchmarks: launching workers, timing, results.

Each benchmark script is both the driver (`python benchmarks/x.py`) and the
worker: the driver launches `python -m torch.distributed.run` on the same
file with BENCH_WORKER=<case> in the environment; every rank writes its
measurements as JSON into BENCH_OUT/rank<r>.json and the driver collects
them. Every launch runs in its own process session, so that on a timeout
the driver kills that session (only processes it started) and nothing else.
"""

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from keras_torch_distribution import testing

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

WORKER_ENV = dict(testing.WORKER_ENV, TF_CPP_MIN_LOG_LEVEL="3")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, case, nproc, timeout=150.0, extra_env=None):
    """Run `script` as BENCH_WORKER=`case` on `nproc` torchrun processes.

    Returns the list of per-rank result dicts, in rank order.
    """
    out = tempfile.mkdtemp(prefix="ktd-bench-")
    env = dict(os.environ, **WORKER_ENV, **(extra_env or {}))
    env["BENCH_WORKER"] = case
    env["BENCH_OUT"] = out
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        script,
    ]
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    process = subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session this call started
        output, _ = process.communicate()
        raise RuntimeError(
            f"{case} on {nproc} processes timed out after {timeout:.0f} s:\n"
            f"{output[-4000:]}"
        )
    if process.returncode != 0:
        raise RuntimeError(
            f"{case} on {nproc} processes failed (exit {process.returncode}):\n"
            f"{output[-6000:]}"
        )
    results = []
    for rank in range(nproc):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            result = json.load(f)
        # Other work on the machine skews timings: record how busy it was.
        result["loadavg_1min_before"] = round(load_before, 2)
        result["loadavg_1min_after"] = round(os.getloadavg()[0], 2)
        results.append(result)
        os.remove(os.path.join(out, f"rank{rank}.json"))
    os.rmdir(out)
    print(
        f"  [{case} x{nproc}: {time.monotonic() - started:.1f} s wall, "
        f"load avg {load_before:.1f} -> {os.getloadavg()[0]:.1f}]",
        flush=True,
    )
    return results


def write_rank_result(result):
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(os.environ["BENCH_OUT"], f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(result, f)


def time_steps(step, warmup, steps, barrier=None):
    """Per-step wall times (seconds) of `steps` calls after `warmup` calls."""
    for _ in range(warmup):
        step()
    if barrier is not None:
        barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def summary(times):
    return {
        "median_ms": 1e3 * statistics.median(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "min_ms": 1e3 * min(times),
        "steps": len(times),
        "times_ms": [round(1e3 * t, 3) for t in times],
    }


def torch_step(model, optimizer, x, y):
    """One raw-torch training step as the benchmarks time it: zero_grad,
    forward, MSE, backward, optimizer step. The last loss is kept in
    `step.last_loss`."""
    import torch.nn as nn

    loss_fn = nn.MSELoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        step.last_loss = loss

    return step


def megatron_mlp_layout_map(keras, mesh, layers, other=None):
    """The Keras LayoutMap of the benchmarks' Dense MLP over the mesh's
    "model" axis: dense_0, dense_2, ... column-parallel (kernel and bias
    sharded on outputs), dense_1, dense_3, ... row-parallel (kernel on
    inputs). `other` names the axis of each kernel's other dim (None:
    replicated; the batch axis: FSDP composed with the tensor parallelism,
    column kernels (other, "model"), row kernels ("model", other))."""
    layout_map = keras.distribution.LayoutMap(mesh)
    for i in range(layers):
        if i % 2 == 0:
            layout_map[f"dense_{i}/kernel"] = (other, "model")
            layout_map[f"dense_{i}/bias"] = ("model",)
        else:
            layout_map[f"dense_{i}/kernel"] = ("model", other)
    return layout_map


def machine():
    import torch

    info = {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "backend": "gloo (CPU)",
        "omp_num_threads": 1,
    }
    return info


def save(name, payload):
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
    return path


def main_or_worker(main, worker):
    """A benchmark script is the driver, or (under BENCH_WORKER) a worker."""
    case = os.environ.get("BENCH_WORKER")
    if case:
        worker(case)
    else:
        main()
