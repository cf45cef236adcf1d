"""DataParallel (Keras on torch, this package) vs torch DistributedDataParallel.

    python benchmarks/data_parallel.py [--steps 30] [--warmup 5]

Model: 1024 inputs -> 4 Dense/Linear layers of 1024 units (ReLU between,
linear output), MSE loss, Adam(1e-3), float32. Global batch 256.

Cases, each in fresh processes (torchrun), OMP_NUM_THREADS=1 per process:
  keras_dp  x2 -- keras.distribution.DataParallel on 2 processes; each rank
                  runs Keras' per-step train function on its 128 rows (what
                  fit() feeds it after sharding the 256-row global batch).
  torch_ddp x2 -- torch.nn.parallel.DistributedDataParallel, 128 rows/rank.
  keras_1p  x1 -- plain Keras (no distribution), batch 128.
  torch_1p  x1 -- plain torch, batch 128.

Timing: the per-step function on prebuilt batches (Keras:
model.make_train_function(); model.train_function([(x, y)]), i.e. what fit
calls per step, without the data pipeline and callbacks; torch: zero_grad,
forward, loss, backward, step), `warmup` untimed steps then the median of
`steps` timed steps. On 2 ranks the reported time is the larger of the two
ranks' medians. Distribution overhead = 2-process step / 1-process step (same
per-process work, so 1.0 is perfect scaling of the global batch).
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

WIDTH = 1024
LAYERS = 4
GLOBAL_BATCH = 256


def _data(rows, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, WIDTH)).astype("float32")
    y = rng.standard_normal((rows, WIDTH)).astype("float32")
    return x, y


def _keras_worker(distributed, steps, warmup):
    import keras
    import torch

    import keras_torch_distribution  # noqa: F401

    torch.set_num_threads(1)
    world, rank = 1, 0
    if distributed:
        import torch.distributed as dist

        keras.distribution.initialize()
        world, rank = dist.get_world_size(), dist.get_rank()
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (len(devices),), ["batch"], devices
        )
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(device_mesh=mesh)
        )
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(WIDTH,))
    h = inputs
    for i in range(LAYERS):
        last = i == LAYERS - 1
        h = keras.layers.Dense(WIDTH, activation=None if last else "relu")(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    per_rank = GLOBAL_BATCH // 2  # the per-process batch, at 1 or 2 processes
    x, y = _data(GLOBAL_BATCH)
    x = torch.as_tensor(x[rank * per_rank : (rank + 1) * per_rank])
    y = torch.as_tensor(y[rank * per_rank : (rank + 1) * per_rank])
    # One short fit builds the optimizer and the metrics the way fit does.
    model.fit(
        x.numpy(),
        y.numpy(),
        batch_size=per_rank * world,
        epochs=1,
        steps_per_epoch=1,
        verbose=0,
    )
    model.make_train_function()
    function = model.train_function
    batch = [(x, y)]
    barrier = None
    if distributed:
        import torch.distributed as dist

        barrier = dist.barrier

    def step():
        logs = function(batch)
        return logs

    times = _launch.time_steps(step, warmup, steps, barrier)
    logs = function(batch)
    result = _launch.summary(times)
    result.update(
        rank=rank,
        world=world,
        keras=keras.__version__,
        final_loss=float(keras.ops.convert_to_numpy(logs["loss"])),
    )
    _launch.write_rank_result(result)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _torch_worker(distributed, steps, warmup):
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    world, rank = 1, 0
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    modules = []
    for i in range(LAYERS):
        modules.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            modules.append(nn.ReLU())
    model = nn.Sequential(*modules)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    per_rank = GLOBAL_BATCH // 2
    x, y = _data(GLOBAL_BATCH)
    x = torch.as_tensor(x[rank * per_rank : (rank + 1) * per_rank])
    y = torch.as_tensor(y[rank * per_rank : (rank + 1) * per_rank])
    step = _launch.torch_step(model, optimizer, x, y)

    barrier = None
    if distributed:
        import torch.distributed as dist

        barrier = dist.barrier
    times = _launch.time_steps(step, warmup, steps, barrier)
    result = _launch.summary(times)
    result.update(rank=rank, world=world, final_loss=float(step.last_loss))
    _launch.write_rank_result(result)
    if distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def worker(case):
    steps = int(os.environ["BENCH_STEPS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    kind, _, procs = case.partition("_")
    distributed = procs != "1p"
    if kind == "keras":
        _keras_worker(distributed, steps, warmup)
    else:
        _torch_worker(distributed, steps, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of all four cases, interleaved; each "
        "case reports the median over rounds",
    )
    args = parser.parse_args()
    env = {"BENCH_STEPS": str(args.steps), "BENCH_WARMUP": str(args.warmup)}
    print(
        f"data parallel: {LAYERS} x Dense({WIDTH}) MLP, Adam, global batch "
        f"{GLOBAL_BATCH}, {args.steps} timed steps after {args.warmup}",
        flush=True,
    )
    plan = [("keras_dp", 2), ("torch_ddp", 2), ("keras_1p", 1), ("torch_1p", 1)]
    runs = {case: [] for case, _ in plan}
    for _ in range(args.repeats):
        for case, nproc in plan:
            runs[case].append(
                _launch.launch(
                    os.path.abspath(__file__),
                    case,
                    nproc,
                    timeout=150,
                    extra_env=env,
                )
            )
    # Each round: the slower rank's median; each case: the median over rounds.
    rounds_ms = {
        case: [max(r["median_ms"] for r in ranks) for ranks in rounds]
        for case, rounds in runs.items()
    }
    step_ms = {case: statistics.median(ms) for case, ms in rounds_ms.items()}
    ratios = {
        "keras_dp_over_torch_ddp": step_ms["keras_dp"] / step_ms["torch_ddp"],
        "keras_1p_over_torch_1p": step_ms["keras_1p"] / step_ms["torch_1p"],
        "overhead_keras_dp_2p_over_1p": step_ms["keras_dp"]
        / step_ms["keras_1p"],
        "overhead_torch_ddp_2p_over_1p": step_ms["torch_ddp"]
        / step_ms["torch_1p"],
    }
    ratios["overhead_keras_over_overhead_torch"] = (
        ratios["overhead_keras_dp_2p_over_1p"]
        / ratios["overhead_torch_ddp_2p_over_1p"]
    )
    payload = {
        "benchmark": "data_parallel",
        "machine": dict(
            _launch.machine(), keras=runs["keras_dp"][0][0]["keras"]
        ),
        "model": {
            "layers": LAYERS,
            "width": WIDTH,
            "global_batch": GLOBAL_BATCH,
            "per_process_batch": GLOBAL_BATCH // 2,
            "optimizer": "Adam",
            "loss": "mse",
        },
        "timing": "Keras: model.train_function([(x, y)]) on prebuilt per-rank "
        "batches (fit's per-step function); torch: zero_grad/forward/"
        "backward/step. Median of timed steps after warm-up; 2-process "
        "cases report the slower rank's median.",
        "step_ms": step_ms,
        "rounds_ms": rounds_ms,
        "ratios": ratios,
        "runs": runs,
    }
    for case, ms in step_ms.items():
        rounds = [round(m, 1) for m in rounds_ms[case]]
        print(f"  {case:10} median step {ms:8.2f} ms   rounds {rounds}")
    for name, value in ratios.items():
        print(f"  {name:32} {value:.3f}")
    _launch.save("data_parallel", payload)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
