"""DataParallel on 2 processes for the keras_hub Llama: this package, eager
and with jit_compile=True, against torch DistributedDataParallel, eager
and with its blocks compiled.

    python benchmarks/llama_data_parallel.py [--steps 20] [--warmup 5]
        [--repeats 3] [--shape small|wide] [--cases ...]

The model is benchmarks/llama_shapes.py's (4 blocks, hidden 128 for the
`small` shape, 512 for `wide`), 64 tokens, global batch 8 (4 rows per
rank), Adam(1e-3), the next-token cross-entropy from logits. Cases, each
in fresh torchrun processes (gloo, CPU, OMP_NUM_THREADS=1):
  keras_dp       keras.distribution.DataParallel, eager
  keras_dp_jit   the same, jit_compile=True (repeated blocks compiled once,
                 Adam compiled)
  torch_ddp      DistributedDataParallel, foreach Adam
  torch_ddp_jit  the same with each block compiled (`block.compile()`)
Timing, per rank: the step on prebuilt per-rank batches (Keras: the
model's train function, what `fit` calls per step; torch: zero_grad,
forward, loss, backward, step), `warmup` untimed steps, then the median
of `steps` timed steps; a launch's figure is the slower rank's, a case's
the median over `--repeats` interleaved rounds. Also the time from
building to the end of the first step (compiling included). Ratios are to
torch_ddp. Results: benchmarks/results/llama_data_parallel.json.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

CASES = ("torch_ddp", "torch_ddp_jit", "keras_dp", "keras_dp_jit")
SHAPES = {
    "small": dict(hidden=128, ffn=384),
    "wide": dict(hidden=512, ffn=1536),
}


def _shape():
    import llama_shapes

    return llama_shapes.Shape(**SHAPES[os.environ.get("BENCH_SHAPE", "small")])


def _rank_rows(arrays, rank, world):
    x, y = arrays
    rows = len(x) // world
    return x[rank * rows : (rank + 1) * rows], y[
        rank * rows : (rank + 1) * rows
    ]


def _keras_worker(jit_compile, steps, warmup):
    import keras
    import keras_hub
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401
    import llama_shapes

    started = time.perf_counter()
    keras.distribution.initialize()
    world, rank = dist.get_world_size(), dist.get_rank()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()
        )
    )
    shape = _shape()
    keras.utils.set_random_seed(0)
    model = llama_shapes.keras_causal_lm(keras, keras_hub, shape)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=jit_compile,
    )
    x, y = llama_shapes.arrays(shape=shape)
    model.fit(
        llama_shapes.keras_inputs(x),
        y,
        batch_size=shape.global_batch,
        epochs=1,
        verbose=0,
    )
    first = time.perf_counter() - started
    x_local, y_local = _rank_rows((x, y), rank, world)
    batch = [
        (
            keras.tree.map_structure(
                torch.as_tensor, llama_shapes.keras_inputs(x_local)
            ),
            torch.as_tensor(y_local),
        )
    ]
    function = model.train_function
    times = _launch.time_steps(lambda: function(batch), warmup, steps)
    return dict(first_s=first, **_launch.summary(times))


def _torch_worker(compiled, steps, warmup):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import llama_shapes

    started = time.perf_counter()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = _shape()
    torch.manual_seed(0)
    model = llama_shapes.torch_causal_lm(shape)
    if compiled:
        for block in model.blocks:
            block.compile()
    model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x, y = _rank_rows(llama_shapes.arrays(shape=shape), rank, world)
    step = llama_shapes.torch_train_step(
        model, optimizer, torch.as_tensor(x), torch.as_tensor(y).long()
    )
    step()
    first = time.perf_counter() - started
    times = _launch.time_steps(step, warmup, steps)
    result = dict(first_s=first, **_launch.summary(times))
    dist.destroy_process_group()
    return result


def worker(case):
    steps = int(os.environ["BENCH_STEPS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    if case.startswith("keras"):
        result = _keras_worker(case.endswith("_jit"), steps, warmup)
    else:
        result = _torch_worker(case.endswith("_jit"), steps, warmup)
    _launch.write_rank_result(result)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    env = dict(
        BENCH_STEPS=str(args.steps),
        BENCH_WARMUP=str(args.warmup),
        BENCH_SHAPE=args.shape,
    )
    cases = args.cases.split(",")
    rounds = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            ranks = _launch.launch(__file__, case, 2, 1800.0, env)
            slowest = max(ranks, key=lambda r: r["median_ms"])
            rounds[case].append(slowest)
            shown = {k: v for k, v in slowest.items() if k != "times_ms"}
            print(case, shown, flush=True)
    table = {}
    for case, runs in rounds.items():
        table[case] = dict(
            step_ms=statistics.median(r["median_ms"] for r in runs),
            first_s=statistics.median(r["first_s"] for r in runs),
            runs=runs,
        )
    base = table.get("torch_ddp")
    for case, row in table.items():
        if base:
            row["vs_torch_ddp"] = row["step_ms"] / base["step_ms"]
        print(
            f"{case:14s} step {row['step_ms']:7.1f} ms"
            + (f" ({row['vs_torch_ddp']:.2f}x torch_ddp)" if base else "")
            + f"  first step {row['first_s']:6.1f} s"
        )
    _launch.save(
        "llama_data_parallel",
        dict(machine=_launch.machine(), shape=args.shape, cases=table),
    )


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
