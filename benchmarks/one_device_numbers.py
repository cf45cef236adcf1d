"""What one device's numbers cost: the BatchNorm all-reduce and the dropout
slicing per step, and the start-of-training broadcast once.

    python benchmarks/one_device_numbers.py [--steps 20] [--warmup 3]
                                            [--repeats 3]

Cases, each on 2 torchrun processes under DataParallel (global batch split
in two), OMP_NUM_THREADS=1 per process:
  dropout_unseeded -- the benchmark MLP (1024 inputs, 4 Dense(1024), ReLU)
                      with Dropout(0.1) after each hidden layer, global batch
                      256: each replica's rows of one process's masks
                      (torch's global stream drawn whole, 3 x 256 x 1024) vs
                      Keras' own dropout (each replica draws 128 rows of its
                      own: the correlated masks of issue 12).
  dropout_seeded   -- the same with Dropout(0.1, seed=...): the replica
                      draws the stream up to the end of its rows.
  batchnorm        -- a small CNN (32x32x3 -> 3 x [Conv2D(32, 3) +
                      BatchNormalization + ReLU] -> pooling -> Dense(10)),
                      global batch 64: moments over the global batch (one
                      all-reduce per layer forward, one backward) vs each
                      replica's own moments.
Each case also times `replica_start.equalize(model)`, the one-time broadcast
that makes every copy of the model's variables equal before its first step.

Per-step cost, measured two ways: (1) paired and interleaved, one such
layer's forward + backward on the replica's rows (128 x 1024 for dropout,
32 x 32 x 32 x 32 for BatchNormalization) with the feature and with Keras'
own function, 40 times each, alternating; 3 x the median difference is the
cost per step (robust to a loaded machine); (2) whole `fit` steps.

Timing of steps: per-step time of `fit` (the train function between Keras'
on_train_batch_begin and on_train_batch_end, so the data window that fit
sets is in place), `warmup` untimed steps then the median of `steps`; the
two variants alternate `repeats` times in the same processes (which goes
first alternates too); the slower
rank's median per round, then the median over rounds. Results in
benchmarks/results/one_device_numbers.json.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

WIDTH = 1024
LAYERS = 4
MLP_BATCH = 256
CNN_BATCH = 64


@contextlib.contextmanager
def _keras_own(*names):
    """Within the block, Keras' own functions replace this package's
    patches named `names` (e.g. "random.dropout"): the variant without
    the feature being measured."""
    from keras_torch_distribution import _install

    patches = [p for p in _install._installed if p.describe().endswith(names)]
    if len(patches) != len(names):
        raise RuntimeError(f"patches {names} not found")
    bound = [getattr(p.owner, p.name) for p in patches]
    for p in patches:
        setattr(p.owner, p.name, p.original)
    try:
        yield
    finally:
        for p, b in zip(patches, bound):
            setattr(p.owner, p.name, b)


def _mlp(keras, seeded):
    inputs = keras.Input(shape=(WIDTH,))
    h = inputs
    for i in range(LAYERS):
        last = i == LAYERS - 1
        h = keras.layers.Dense(WIDTH, activation=None if last else "relu")(h)
        if not last:
            h = keras.layers.Dropout(0.1, seed=100 + i if seeded else None)(h)
    return keras.Model(inputs, h)


def _cnn(keras):
    inputs = keras.Input(shape=(32, 32, 3))
    h = inputs
    for _ in range(3):
        h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def _layer_cost(case, patch, rank, iterations=40):
    """One layer's forward + backward on this replica's rows, with the
    feature and with Keras' own function, alternating, so that the load of
    the machine weighs on both alike: medians of each and of the paired
    differences (ms)."""
    import keras
    import torch
    import torch.distributed as dist

    from keras_torch_distribution._distributed import replicas

    torch.manual_seed(rank)
    if case == "batchnorm":
        rows = CNN_BATCH // 2
        x = torch.randn(rows, 32, 32, 32, requires_grad=True)
        layer = keras.layers.BatchNormalization()
        layer.build(x.shape)

        def op():
            return layer(x, training=True)
    else:
        rows = MLP_BATCH // 2
        x = torch.randn(rows, WIDTH, requires_grad=True)
        seed = (
            keras.random.SeedGenerator(1) if case == "dropout_seeded" else None
        )

        def op():
            return keras.random.dropout(x, 0.1, seed=seed)

    # The window fit sets for this replica's rows of the global batch.
    replicas.batch_weight.set(1.0, (2 * rows, rank * rows, rows))

    def timed():
        dist.barrier()
        start = time.perf_counter()
        op().sum().backward()
        return time.perf_counter() - start

    with_feature, without = [], []
    try:
        for _ in range(iterations):
            with_feature.append(timed())
            with _keras_own(patch):
                without.append(timed())
    finally:
        replicas.batch_weight.forget()
    pairs = [1e3 * (a - b) for a, b in zip(with_feature, without)]
    return {
        "layer_ms": 1e3 * statistics.median(with_feature),
        "layer_without_ms": 1e3 * statistics.median(without),
        "layer_cost_ms": statistics.median(pairs),
    }


def _worker(case):
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution._training import replica_start

    torch.set_num_threads(1)
    steps = int(os.environ["BENCH_STEPS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    repeats = int(os.environ["BENCH_REPEATS"])
    keras.distribution.initialize()
    rank = dist.get_rank()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    rng = np.random.default_rng(0)
    if case == "batchnorm":
        batch = CNN_BATCH
        x = rng.standard_normal((batch * (warmup + steps), 32, 32, 3)).astype(
            "float32"
        )
        y = rng.standard_normal((len(x), 10)).astype("float32")
        make, patch = (lambda: _cnn(keras)), "BatchNormalization._moments"
    else:
        batch = MLP_BATCH
        x = rng.standard_normal((batch * (warmup + steps), WIDTH)).astype(
            "float32"
        )
        y = rng.standard_normal((len(x), WIDTH)).astype("float32")
        seeded = case == "dropout_seeded"
        make, patch = (lambda: _mlp(keras, seeded)), "random.dropout"

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    def one_fit():
        keras.utils.set_random_seed(0)
        model = make()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        timer = StepTimer()
        dist.barrier()
        model.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        )
        return model, timer.times[warmup:]

    result = {
        "rank": rank,
        "feature_ms": [],
        "without_ms": [],
        "broadcast_ms": [],
    }
    result.update(_layer_cost(case, patch, rank))
    for round_ in range(repeats):
        # Alternate which variant goes first: a round's first fit may pay
        # for what the second reuses.
        for variant in ("feature", "without")[:: 1 if round_ % 2 == 0 else -1]:
            if variant == "feature":
                model, times = one_fit()
            else:
                with _keras_own(patch):
                    _, times = one_fit()
            result[f"{variant}_ms"].append(1e3 * statistics.median(times))
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            replica_start.equalize(model)
            result["broadcast_ms"].append(1e3 * (time.perf_counter() - start))
    result["parameters"] = int(sum(np.prod(v.shape) for v in model.weights))
    result["parameter_bytes"] = int(
        sum(
            np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.weights
        )
    )
    result["keras"] = keras.__version__
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    env = {
        "BENCH_STEPS": str(args.steps),
        "BENCH_WARMUP": str(args.warmup),
        "BENCH_REPEATS": str(args.repeats),
    }
    cases = {}
    for case in ("dropout_unseeded", "dropout_seeded", "batchnorm"):
        ranks = _launch.launch(
            os.path.abspath(__file__), case, 2, timeout=900, extra_env=env
        )
        rounds = len(ranks[0]["feature_ms"])
        feature = statistics.median(
            max(r["feature_ms"][i] for r in ranks) for i in range(rounds)
        )
        without = statistics.median(
            max(r["without_ms"][i] for r in ranks) for i in range(rounds)
        )
        broadcast = statistics.median(max(r["broadcast_ms"]) for r in ranks)
        layer_cost = max(r["layer_cost_ms"] for r in ranks)
        cases[case] = {
            "step_ms": round(feature, 3),
            "step_without_ms": round(without, 3),
            "per_step_cost_ms": round(feature - without, 3),
            "step_ratio": round(feature / without, 4),
            # Paired, interleaved measurement of one layer (see _layer_cost),
            # times the model's 3 such layers: the per-step cost.
            "layer_ms": round(max(r["layer_ms"] for r in ranks), 3),
            "layer_without_ms": round(
                max(r["layer_without_ms"] for r in ranks), 3
            ),
            "per_step_cost_from_layers_ms": round(3 * layer_cost, 3),
            "per_step_cost_from_layers_ratio": round(
                1 + 3 * layer_cost / without, 4
            ),
            "broadcast_once_ms": round(broadcast, 3),
            "broadcast_over_step": round(broadcast / feature, 4),
            "parameters": ranks[0]["parameters"],
            "parameter_bytes": ranks[0]["parameter_bytes"],
            "loadavg_1min": [
                ranks[0]["loadavg_1min_before"],
                ranks[0]["loadavg_1min_after"],
            ],
            "rounds": {
                r["rank"]: {
                    k: r[k]
                    for k in ("feature_ms", "without_ms", "broadcast_ms")
                }
                for r in ranks
            },
        }
        print(
            (
                f"{case}: step {feature:.2f} ms vs {without:.2f} ms without "
                f"({feature / without:.3f}x); 3 layers cost "
                f"{3 * layer_cost:.2f} ms per step "
                f"({1 + 3 * layer_cost / without:.3f}x); broadcast once "
                f"{broadcast:.2f} ms"
            ),
            flush=True,
        )
    payload = {
        "benchmark": "one_device_numbers",
        "machine": dict(_launch.machine(), keras=ranks[0]["keras"]),
        "processes": 2,
        "distribution": "DataParallel",
        "mlp": {
            "layers": LAYERS,
            "width": WIDTH,
            "global_batch": MLP_BATCH,
            "dropout": "0.1 after each hidden layer",
        },
        "cnn": {
            "input": [32, 32, 3],
            "blocks": "3 x Conv2D(32, 3) + BatchNormalization + ReLU",
            "global_batch": CNN_BATCH,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "cases": cases,
    }
    _launch.save("one_device_numbers", payload)


if __name__ == "__main__":
    _launch.main_or_worker(main, _worker)
