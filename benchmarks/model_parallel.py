"""ModelParallel (Keras LayoutMap, this package) vs torch tensor parallelism.

    python benchmarks/model_parallel.py [--steps 30] [--warmup 5]

Model: 1024 inputs -> 4 Dense/Linear layers of 1024 units (ReLU between,
linear output), MSE loss, Adam(1e-3), float32, tensor parallel over 2
processes. Layers 0 and 2 are column-sharded, 1 and 3 row-sharded (Megatron
style: one all-reduce per column/row pair in the forward pass):
  keras_mp  -- keras.distribution.ModelParallel(batch_dim_name="batch") on a
               (1, 2) ("batch", "model") mesh with the LayoutMap
               dense_{0,2}/kernel (None, "model"), dense_{0,2}/bias
               ("model",), dense_{1,3}/kernel ("model", None),
               dense_{1,3}/bias replicated. The batch axis is always data;
               of size 1 it leaves pure tensor parallelism. (On a 1-D
               ("model",) mesh the batch axis would be "model" itself, and
               these kernels FSDP: see benchmarks/fsdp.py.)
  torch_tp  -- torch.distributed.tensor.parallel.parallelize_module on an
               nn.Sequential of nn.Linear with ColwiseParallel (0, 2) and
               RowwiseParallel (1, 3) over a ("model",) mesh of 2,
               torch.optim.Adam.
The same global batch of 256 rows is fed to every rank (one data replica).

Timing: Keras' per-step train function on a prebuilt batch
(model.make_train_function(); model.train_function([(x, y)])); torch:
zero_grad/forward/loss/backward/step. Median of `steps` timed steps after
`warmup`; the slower rank's median is reported. Memory: per-rank bytes of
the local parts of parameters and of optimizer state (Keras: the optimizer's
variables, including its iteration counter and learning rate; torch: Adam's
exp_avg, exp_avg_sq and step).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

WIDTH = 1024
LAYERS = 4
GLOBAL_BATCH = 256


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH, WIDTH)).astype("float32")
    y = rng.standard_normal((GLOBAL_BATCH, WIDTH)).astype("float32")
    return x, y


def _local_bytes(tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _keras_worker(steps, warmup):
    import keras
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401

    torch.set_num_threads(1)
    keras.distribution.initialize()
    rank = dist.get_rank()
    devices = keras.distribution.list_devices()
    # A batch axis of size 1: every rank computes on the whole batch, and
    # no variable is sharded on the batch axis (pure tensor parallelism).
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ["batch", "model"], devices
    )
    layout_map = _launch.megatron_mlp_layout_map(keras, mesh, LAYERS)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(WIDTH,))
    h = inputs
    for i in range(LAYERS):
        last = i == LAYERS - 1
        h = keras.layers.Dense(
            WIDTH, activation=None if last else "relu", name=f"dense_{i}"
        )(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = _data()
    model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=1, steps_per_epoch=1, verbose=0
    )
    model.make_train_function()
    function = model.train_function
    batch = [(torch.as_tensor(x), torch.as_tensor(y))]

    def step():
        return function(batch)

    times = _launch.time_steps(step, warmup, steps, dist.barrier)
    model.reset_metrics()  # the next loss is that step's, not a running mean
    logs = function(batch)
    param_bytes = sum(_local_bytes(v.value) for v in model.trainable_variables)
    state_bytes = sum(_local_bytes(v.value) for v in model.optimizer.variables)
    sharded = {
        v.path: type(v.value).__name__
        for v in model.optimizer.variables
        if len(v.shape) > 0
    }
    result = _launch.summary(times)
    result.update(
        rank=rank,
        keras=keras.__version__,
        param_bytes=param_bytes,
        optimizer_state_bytes=state_bytes,
        full_param_bytes=sum(
            int(v.value.numel()) * 4 for v in model.trainable_variables
        ),
        optimizer_variable_types=sharded,
        variable_placements={
            v.path: [str(p) for p in getattr(v.value, "placements", ())]
            for v in model.trainable_variables
        },
        final_loss=float(keras.ops.convert_to_numpy(logs["loss"])),
    )
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def _torch_worker(steps, warmup):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(),), mesh_dim_names=("model",)
    )
    torch.manual_seed(0)
    modules, plan = [], {}
    for i in range(LAYERS):
        plan[str(len(modules))] = (
            ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
        )
        modules.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            modules.append(nn.ReLU())
    model = parallelize_module(nn.Sequential(*modules), mesh, plan)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = (torch.as_tensor(a) for a in _data())
    step = _launch.torch_step(model, optimizer, x, y)

    times = _launch.time_steps(step, warmup, steps, dist.barrier)
    param_bytes = sum(_local_bytes(p) for p in model.parameters())
    state_bytes = sum(
        _local_bytes(t)
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    result = _launch.summary(times)
    result.update(
        rank=rank,
        param_bytes=param_bytes,
        optimizer_state_bytes=state_bytes,
        full_param_bytes=sum(p.numel() * 4 for p in model.parameters()),
        final_loss=float(step.last_loss),
    )
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def worker(case):
    steps = int(os.environ["BENCH_STEPS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    if case == "keras_mp":
        _keras_worker(steps, warmup)
    else:
        _torch_worker(steps, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    env = {"BENCH_STEPS": str(args.steps), "BENCH_WARMUP": str(args.warmup)}
    print(
        f"model parallel: {LAYERS} x Dense({WIDTH}) MLP, Adam, batch "
        f"{GLOBAL_BATCH} on every rank, 2 processes, {args.steps} timed "
        f"steps after {args.warmup}",
        flush=True,
    )
    runs = {}
    for case in ("keras_mp", "torch_tp"):
        runs[case] = _launch.launch(
            os.path.abspath(__file__), case, 2, timeout=150, extra_env=env
        )
    step_ms = {
        case: max(r["median_ms"] for r in ranks) for case, ranks in runs.items()
    }
    memory = {
        case: {
            "param_bytes_per_rank": [r["param_bytes"] for r in ranks],
            "optimizer_state_bytes_per_rank": [
                r["optimizer_state_bytes"] for r in ranks
            ],
            "full_param_bytes": ranks[0]["full_param_bytes"],
        }
        for case, ranks in runs.items()
    }
    keras_total = max(
        p + s
        for p, s in zip(
            memory["keras_mp"]["param_bytes_per_rank"],
            memory["keras_mp"]["optimizer_state_bytes_per_rank"],
        )
    )
    torch_total = max(
        p + s
        for p, s in zip(
            memory["torch_tp"]["param_bytes_per_rank"],
            memory["torch_tp"]["optimizer_state_bytes_per_rank"],
        )
    )
    ratios = {
        "keras_mp_over_torch_tp_step": step_ms["keras_mp"]
        / step_ms["torch_tp"],
        "keras_mp_over_torch_tp_param_plus_state_bytes": keras_total
        / torch_total,
    }
    payload = {
        "benchmark": "model_parallel",
        "machine": dict(_launch.machine(), keras=runs["keras_mp"][0]["keras"]),
        "model": {
            "layers": LAYERS,
            "width": WIDTH,
            "batch_on_every_rank": GLOBAL_BATCH,
            "optimizer": "Adam",
            "loss": "mse",
            "mesh": "keras: (1, 2) ['batch', 'model'], batch axis 'batch'; "
            "torch: (2,) ['model']",
        },
        "timing": "Keras: model.train_function([(x, y)]) on a prebuilt batch; "
        "torch: zero_grad/forward/backward/step. Median of timed steps "
        "after warm-up, slower rank.",
        "step_ms": step_ms,
        "memory": memory,
        "ratios": ratios,
        "runs": runs,
    }
    for case, ms in step_ms.items():
        m = memory[case]
        optimizer_state_mib = [
            round(b / 2**20, 2) for b in m["optimizer_state_bytes_per_rank"]
        ]
        print(
            f"  {case:9} median step {ms:8.2f} ms   params/rank "
            f"{[round(b / 2**20, 2) for b in m['param_bytes_per_rank']]} MiB   "
            "optimizer state/rank "
            f"{optimizer_state_mib} "
            f"MiB   (full params {m['full_param_bytes'] / 2**20:.2f} MiB)"
        )
    for name, value in ratios.items():
        print(f"  {name:46} {value:.3f}")
    _launch.save("model_parallel", payload)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
