"""Collectives per step and step time of DataParallel, tensor parallelism
and FSDP on whichever Keras is installed: run it once per Keras version
(3.15.1, the 3.16 nightly) and compare.

    python -m torch.distributed.run --nproc-per-node 2 \\
        benchmarks/keras_versions.py [--steps 15] [--warmup 3]

Model: 512 inputs -> 4 Dense(512) (ReLU between), MSE, Adam(1e-3),
global batch 128, gloo, CPU, one thread per process. Cases:
  dp, dp_jit    DataParallel (64 rows per rank), jit_compile False / True
  tp, tp_jit    ModelParallel on a (1, 2) ("batch", "model") mesh, Megatron
                column / row kernels (every rank all 128 rows)
  fsdp          ModelParallel on a (2,) ("model",) mesh (its batch axis),
                every kernel ("model", None): FSDP (64 rows per rank)
Per case and rank: one fit step, `warmup` untimed steps of
model.train_function on prebuilt per-rank batches, the median of `steps`
timed ones, the collectives one more step issues (_collective_counts), the
loss of one evaluate on the global batch afterwards (the same on every
Keras if the numbers are), and whether Keras wrapped the model in DDP.
Rank 0 prints one JSON line per case. `--native-ddp` (Keras 3.16 only)
puts Keras' own `_initialize_ddp` back, to count what DDP wrapping adds
to the package's own gradient all-reduce.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

WIDTH = 512
LAYERS = 4
GLOBAL_BATCH = 128
CASES = ("dp", "dp_jit", "tp", "tp_jit", "fsdp")


def _distribution(case, devices):
    import keras

    dist = keras.distribution
    if case.startswith("dp"):
        return dist.DataParallel(devices=devices), 2
    if case.startswith("tp"):
        mesh = dist.DeviceMesh((1, 2), ["batch", "model"], devices)
        layout_map = dist.LayoutMap(mesh)
        for i in range(LAYERS):
            column = i % 2 == 0
            layout_map[f".*dense_{i}/kernel"] = (
                (None, "model") if column else ("model", None)
            )
            layout_map[f".*dense_{i}/bias"] = ("model",) if column else (None,)
        return dist.ModelParallel(layout_map=layout_map), 1
    mesh = dist.DeviceMesh((2,), ["model"], devices)
    layout_map = dist.LayoutMap(mesh)
    layout_map[".*kernel"] = ("model", None)
    return dist.ModelParallel(layout_map=layout_map), 2


def run_case(case, steps, warmup):
    import keras
    import numpy as np
    import torch.distributed as torch_dist

    from keras_torch_distribution.plan import _collective_counts

    rank = torch_dist.get_rank()
    distribution, replicas = _distribution(
        case, keras.distribution.list_devices()
    )
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((WIDTH,))]
        + [
            keras.layers.Dense(
                WIDTH,
                activation="relu" if i < LAYERS - 1 else None,
                name=f"dense_{i}",
            )
            for i in range(LAYERS)
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-3), "mse", jit_compile=case.endswith("_jit")
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH, WIDTH)).astype("float32")
    y = rng.standard_normal((GLOBAL_BATCH, WIDTH)).astype("float32")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    rows = GLOBAL_BATCH // replicas
    start = (rank % replicas) * rows
    batch = [(x[start : start + rows], y[start : start + rows])]
    for _ in range(warmup):
        model.train_function(batch)
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        model.train_function(batch)
        times.append(time.perf_counter() - begin)
    with _collective_counts.counting() as counts:
        model.train_function(batch)
    loss = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    ddp = getattr(model, "ddp_model", None) is not None
    keras.distribution.set_distribution(None)
    return {
        "keras": keras.__version__,
        "case": case,
        "median_step_ms": round(1000 * statistics.median(times), 1),
        "collectives_per_step": {k: v for k, v in counts.items() if v},
        "loss_after": float(loss),
        "ddp_wrapped": ddp,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--native-ddp", action="store_true")
    args = parser.parse_args()
    import keras
    import torch
    import torch.distributed as torch_dist

    import keras_torch_distribution  # noqa: F401

    if args.native_ddp:
        from keras_torch_distribution import _install

        (patch,) = [
            p for p in _install._installed if p.name == "_initialize_ddp"
        ]
        setattr(patch.owner, patch.name, patch.original)
    torch.set_num_threads(1)
    keras.distribution.initialize()
    for case in args.cases.split(","):
        result = run_case(case, args.steps, args.warmup)
        gathered = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(gathered, result)
        if torch_dist.get_rank() == 0:
            result["median_step_ms"] = max(
                r["median_step_ms"] for r in gathered
            )
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
