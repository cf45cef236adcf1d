"""Eager vs torch.compile'd step time under DataParallel / ModelParallel,
and against raw PyTorch (DDP, parallelize_module tensor parallelism).

    python benchmarks/compile.py [--steps 20] [--warmup 5] [--repeats 1]
                                 [--quick]

Every case runs in fresh processes (torchrun, gloo, CPU, OMP_NUM_THREADS=1):
  keras_{dp,mp}_{mlp,block}_{eager,compiled}
      Keras on 2 processes, `DataParallel` (each rank its 128 of 256 rows)
      or `ModelParallel(batch_dim_name="batch")` on a (1, 2)
      ("batch", "model") mesh (a batch axis of size 1: pure tensor
      parallelism, the whole batch on every rank, Megatron layouts on
      "model"); `compile(jit_compile=...)`.
  torch_{ddp,tp}_{mlp,block}_{eager,compiled}
      raw torch on 2 processes: DistributedDataParallel / parallelize_module
      (Colwise/Rowwise on the nn.Linear layers: the block's q/k/v and MLP-up
      column, attention output and MLP-down row); compiled =
      torch.compile(model).
  {keras,torch}_1p_{mlp,block}_{eager,compiled}
      one process, half the global batch, no distribution: the baselines of
      the data parallel overhead (2-process step / 1-process step, same
      mode).
Models: the 1024 -> 4 x Dense(1024) MLP of data_parallel.py (MSE, Adam,
global batch 256) and a small transformer block (batch 32, 64 tokens, width
256, 4 heads, MLP 1024: attention + residual + LayerNorm + MLP + residual +
LayerNorm; MP shards attention on heads and the MLP column/row).
Keras is timed on `model.train_function([(x, y)])` after a one-step fit
(what fit calls per step); torch on zero_grad/forward/loss/backward/step.
The first steps compile: `warmup` untimed steps, then the median of
`steps`, slower rank. Results: benchmarks/results/compile.json, ratios
printed side by side.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

WIDTH, LAYERS, GLOBAL_BATCH = 1024, 4, 256
SEQ, DMODEL, HEADS, FFN, BLOCK_BATCH = 64, 256, 4, 1024, 32


def _arrays(shape_x, shape_y, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal(shape_x).astype("float32"),
        rng.standard_normal(shape_y).astype("float32"),
    )


def _keras_mlp(keras):
    inputs = keras.Input(shape=(WIDTH,))
    h = inputs
    for i in range(LAYERS):
        h = keras.layers.Dense(
            WIDTH,
            activation=None if i == LAYERS - 1 else "relu",
            name=f"dense_{i}",
        )(h)
    return keras.Model(inputs, h)


def _keras_block(keras):
    inputs = keras.Input(shape=(SEQ, DMODEL))
    attention = keras.layers.MultiHeadAttention(
        HEADS, DMODEL // HEADS, name="mha"
    )(inputs, inputs)
    h = keras.layers.LayerNormalization(name="ln1")(inputs + attention)
    up = keras.layers.Dense(FFN, activation="relu", name="ffn_up")(h)
    down = keras.layers.Dense(DMODEL, name="ffn_down")(up)
    outputs = keras.layers.LayerNormalization(name="ln2")(h + down)
    return keras.Model(inputs, outputs)


def _keras_layout_map(keras, mesh, model_kind):
    if model_kind == "mlp":
        return _launch.megatron_mlp_layout_map(keras, mesh, LAYERS)
    layout_map = keras.distribution.LayoutMap(mesh)
    for name in ("query", "key", "value"):
        layout_map[f"mha/{name}/kernel"] = (None, "model", None)
        layout_map[f"mha/{name}/bias"] = ("model", None)
    layout_map["mha/attention_output/kernel"] = ("model", None, None)
    layout_map["ffn_up/kernel"] = (None, "model")
    layout_map["ffn_up/bias"] = ("model",)
    layout_map["ffn_down/kernel"] = ("model", None)
    return layout_map


def _time_and_report(step, rank, mode, steps, warmup, barrier, **extra):
    """Time the first call, then `steps` after `warmup`; write this rank's
    result with torch's compile counters; end the process group."""
    from torch._dynamo.utils import counters

    started = time.perf_counter()
    step()
    first_ms = 1e3 * (time.perf_counter() - started)
    times = _launch.time_steps(step, warmup, steps, barrier)
    result = _launch.summary(times)
    result.update(
        rank=rank,
        first_step_ms=first_ms,
        graphs=counters["stats"].get("unique_graphs", 0),
        graph_breaks=sum(counters["graph_break"].values()),
        compiled_frames=counters["frames"].get("ok", 0),
        **extra,
    )
    _launch.write_rank_result(result)
    if mode != "1p":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _keras_worker(mode, model_kind, compiled, steps, warmup):
    import keras
    import torch

    import keras_torch_distribution  # noqa: F401

    torch.set_num_threads(1)
    world, rank = 1, 0
    if mode != "1p":
        import torch.distributed as dist

        keras.distribution.initialize()
        world, rank = dist.get_world_size(), dist.get_rank()
        devices = keras.distribution.list_devices()
        if mode == "dp":
            keras.distribution.set_distribution(
                keras.distribution.DataParallel()
            )
        else:
            # The batch axis is always data: of size 1, it leaves the
            # "model" layouts pure tensor parallelism (on a 1-D ("model",)
            # mesh they would be FSDP, see fsdp.py).
            mesh = keras.distribution.DeviceMesh(
                (1, world), ["batch", "model"], devices
            )
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(
                    layout_map=_keras_layout_map(keras, mesh, model_kind),
                    batch_dim_name="batch",
                )
            )
    keras.utils.set_random_seed(0)
    model = _keras_mlp(keras) if model_kind == "mlp" else _keras_block(keras)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=compiled
    )
    if model_kind == "mlp":
        x, y = _arrays((GLOBAL_BATCH, WIDTH), (GLOBAL_BATCH, WIDTH))
    else:
        x, y = _arrays((BLOCK_BATCH, SEQ, DMODEL), (BLOCK_BATCH, SEQ, DMODEL))
    global_rows = len(x)
    if mode in ("dp", "1p"):  # a replica's rows (1p: one replica's share)
        per = global_rows // 2
        x, y = (
            x[rank * per : (rank + 1) * per],
            y[rank * per : (rank + 1) * per],
        )
        fit_batch = per * world
    else:
        fit_batch = global_rows
    # One short fit builds the optimizer and installs the step functions.
    model.fit(
        x, y, batch_size=fit_batch, epochs=1, steps_per_epoch=1, verbose=0
    )
    model.make_train_function()
    function = model.train_function
    batch = [(torch.as_tensor(x), torch.as_tensor(y))]
    barrier = None
    if mode != "1p":
        import torch.distributed as dist

        barrier = dist.barrier
    # The first call compiles here (and in fit above) when compiled.
    _time_and_report(
        lambda: function(batch),
        rank,
        mode,
        steps,
        warmup,
        barrier,
        keras=keras.__version__,
    )


class _TorchBlock:
    """The Keras block in plain torch (built lazily: torch is imported in
    the worker): attention (q/k/v projections, SDPA over heads, output
    projection) + residual + LayerNorm + MLP + residual + LayerNorm. Under
    tensor parallelism the projections hold this rank's heads only, so the
    head count is inferred from the local width."""

    @staticmethod
    def build():
        import torch
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.query = nn.Linear(DMODEL, DMODEL)
                self.key = nn.Linear(DMODEL, DMODEL)
                self.value = nn.Linear(DMODEL, DMODEL)
                self.attention_output = nn.Linear(DMODEL, DMODEL)
                self.ln1 = nn.LayerNorm(DMODEL, eps=1e-3)
                self.ffn_up = nn.Linear(DMODEL, FFN)
                self.ffn_down = nn.Linear(FFN, DMODEL)
                self.ln2 = nn.LayerNorm(DMODEL, eps=1e-3)

            def forward(self, x):
                batch, seq, _ = x.shape
                head_dim = DMODEL // HEADS

                def heads(t):
                    return t.view(batch, seq, -1, head_dim).transpose(1, 2)

                attended = torch.nn.functional.scaled_dot_product_attention(
                    heads(self.query(x)),
                    heads(self.key(x)),
                    heads(self.value(x)),
                )
                attended = attended.transpose(1, 2).reshape(batch, seq, -1)
                h = self.ln1(x + self.attention_output(attended))
                down = self.ffn_down(torch.relu(self.ffn_up(h)))
                return self.ln2(h + down)

        return Block()


def _torch_model(model_kind):
    import torch.nn as nn

    if model_kind == "block":
        return _TorchBlock.build()
    modules = []
    for i in range(LAYERS):
        modules.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def _torch_tp_plan(model_kind):
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    if model_kind == "block":
        return {
            "query": ColwiseParallel(),
            "key": ColwiseParallel(),
            "value": ColwiseParallel(),
            "attention_output": RowwiseParallel(),
            "ffn_up": ColwiseParallel(),
            "ffn_down": RowwiseParallel(),
        }
    return {
        str(2 * i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
        for i in range(LAYERS)
    }


def _torch_worker(mode, model_kind, compiled, steps, warmup):
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    world, rank = 1, 0
    if mode != "1p":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = _torch_model(model_kind)
    if model_kind == "mlp":
        arrays = _arrays((GLOBAL_BATCH, WIDTH), (GLOBAL_BATCH, WIDTH))
    else:
        arrays = _arrays((BLOCK_BATCH, SEQ, DMODEL), (BLOCK_BATCH, SEQ, DMODEL))
    x, y = (torch.as_tensor(a) for a in arrays)
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    if mode in ("ddp", "1p"):
        per = len(x) // 2
        x, y = (
            x[rank * per : (rank + 1) * per],
            y[rank * per : (rank + 1) * per],
        )
    if mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("model",))
        model = parallelize_module(model, mesh, _torch_tp_plan(model_kind))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if compiled else model
    step = _launch.torch_step(forward, optimizer, x, y)

    barrier = None
    if mode != "1p":
        import torch.distributed as dist

        barrier = dist.barrier
    _time_and_report(step, rank, mode, steps, warmup, barrier)


def worker(case):
    steps = int(os.environ["BENCH_STEPS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    framework, mode, model_kind, how = case.split("_")
    compiled = how == "compiled"
    if framework == "keras":
        _keras_worker(mode, model_kind, compiled, steps, warmup)
    else:
        _torch_worker(mode, model_kind, compiled, steps, warmup)


def _cases(quick):
    cases = []
    for how in ("eager", "compiled"):
        for model_kind in ("mlp",) if quick else ("mlp", "block"):
            cases += [
                (f"keras_dp_{model_kind}_{how}", 2),
                (f"keras_mp_{model_kind}_{how}", 2),
                (f"torch_ddp_{model_kind}_{how}", 2),
                (f"torch_tp_{model_kind}_{how}", 2),
                (f"keras_1p_{model_kind}_{how}", 1),
                (f"torch_1p_{model_kind}_{how}", 1),
            ]
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="MLP only")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of all cases, interleaved; each case "
        "reports the median over rounds",
    )
    args = parser.parse_args()
    env = {"BENCH_STEPS": str(args.steps), "BENCH_WARMUP": str(args.warmup)}
    rounds, errors = {}, {}
    for _ in range(args.repeats):
        for case, nproc in _cases(args.quick):
            try:
                rounds.setdefault(case, []).append(
                    _launch.launch(
                        os.path.abspath(__file__),
                        case,
                        nproc,
                        timeout=300,
                        extra_env=env,
                    )
                )
            except RuntimeError as error:  # recorded in the JSON, run goes on
                errors.setdefault(case, []).append(str(error)[-3000:])
                print(f"  {case} FAILED: {str(error)[-600:]}", flush=True)
    # Each round: the slower rank's median; each case: the median over rounds.
    rounds_ms = {
        case: [max(r["median_ms"] for r in ranks) for ranks in case_rounds]
        for case, case_rounds in rounds.items()
    }
    ms = {case: statistics.median(values) for case, values in rounds_ms.items()}
    runs = {case: case_rounds[0] for case, case_rounds in rounds.items()}

    def ratio(a, b):
        return round(ms[a] / ms[b], 3) if a in ms and b in ms else None

    ratios = {}
    for model_kind in ("mlp", "block"):
        for framework, modes in (
            ("keras", ("dp", "mp", "1p")),
            ("torch", ("ddp", "tp", "1p")),
        ):
            for mode in modes:
                case = f"{framework}_{mode}_{model_kind}"
                ratios[f"{case}: compiled / eager"] = ratio(
                    f"{case}_compiled", f"{case}_eager"
                )
        for how in ("eager", "compiled"):
            ratios[f"{model_kind} keras_mp / torch_tp ({how})"] = ratio(
                f"keras_mp_{model_kind}_{how}", f"torch_tp_{model_kind}_{how}"
            )
            ratios[f"{model_kind} keras_dp / torch_ddp ({how})"] = ratio(
                f"keras_dp_{model_kind}_{how}", f"torch_ddp_{model_kind}_{how}"
            )
            keras_over = ratio(
                f"keras_dp_{model_kind}_{how}", f"keras_1p_{model_kind}_{how}"
            )
            torch_over = ratio(
                f"torch_ddp_{model_kind}_{how}", f"torch_1p_{model_kind}_{how}"
            )
            ratios[f"{model_kind} dp overhead keras 2p/1p ({how})"] = keras_over
            ratios[f"{model_kind} dp overhead ddp 2p/1p ({how})"] = torch_over
            ratios[f"{model_kind} dp overhead ratio keras/ddp ({how})"] = (
                round(keras_over / torch_over, 3)
                if keras_over and torch_over
                else None
            )
    compile_report = {
        case: {
            k: ranks[0][k]
            for k in (
                "graphs",
                "graph_breaks",
                "compiled_frames",
                "first_step_ms",
            )
        }
        for case, ranks in runs.items()
        if case.endswith("compiled")
    }
    print("\nmedian step (ms), slower rank, median over rounds:")
    for case in ms:
        print(
            f"  {case:28} {ms[case]:9.2f}   rounds "
            f"{[round(m, 1) for m in rounds_ms[case]]}"
        )
    print("\nratios:")
    for name, value in ratios.items():
        print(f"  {name:42} {value}")
    print(
        "\ncompile (rank 0): graphs / graph breaks / compiled frames / first "
        "step ms"
    )
    for case, rep in compile_report.items():
        print(
            f"  {case:28} {rep['graphs']} / {rep['graph_breaks']} / "
            f"{rep['compiled_frames']} / {rep['first_step_ms']:.0f}"
        )
    _launch.save(
        "compile",
        {
            "benchmark": "compile",
            "machine": _launch.machine(),
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "step_ms": ms,
            "rounds_ms": rounds_ms,
            "ratios": ratios,
            "compile": compile_report,
            "errors": errors,
            "runs": rounds,
        },
    )


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
