"""Peak memory per rank while creating a >= 1 GB Keras model, 2 processes.

    python benchmarks/creation_memory.py [--width 8192] [--layers 4]

Model: Input(width) -> `layers` Dense(width) layers, float32 (4 x 8192 wide:
1.07 GB of weights). Every kernel is sharded on a 1-D ("model",) mesh of 2,
column then row alternately (as Megatron tensor parallelism does); the
column-sharded layers' biases are sharded too, the others' replicated.

Two cases, each in fresh processes (torchrun, 2 ranks) so that peaks do not
mix:
  ours  -- ModelParallel(layout_map=...) set, then the model is built: every
           sharded variable is born sharded (keras_torch_distribution).
  naive -- the same model built without distribution (every rank holds it
           whole), then each weight sharded with
           torch.distributed.tensor.distribute_tensor and put back into its
           variable (the full value is then freed).

Per rank, memory is measured as
  peak RSS sampled every 0.5 ms by a thread (psutil) minus the RSS just before
  creation, and ru_maxrss (resource.getrusage) minus that same baseline;
each is reported as a ratio to the full model's bytes. The target for `ours`
is <= 0.55 (half the model plus transient chunks); one full model is 1.0.
"""

import argparse
import gc
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

TARGET = 0.55


def _model_spec():
    width = int(os.environ.get("BENCH_WIDTH", "8192"))
    layers = int(os.environ.get("BENCH_LAYERS", "4"))
    return width, layers


class PeakSampler:
    """Samples this process's RSS on a thread; `peak` is the largest seen."""

    def __init__(self, interval=0.0005):
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss = self._process.memory_info().rss
            self.samples += 1
            if rss > self.peak:
                self.peak = rss
            time.sleep(self._interval)

    def rss(self):
        return self._process.memory_info().rss

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def _maxrss_bytes():
    import resource

    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # Linux: KiB


def _build(keras, width, layers):
    inputs = keras.Input(shape=(width,), name="x")
    h = inputs
    for i in range(layers):
        h = keras.layers.Dense(width, name=f"dense_{i}")(h)
    return keras.Model(inputs, h, name="big_mlp")


def _layouts(width, layers):
    """variable path -> axes (None: replicated)."""
    axes = {}
    for i in range(layers):
        if i % 2 == 0:  # column parallel
            axes[f"dense_{i}/kernel"] = (None, "model")
            axes[f"dense_{i}/bias"] = ("model",)
        else:  # row parallel
            axes[f"dense_{i}/kernel"] = ("model", None)
    return axes


def _start_worker():
    """What every worker here and in checkpoint_memory.py starts with: one
    thread, the process group; (width, layers, the model's full bytes, this
    rank, the ("model",) mesh over every process)."""
    import keras
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    width, layers = _model_spec()
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
    full_bytes = layers * (width * width + width) * 4
    return width, layers, full_bytes, dist.get_rank(), mesh


def _set_model_parallel(keras, mesh, axes):
    """ModelParallel with `axes` ({variable path: axes}) as its LayoutMap."""
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, entry in axes.items():
        layout_map[path] = entry
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )


def worker(case):
    import keras
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401

    width, layers, full_bytes, rank, mesh = _start_worker()
    axes = _layouts(width, layers)
    if case.startswith("ours"):
        _set_model_parallel(keras, mesh, axes)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import distribute_tensor

        keras.distribution.set_distribution(None)
        torch_mesh = init_device_mesh(
            "cpu", (dist.get_world_size(),), mesh_dim_names=("model",)
        )
    keras.utils.set_random_seed(0)
    gc.collect()
    dist.barrier()
    maxrss_before = _maxrss_bytes()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        baseline = sampler.rss()
        model = _build(keras, width, layers)
        if case == "naive":
            for variable in model.weights:
                entry = axes.get(variable.path)
                if entry is None:
                    continue
                placements = [
                    Shard(entry.index("model"))
                    if "model" in entry
                    else Replicate()
                ]
                sharded = distribute_tensor(
                    variable.value.detach(), torch_mesh, placements
                )
                # Put the shard in place of the full value, and re-track the
                # layers' torch parameters (Keras' TorchLayer keeps its own
                # reference to every variable's value in `_torch_params`), so
                # that the full value is freed.
                variable._value = torch.nn.Parameter(
                    sharded, requires_grad=True
                )
            for layer in model._flatten_layers(include_self=True):
                if hasattr(layer, "_torch_params"):
                    layer._track_variables()
            gc.collect()
        seconds = time.perf_counter() - start
    after = sampler.rss()
    maxrss_after = _maxrss_bytes()

    from torch.distributed.tensor import DTensor

    local_bytes = 0
    for variable in model.weights:
        value = variable.value
        local = value.to_local() if isinstance(value, DTensor) else value
        local_bytes += local.numel() * local.element_size()
    # Sanity: the model computes (a collective forward on every rank).
    x = torch.ones((2, width))
    y = model(x)
    sanity = float(keras.ops.convert_to_numpy(keras.ops.sum(y)))
    result = {
        "case": case,
        "rank": rank,
        "width": width,
        "layers": layers,
        "full_model_bytes": full_bytes,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": sampler.peak,
        "rss_samples": sampler.samples,
        "peak_minus_baseline_bytes": sampler.peak - baseline,
        "ratio_sampled": (sampler.peak - baseline) / full_bytes,
        "maxrss_before_bytes": maxrss_before,
        "maxrss_after_bytes": maxrss_after,
        "maxrss_minus_baseline_bytes": maxrss_after - baseline,
        "ratio_maxrss": (maxrss_after - baseline) / full_bytes,
        "rss_after_bytes": after,
        "ratio_after": (after - baseline) / full_bytes,
        "local_weight_bytes": local_bytes,
        "creation_seconds": seconds,
        "forward_sum": sanity,
        "keras": keras.__version__,
    }
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


CONFIGS = {
    # What a user gets: glibc's default, dynamic mmap threshold. Freed blocks
    # of up to 32 MiB may stay in the heap (resident) after being freed.
    "default_malloc": {},
    # Every allocation >= 1 MiB is its own mmap, returned on free: RSS then
    # follows live tensors, which isolates them from allocator retention.
    "mmap_threshold_1MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
}


def _summarize(ranks):
    return {
        "ratio_sampled_max_over_ranks": max(r["ratio_sampled"] for r in ranks),
        "ratio_maxrss_max_over_ranks": max(r["ratio_maxrss"] for r in ranks),
        "ratio_after_max_over_ranks": max(r["ratio_after"] for r in ranks),
        "peak_minus_baseline_MiB": [
            round(r["peak_minus_baseline_bytes"] / 2**20, 1) for r in ranks
        ],
        "after_minus_baseline_MiB": [
            round((r["rss_after_bytes"] - r["baseline_rss_bytes"]) / 2**20, 1)
            for r in ranks
        ],
        "local_weight_MiB": [
            round(r["local_weight_bytes"] / 2**20, 1) for r in ranks
        ],
        "creation_seconds": [round(r["creation_seconds"], 2) for r in ranks],
        "forward_sum": [r["forward_sum"] for r in ranks],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only ours and naive with the default allocator",
    )
    args = parser.parse_args()
    env = {"BENCH_WIDTH": str(args.width), "BENCH_LAYERS": str(args.layers)}
    full = args.layers * (args.width * args.width + args.width) * 4
    print(
        f"creation memory: {args.layers} x Dense({args.width}), "
        f"{full / 2**30:.3f} GiB float32, 2 processes",
        flush=True,
    )
    plan = [("default_malloc", "ours"), ("default_malloc", "naive")]
    if not args.quick:
        plan += [
            ("mmap_threshold_1MiB", "ours"),
            ("mmap_threshold_1MiB", "naive"),
        ]
    runs = {}
    for config, case in plan:
        runs.setdefault(config, {})[case] = _launch.launch(
            os.path.abspath(__file__),
            case,
            2,
            timeout=150,
            extra_env=dict(env, **CONFIGS[config]),
        )
    summary = {
        config: {case: _summarize(ranks) for case, ranks in cases.items()}
        for config, cases in runs.items()
    }
    headline = summary["default_malloc"]
    ours = headline["ours"]["ratio_sampled_max_over_ranks"]
    naive = headline["naive"]["ratio_sampled_max_over_ranks"]
    payload = {
        "benchmark": "creation_memory",
        "machine": dict(
            _launch.machine(), keras=runs["default_malloc"]["ours"][0]["keras"]
        ),
        "model": {
            "layers": args.layers,
            "width": args.width,
            "full_model_bytes": full,
        },
        "measure": (
            "per rank: (peak RSS, psutil sampled every 0.5 ms) - (RSS just "
            "before creation), over full model bytes; ratio_maxrss uses "
            "ru_maxrss instead of the sampled peak"
        ),
        "target_ratio_ours": TARGET,
        "ratio_ours": ours,
        "ratio_naive": naive,
        "ours_over_naive_peak": ours / naive,
        "meets_target": ours <= TARGET,
        "summary": summary,
        "ranks": runs,
    }
    print(
        f"{'allocator':20} {'case':18} {'rank':>4} {'peak-base MiB':>14} "
        f"{'ratio(sampled)':>15} {'ratio(maxrss)':>14} {'after MiB':>10} "
        f"{'local MiB':>10} {'sec':>6}"
    )
    for config, cases in runs.items():
        for case, ranks in cases.items():
            for r in ranks:
                rss_growth = r["rss_after_bytes"] - r["baseline_rss_bytes"]
                print(
                    f"{config:20} {case:18} {r['rank']:>4} "
                    f"{r['peak_minus_baseline_bytes'] / 2**20:>14.1f} "
                    f"{r['ratio_sampled']:>15.3f} {r['ratio_maxrss']:>14.3f} "
                    f"{rss_growth / 2**20:>10.1f} "
                    f"{r['local_weight_bytes'] / 2**20:>10.1f} "
                    f"{r['creation_seconds']:>6.2f}"
                )
    print(
        f"ours: peak ratio {ours:.3f} (target <= {TARGET}, "
        f"{'met' if ours <= TARGET else 'NOT met'}); naive: {naive:.3f}; "
        f"ours/naive = {ours / naive:.3f}"
    )
    _launch.save("creation_memory", payload)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
