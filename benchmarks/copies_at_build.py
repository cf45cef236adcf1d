"""What making copies equal at build costs (issue 20, item 4).

    python benchmarks/copies_at_build.py [--repeats 3]

Under a distribution the copies of each variable a build creates are made
equal to rank 0's when the build returns (`copies.py`: one agreement
all-gather and one bucketed broadcast per outermost layer call that created
variables). This measures it on 2 processes, DataParallel (every variable
replicated: the most there is to send), against what raw PyTorch pays for
the same: DistributedDataParallel broadcasts a module's parameters and
buffers from rank 0 when it wraps it.

Models: `mlp`, a functional 1024 -> 4 x Dense(1024) MLP (16.0 MiB), and
`llama`, benchmarks/llama_shapes.py's keras_hub LlamaCausalLM (tiny config,
built from its backbone's functional graph), with the torch model of the
same shapes. Per case, on each rank: the build's wall time; of it, the time
spent making copies equal and how many builds broadcast; the same model
built in one plain Keras process; torch: building the module, and wrapping
it in DDP. Reported per model: the slower rank's medians over the repeats,
`equalize_s / ddp_wrap_s` and `build_2p_s / build_1p_s`.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

WIDTH, LAYERS = 1024, 4


def _keras_model(keras, name):
    if name == "mlp":
        inputs = keras.Input(shape=(WIDTH,))
        h = inputs
        for _ in range(LAYERS):
            h = keras.layers.Dense(WIDTH, activation="relu")(h)
        return keras.Model(inputs, h)
    import keras_hub

    import llama_shapes

    return llama_shapes.keras_causal_lm(keras, keras_hub)


def _torch_model(name):
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    import llama_shapes

    return llama_shapes.torch_causal_lm()


def _keras_worker(name, distributed):
    import keras
    import torch

    from keras_torch_distribution._variables import copies

    torch.set_num_threads(1)
    spent = {"equalize_s": 0.0, "broadcasting_builds": 0}
    if distributed:
        import torch.distributed as dist

        keras.distribution.initialize()
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        original = copies.make_built_equal

        def timed(variables):
            start = time.perf_counter()
            count = original(variables)
            spent["equalize_s"] += time.perf_counter() - start
            spent["broadcasting_builds"] += bool(count)
            return count

        copies.make_built_equal = timed
        keras.utils.set_random_seed(1000 + dist.get_rank())
        dist.barrier()
    start = time.perf_counter()
    model = _keras_model(keras, name)
    build_s = time.perf_counter() - start
    params = sum(int(v.numpy().size) for v in model.weights)
    _launch.write_rank_result(dict(spent, build_s=build_s, params=params))


def _torch_worker(name):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(1000 + dist.get_rank())
    dist.barrier()
    start = time.perf_counter()
    module = _torch_model(name)
    build_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    DistributedDataParallel(module)
    wrap_s = time.perf_counter() - start
    params = sum(p.numel() for p in module.parameters())
    _launch.write_rank_result(
        {"build_s": build_s, "ddp_wrap_s": wrap_s, "params": params}
    )
    dist.destroy_process_group()


def worker(case):
    kind, name = case.split(":")
    if kind == "keras_2p":
        _keras_worker(name, True)
    elif kind == "keras_1p":
        _keras_worker(name, False)
    else:
        _torch_worker(name)


def _worst(rounds, key):
    """Median over rounds of the slower rank's value."""
    return statistics.median(
        max(rank[key] for rank in ranks) for ranks in rounds
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp,llama")
    args = parser.parse_args()
    script = os.path.abspath(__file__)
    results = {
        "machine": _launch.machine(),
        "repeats": args.repeats,
        "models": {},
    }
    for name in args.models.split(","):
        rounds = {"keras_2p": [], "keras_1p": [], "torch_ddp": []}
        for _ in range(args.repeats):
            for kind, nproc in (
                ("keras_2p", 2),
                ("keras_1p", 1),
                ("torch_ddp", 2),
            ):
                rounds[kind].append(
                    _launch.launch(script, f"{kind}:{name}", nproc, timeout=300)
                )
        entry = {
            "params": rounds["keras_2p"][0][0]["params"],
            "torch_params": rounds["torch_ddp"][0][0]["params"],
            "build_2p_s": _worst(rounds["keras_2p"], "build_s"),
            "equalize_s": _worst(rounds["keras_2p"], "equalize_s"),
            "broadcasting_builds": rounds["keras_2p"][0][0][
                "broadcasting_builds"
            ],
            "build_1p_s": _worst(rounds["keras_1p"], "build_s"),
            "torch_build_s": _worst(rounds["torch_ddp"], "build_s"),
            "ddp_wrap_s": _worst(rounds["torch_ddp"], "ddp_wrap_s"),
            "rounds": rounds,
        }
        entry["equalize_over_ddp_wrap"] = (
            entry["equalize_s"] / entry["ddp_wrap_s"]
        )
        entry["build_2p_over_1p"] = entry["build_2p_s"] / entry["build_1p_s"]
        results["models"][name] = entry
        print(
            f"{name}: {entry['params']} params; build 2p "
            f"{entry['build_2p_s'] * 1e3:.1f} ms (equalize "
            f"{entry['equalize_s'] * 1e3:.1f} ms in "
            f"{entry['broadcasting_builds']} builds), 1p "
            f"{entry['build_1p_s'] * 1e3:.1f} ms; torch build "
            f"{entry['torch_build_s'] * 1e3:.1f} ms, DDP wrap "
            f"{entry['ddp_wrap_s'] * 1e3:.1f} ms; equalize/DDP wrap "
            f"{entry['equalize_over_ddp_wrap']:.2f}, build 2p/1p "
            f"{entry['build_2p_over_1p']:.2f}"
        )
    _launch.save("copies_at_build", results)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
