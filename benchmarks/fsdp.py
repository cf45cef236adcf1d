"""Variables sharded on the batch axis (FSDP, this package) vs torch FSDP2.

    python benchmarks/fsdp.py [--steps 20] [--warmup 3] [--repeats 1]
                              [--memory-steps 3] [--memory-rounds 1]
                              [--models mlp,block,2x2,llama]
                              [--profile torch|cprofile]

Cases (fresh torchrun processes each, gloo, CPU, OMP_NUM_THREADS=1), every
process computing on its own rows of the global batch:
  keras_fsdp_mlp    x2  the 1024 -> 4 x Dense(1024) MLP of data_parallel.py
                        (MSE, Adam(1e-3), global batch 256, 128 rows per
                        rank): ModelParallel on a 1-D ("model",) mesh (its
                        batch axis is that axis), every kernel
                        ("model", None) and bias ("model",): all FSDP.
  torch_fsdp2_mlp   x2  the same MLP as nn.Linear, `fully_shard` on each
                        nn.Linear and on the root, torch.optim.Adam.
  keras_fsdp_block  x2  compile.py's transformer block (global batch 32 x 64
                        tokens, width 256, 4 heads, MLP 1024; 16 rows per
                        rank), every kernel sharded on dim 0 on the batch
                        axis; biases and LayerNorm weights replicated
                        (their gradients all-reduced over the batch axis).
  torch_fsdp2_block x2  compile.py's raw torch block, `fully_shard` on each
                        nn.Linear and the root (which holds the LayerNorms).
  keras_fsdp_2x2    x4  the MLP on a 2 x 2 ("batch", "model") mesh:
                        ModelParallel(batch_dim_name="batch") with the
                        Megatron map whose kernels' other dim is on "batch"
                        (column kernels ("batch", "model"), row kernels
                        ("model", "batch"); column biases ("model",), row
                        biases replicated); 128 rows per batch coordinate.
  torch_fsdp2_2x2   x4  a 2-D init_device_mesh ("dp", "tp"):
                        parallelize_module (Colwise 0, 2 / Rowwise 1, 3) on
                        the tp sub-mesh, then `fully_shard` on each nn.Linear
                        and the root on the dp sub-mesh (torchtitan's order).
  keras_fsdp_llama  x2  keras_hub LlamaCausalLM, tiny config (llama_shapes.py:
                        vocabulary 2048, hidden 128, 4 decoder blocks, 4
                        query / 2 key-value heads, feed-forward 384; 64
                        tokens, global batch 8, 4 rows per rank), under its
                        own LlamaBackbone.get_layout_map on a (2, 1)
                        ("batch", "model") mesh: the map's batch-axis dims
                        FSDP; Adam(1e-3), sparse cross-entropy from logits.
  torch_fsdp2_llama x2  a torch model of the same shapes, `fully_shard` on
                        each decoder block and on the root (embedding,
                        final norm, output projection), torch.optim.Adam.
The block and the MLP are compile.py's definitions (imported, not copied).
Torch Linear weights are Glorot-uniform with zero biases, as Keras' Dense
(only so that the final losses can be compared for sanity).

Every case is launched in two kinds of fresh processes; per rank:
  timing launches (glibc's default allocator, what users get): `warmup`
      untimed steps, then the median wall time of `steps` timed steps, and
      the process's CPU time per step (Keras: model.train_function(
      [(x_local, y_local)]) on prebuilt per-rank batches after one fit
      step; torch: zero_grad / forward / MSE / backward / step, after one
      untimed step to match the fit step). Also the bytes of the local parts
      of parameters and optimizer state (Keras: all optimizer.variables;
      torch: Adam's exp_avg, exp_avg_sq, step), and the final loss: that of
      one more step on the global batch (Keras: metrics reset first, so not
      the epoch's running mean; torch: the ranks' losses averaged). And
      the collectives the rank issues in one more step, by kind
      (keras_torch_distribution.plan._collective_counts: all-gathers,
      reduce-scatters, all-reduces, whatever issues them: FSDP, tensor
      parallelism, gradient and metric sync), and the aten ops of one more
      step, all and those that are not views (about the kernels a GPU
      would run; keras_torch_distribution._op_counts): exact counts, the
      same on any machine.
  memory launches (MALLOC_MMAP_THRESHOLD_=1048576: every allocation
      >= 1 MiB is its own mmap, returned on free, so RSS follows live
      tensors): `warmup` steps, then `memory-steps` steps with a thread
      sampling RSS every 0.5 ms (creation_memory.PeakSampler): peak RSS
      minus the RSS just before them (parameters, optimizer state and inputs
      are in that baseline: the figure is what a step adds); and the
      kernel's peak RSS (VmHWM, reset through /proc/self/clear_refs just
      before those steps) minus the same baseline. Timing is not taken
      here: under that threshold every large allocation is a fresh mmap
      (an allocating 4 MiB multiply: ~10 ms instead of ~1 ms), so step
      times would count page faults (reported as step_ms_mmap_allocator).
`--repeats` rounds of timing launches, every case once per round,
interleaved; `--memory-rounds` (in the first rounds) of memory launches. A
launch's figure is the worse rank's, a case's the median over rounds.
Ratios are keras / torch. Targets (issue 18): collectives per step at
most FSDP2's, step time and peak memory at most 1.05x FSDP2's. `--profile`: 5
more steps after the timed ones under torch.profiler or cProfile, rank 0's table
written to results/fsdp_profile_<case>_<how>.txt (torch: sorted by
BENCH_PROFILE_SORT, default cpu_time_total, e.g. self_cpu_time_total; cProfile:
also the raw stats in results/fsdp_profile_<case>.pstats, and the callers of the
functions matching the regex BENCH_PROFILE_CALLERS when set).
Results: benchmarks/results/fsdp.json.
"""

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
import compile as compile_benchmark  # noqa: E402  (the models)
import llama_shapes  # noqa: E402
from creation_memory import PeakSampler  # noqa: E402

MODELS = {"mlp": 2, "block": 2, "2x2": 4, "llama": 2}  # model -> processes
# Timing runs under glibc's default allocator (what users get); memory under
# a fixed 1 MiB mmap threshold, so that RSS follows live tensors. (The
# threshold makes every large allocation a fresh mmap: an allocating 4 MiB
# multiply costs ~10 ms instead of ~1 ms here, which would time page faults.)
PHASE_ENV = {"time": {}, "memory": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}
STEP_TARGET, MEMORY_TARGET = 1.05, 1.05
KEYS = (
    ("time", "step_ms"),
    ("time", "cpu_ms"),
    ("time", "state_mib"),
    ("memory", "peak_mib"),
    ("memory", "hwm_mib"),
    ("memory", "step_ms_mmap_allocator"),
)


def _global_arrays(model_kind):
    if model_kind == "llama":
        return llama_shapes.arrays()
    c = compile_benchmark
    if model_kind == "block":
        shape = (c.BLOCK_BATCH, c.SEQ, c.DMODEL)
    else:
        shape = (c.GLOBAL_BATCH, c.WIDTH)
    return c._arrays(shape, shape)


def _rows(array, replica, replicas):
    per = len(array) // replicas
    return array[replica * per : (replica + 1) * per]


def _local_bytes(tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _vm_hwm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def _reset_vm_hwm():
    """Reset the kernel's peak RSS of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _measure(step, barrier, phase, steps, warmup, memory_steps):
    """phase "time": wall and CPU time of `steps` steps after `warmup`,
    then the collectives of one more step; phase "memory": the peak RSS of
    `memory_steps` steps after `warmup` (and their wall time, under the
    memory phase's allocator)."""
    import time

    from keras_torch_distribution import _op_counts
    from keras_torch_distribution.plan import _collective_counts

    _launch.time_steps(step, warmup, 0, barrier)
    if phase == "time":
        cpu_started = time.process_time()
        result = _launch.summary(_launch.time_steps(step, 0, steps))
        # This process's CPU time (all its threads) per step: less moved by
        # other work on the machine than wall time, which also counts waiting.
        result["cpu_ms_per_step"] = (
            1e3 * (time.process_time() - cpu_started) / steps
        )
        with _collective_counts.counting() as counts:
            step()
        result["collectives_per_step"] = counts
        # Exact, machine-independent: the aten ops of one step, and those
        # that are not views (about the kernels a GPU would run).
        with _op_counts.count_ops() as ops:
            step()
        result["ops_per_step"] = ops.total
        result["kernels_per_step"] = ops.kernels
        if os.environ.get("BENCH_PROFILE"):
            _profile(step, barrier, os.environ["BENCH_PROFILE"])
        return result
    gc.collect()
    barrier()
    hwm_reset = _reset_vm_hwm()
    with PeakSampler() as sampler:
        baseline = sampler.rss()
        times = _launch.time_steps(step, 0, memory_steps)
    hwm = _vm_hwm_bytes() if hwm_reset else None
    return {
        "median_ms_sampled": 1e3 * statistics.median(times),
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": sampler.peak,
        "peak_minus_baseline_bytes": sampler.peak - baseline,
        "rss_samples": sampler.samples,
        "hwm_minus_baseline_bytes": None if hwm is None else hwm - baseline,
        "memory_steps": memory_steps,
    }


def _profile(step, barrier, how, steps=5):
    """`--profile`: `steps` more steps under torch.profiler or cProfile;
    rank 0 writes the table to results/fsdp_profile_<case>_<how>.txt."""
    import torch

    barrier()
    if how == "torch":
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(steps):
                step()
        table = prof.key_averages().table(
            sort_by=os.environ.get("BENCH_PROFILE_SORT", "cpu_time_total"),
            row_limit=60,
        )
    else:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        if torch.distributed.get_rank() == 0:
            os.makedirs(_launch.RESULTS, exist_ok=True)
            profiler.dump_stats(
                os.path.join(
                    _launch.RESULTS,
                    f"fsdp_profile_{os.environ['BENCH_WORKER']}.pstats",
                )
            )
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        stats.print_stats(70)
        stats.sort_stats("tottime").print_stats(40)
        if os.environ.get("BENCH_PROFILE_CALLERS"):
            stats.print_callers(os.environ["BENCH_PROFILE_CALLERS"])
        table = out.getvalue()
    if torch.distributed.get_rank() == 0:
        os.makedirs(_launch.RESULTS, exist_ok=True)
        name = f"fsdp_profile_{os.environ['BENCH_WORKER']}_{how}.txt"
        with open(os.path.join(_launch.RESULTS, name), "w") as f:
            f.write(f"{steps} steps, rank 0\n{table}")
    barrier()


def _keras_layout_map(keras, mesh, model_kind):
    if model_kind == "2x2":
        return _launch.megatron_mlp_layout_map(
            keras, mesh, compile_benchmark.LAYERS, other="batch"
        )
    layout_map = keras.distribution.LayoutMap(mesh)
    if model_kind == "mlp":
        layout_map[r"dense_\d+/kernel"] = ("model", None)
        layout_map[r"dense_\d+/bias"] = ("model",)
        return layout_map
    for name in ("query", "key", "value", "attention_output"):
        layout_map[f"mha/{name}/kernel"] = ("model", None, None)
    for name in ("ffn_up", "ffn_down"):
        layout_map[f"{name}/kernel"] = ("model", None)
    return layout_map


def llama_distribution(keras, keras_hub, devices):
    """FSDP for the keras_hub Llama: a (world, 1) ("batch", "model") mesh
    under keras_hub's own layout map (its kernels sharded on the batch
    axis)."""
    mesh = keras.distribution.DeviceMesh(
        (len(devices), 1), ["batch", "model"], devices
    )
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
        batch_dim_name="batch",
    )


def keras_step(keras, model, x, y, replica, replicas):
    """(Keras' per-step function, the batch it takes): one short fit on the
    global batch (each replica takes its rows) builds the optimizer and
    installs the step function; the batch is this replica's rows."""
    import torch

    model.fit(x, y, batch_size=len(y), epochs=1, steps_per_epoch=1, verbose=0)
    model.make_train_function()
    batch = [
        (
            keras.tree.map_structure(
                lambda a: torch.as_tensor(_rows(a, replica, replicas)), x
            ),
            torch.as_tensor(_rows(y, replica, replicas)),
        )
    ]
    return model.train_function, batch


def fully_shard_llama(model, dp_mesh):
    """FSDP2 on the torch Llama: `fully_shard` on each decoder block, then
    on the root (the embedding, final norm and output projection)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def _keras_worker(model_kind, phase, steps, warmup, memory_steps):
    import keras
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import keras_torch_distribution  # noqa: F401

    torch.set_num_threads(1)
    keras.distribution.initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    devices = keras.distribution.list_devices()
    if model_kind == "llama":
        import keras_hub

        replicas, replica = world, rank
        distribution = llama_distribution(keras, keras_hub, devices)
    elif model_kind == "2x2":
        replicas = 2
        mesh = keras.distribution.DeviceMesh(
            (replicas, world // replicas), ["batch", "model"], devices
        )
        replica = rank // (world // replicas)  # devices fill the mesh row-major
        distribution = keras.distribution.ModelParallel(
            layout_map=_keras_layout_map(keras, mesh, model_kind),
            batch_dim_name="batch",
        )
    else:
        replicas, replica = world, rank
        mesh = keras.distribution.DeviceMesh((world,), ["model"], devices)
        # The batch axis defaults to the mesh's one axis, "model".
        distribution = keras.distribution.ModelParallel(
            layout_map=_keras_layout_map(keras, mesh, model_kind)
        )
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    x, y = _global_arrays(model_kind)
    if model_kind == "llama":
        model = llama_shapes.keras_causal_lm(keras, keras_hub)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[],
        )
        x = llama_shapes.keras_inputs(x)
    else:
        if model_kind == "block":
            model = compile_benchmark._keras_block(keras)
        else:
            model = compile_benchmark._keras_mlp(keras)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    function, batch = keras_step(keras, model, x, y, replica, replicas)
    result = _measure(
        lambda: function(batch),
        dist.barrier,
        phase,
        steps,
        warmup,
        memory_steps,
    )
    model.reset_metrics()  # the next loss is that step's, not a running mean
    logs = function(batch)
    result.update(
        rank=rank,
        keras=keras.__version__,
        replica=replica,
        replicas=replicas,
        rows_per_rank=int(batch[0][1].shape[0]),
        param_bytes=sum(
            _local_bytes(v.value) for v in model.trainable_variables
        ),
        optimizer_state_bytes=sum(
            _local_bytes(v.value) for v in model.optimizer.variables
        ),
        full_param_bytes=sum(
            int(v.value.numel()) * 4 for v in model.trainable_variables
        ),
        sharded_variables={
            v.path: [str(p) for p in v.value.placements]
            for v in model.trainable_variables
            if isinstance(v.value, DTensor)
        },
        final_loss=float(keras.ops.convert_to_numpy(logs["loss"])),
    )
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def _torch_worker(model_kind, phase, steps, warmup, memory_steps):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if model_kind == "llama":
        model = llama_shapes.torch_causal_lm()
    else:
        model = compile_benchmark._torch_model(
            "block" if model_kind == "block" else "mlp"
        )
    for module in model.modules():  # Keras Dense's init, for the sanity check
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    if model_kind == "2x2":
        from torch.distributed.tensor.parallel import parallelize_module

        replicas = 2
        mesh = init_device_mesh(
            "cpu", (replicas, world // replicas), mesh_dim_names=("dp", "tp")
        )
        model = parallelize_module(
            model, mesh["tp"], compile_benchmark._torch_tp_plan("mlp")
        )
        dp_mesh = mesh["dp"]
        replica = dp_mesh.get_local_rank()
    else:
        replicas, replica = world, rank
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if model_kind == "llama":
        fully_shard_llama(model, dp_mesh)
    else:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = (
        torch.as_tensor(_rows(a, replica, replicas))
        for a in _global_arrays(model_kind)
    )
    if model_kind == "llama":
        step = llama_shapes.torch_train_step(
            model, optimizer, x.long(), y.long()
        )
    else:
        step = _launch.torch_step(model, optimizer, x, y)
    step()  # as Keras' one fit step: builds Adam's state
    result = _measure(step, dist.barrier, phase, steps, warmup, memory_steps)
    step()
    loss = step.last_loss.detach().clone()
    dist.all_reduce(loss)  # the ranks' mean: the global batch's loss
    result.update(
        rank=rank,
        replica=replica,
        replicas=replicas,
        rows_per_rank=len(x),
        param_bytes=sum(_local_bytes(p) for p in model.parameters()),
        optimizer_state_bytes=sum(
            _local_bytes(t)
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        ),
        full_param_bytes=sum(p.numel() * 4 for p in model.parameters()),
        final_loss=float(loss) / world,
    )
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def worker(case):
    framework, model_kind = case.split("_")[0], case.rsplit("_", 1)[1]
    args = (
        model_kind,
        os.environ["BENCH_PHASE"],
        int(os.environ["BENCH_STEPS"]),
        int(os.environ["BENCH_WARMUP"]),
        int(os.environ["BENCH_MEMORY_STEPS"]),
    )
    if framework == "keras":
        _keras_worker(*args)
    else:
        _torch_worker(*args)


def _mib(n):
    return None if n is None else round(n / 2**20, 2)


def _time_figures(ranks):
    """One timing launch: the worse rank's figures."""
    return {
        "step_ms": max(r["median_ms"] for r in ranks),
        "cpu_ms": max(r["cpu_ms_per_step"] for r in ranks),
        "state_mib": _mib(
            max(r["param_bytes"] + r["optimizer_state_bytes"] for r in ranks)
        ),
        "final_loss": ranks[0]["final_loss"],
        "loadavg": [
            ranks[0]["loadavg_1min_before"],
            ranks[0]["loadavg_1min_after"],
        ],
        "ops_per_step": max(r["ops_per_step"] for r in ranks),
        "kernels_per_step": max(r["kernels_per_step"] for r in ranks),
        # The most any rank issued, by kind.
        "collectives_per_step": {
            kind: max(r["collectives_per_step"].get(kind, 0) for r in ranks)
            for kind in sorted(
                {k for r in ranks for k in r["collectives_per_step"]}
            )
        },
    }


def _memory_figures(ranks):
    """One memory launch: the worse rank's figures."""
    hwm = [r["hwm_minus_baseline_bytes"] for r in ranks]
    return {
        "peak_mib": _mib(max(r["peak_minus_baseline_bytes"] for r in ranks)),
        "hwm_mib": None if None in hwm else _mib(max(hwm)),
        "step_ms_mmap_allocator": max(r["median_ms_sampled"] for r in ranks),
        "loadavg": [
            ranks[0]["loadavg_1min_before"],
            ranks[0]["loadavg_1min_after"],
        ],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of all cases' timing launches, "
        "interleaved; each case reports the median over "
        "rounds",
    )
    parser.add_argument(
        "--memory-rounds",
        type=int,
        default=1,
        help="memory launches per case, in the first rounds",
    )
    parser.add_argument(
        "--models",
        default="mlp,block,2x2,llama",
        help="comma-separated subset of " + ",".join(MODELS),
    )
    parser.add_argument(
        "--profile",
        choices=("torch", "cprofile"),
        help="after the timed steps, profile 5 more; rank 0 "
        "writes results/fsdp_profile_<case>_<how>.txt",
    )
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            parser.error(
                f"--models: unknown {m!r}; choose from {sorted(MODELS)}"
            )
    env = dict(
        BENCH_STEPS=str(args.steps),
        BENCH_WARMUP=str(args.warmup),
        BENCH_MEMORY_STEPS=str(args.memory_steps),
    )
    if args.profile:
        env["BENCH_PROFILE"] = args.profile
    print(
        f"fsdp: {models}, {args.steps} timed steps after {args.warmup}, "
        f"{args.repeats} round(s); memory: {args.memory_steps} steps, "
        f"{args.memory_rounds} round(s)",
        flush=True,
    )
    launches = {"time": {}, "memory": {}}
    errors = {}
    for round_index in range(max(args.repeats, args.memory_rounds)):
        for model_kind in models:
            phases = [
                p
                for p, n in (
                    ("time", args.repeats),
                    ("memory", args.memory_rounds),
                )
                if round_index < n
            ]
            for phase in phases:
                for framework in ("keras_fsdp", "torch_fsdp2"):
                    case = f"{framework}_{model_kind}"
                    try:
                        ranks = _launch.launch(
                            os.path.abspath(__file__),
                            case,
                            MODELS[model_kind],
                            timeout=400,
                            extra_env=dict(
                                env, BENCH_PHASE=phase, **PHASE_ENV[phase]
                            ),
                        )
                    except RuntimeError as error:  # recorded, the run goes on
                        errors.setdefault(f"{case} {phase}", []).append(
                            str(error)[-3000:]
                        )
                        print(
                            f"  {case} {phase} FAILED: {str(error)[-800:]}",
                            flush=True,
                        )
                        continue
                    launches[phase].setdefault(case, []).append(ranks)
    figures = {
        case: {
            "time": [_time_figures(r) for r in launches["time"].get(case, [])],
            "memory": [
                _memory_figures(r) for r in launches["memory"].get(case, [])
            ],
        }
        for case in sorted(set(launches["time"]) | set(launches["memory"]))
    }

    def median(case, phase, key):
        values = [f[key] for f in figures[case][phase] if f[key] is not None]
        return statistics.median(values) if values else None

    medians = {
        case: {key: median(case, phase, key) for phase, key in KEYS}
        for case in figures
    }
    ratios = {}
    for model_kind in models:
        ours, theirs = f"keras_fsdp_{model_kind}", f"torch_fsdp2_{model_kind}"
        if ours not in medians or theirs not in medians:
            continue
        ratios[model_kind] = {
            key: (
                round(medians[ours][key] / medians[theirs][key], 3)
                if medians[ours][key] and medians[theirs][key]
                else None
            )
            for _, key in KEYS
        }
        # The step ratio of each round (the two launched one after the
        # other), and their median: less moved by the load drifting.
        per_round = [
            round(a["step_ms"] / b["step_ms"], 3)
            for a, b in zip(figures[ours]["time"], figures[theirs]["time"])
        ]
        ratios[model_kind]["step_ms_per_round"] = per_round
        ratios[model_kind]["step_ms_median_of_round_ratios"] = (
            statistics.median(per_round) if per_round else None
        )
        ratios[model_kind]["final_loss"] = [
            figures[c]["time"][-1]["final_loss"] if figures[c]["time"] else None
            for c in (ours, theirs)
        ]
        for count in ("ops_per_step", "kernels_per_step"):
            ratios[model_kind][count] = {
                side: figures[c]["time"][-1][count]
                if figures[c]["time"]
                else None
                for side, c in (("keras", ours), ("torch", theirs))
            }
        ratios[model_kind]["collectives_per_step"] = {
            side: figures[c]["time"][-1]["collectives_per_step"]
            if figures[c]["time"]
            else None
            for side, c in (("keras", ours), ("torch", theirs))
        }

    def fmt(value, digits=1):
        return "   n/a" if value is None else f"{value:.{digits}f}"

    print(
        "\nper case (worse rank, median over rounds): step ms | CPU ms/step | "
        "peak-baseline MiB sampled | VmHWM-baseline MiB | params+optimizer "
        "state MiB/rank | step ms under the mmap allocator"
    )
    for case, m in medians.items():
        print(
            f"  {case:20} {fmt(m['step_ms']):>8} | {fmt(m['cpu_ms']):>7} | "
            f"{fmt(m['peak_mib']):>6} | {fmt(m['hwm_mib']):>6} | "
            f"{fmt(m['state_mib'], 2):>6} | "
            f"{fmt(m['step_ms_mmap_allocator']):>7}   rounds ms "
            f"{[round(f['step_ms'], 1) for f in figures[case]['time']]} load "
            f"{[f['loadavg'] for f in figures[case]['time']]}"
        )
    print("\nkeras / torch:")
    for model_kind, r in ratios.items():
        print(
            f"  {model_kind:6} step {r['step_ms']} (target <= {STEP_TARGET}; "
            f"per round {r['step_ms_per_round']})  cpu {r['cpu_ms']}  "
            f"peak {r['peak_mib']} / hwm {r['hwm_mib']} (target <= "
            f"{MEMORY_TARGET})  state {r['state_mib']}  final losses "
            f"{[None if v is None else round(v, 4) for v in r['final_loss']]}"
        )
        print(
            f"         aten ops per step: keras {r['ops_per_step']['keras']} "
            f"torch {r['ops_per_step']['torch']}; not views (kernels): keras "
            f"{r['kernels_per_step']['keras']} torch "
            f"{r['kernels_per_step']['torch']}"
        )
        print(
            f"         collectives per step: keras "
            f"{r['collectives_per_step']['keras']}  torch "
            f"{r['collectives_per_step']['torch']}"
        )
    _launch.save(
        "fsdp",
        {
            "benchmark": "fsdp",
            "machine": _launch.machine(),
            "steps": args.steps,
            "warmup": args.warmup,
            "memory_steps": args.memory_steps,
            "repeats": args.repeats,
            "memory_rounds": args.memory_rounds,
            "phase_env": PHASE_ENV,
            "medians": medians,
            "ratios": ratios,
            "rounds": figures,
            "collectives_per_step": {
                m: r["collectives_per_step"] for m, r in ratios.items()
            },
            "targets": {"step": STEP_TARGET, "peak_memory": MEMORY_TARGET},
            "errors": errors,
            "launches": launches,
        },
    )


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
