"""What stopping together costs per step (issue 20, item 3).

    python benchmarks/stop_together.py [--steps 40] [--repeats 3]

On several processes `fit` gets `StopTogether` as its last callback
(`_distributed/agreement.py`): after every batch the ranks agree on
`model.stop_training` in one all-reduce of one int32 flag per rank. This
measures it on 2 processes, DataParallel, the 1024 -> 4 x Dense(1024) MLP of
data_parallel.py (Adam, MSE, global batch 256), in `fit` itself (data
pipeline, callbacks and all, `verbose=0`):

- `with`: the package as it is;
- `without`: the same, with StopTogether's agreement replaced by nothing
  (what fit cost before it, and what a rank that stops alone would hang);
- `raw_flag_all_reduce`: the flag's all-reduce alone in raw torch.distributed,
  on the same 2 processes (median of 200).

Per case, each rank's median time per step over the epoch's steps (a
callback timing `on_train_batch_end` to `on_train_batch_end`), the slower
rank's, then the median over the repeats. Reported: `with / without`.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

WIDTH, LAYERS, GLOBAL_BATCH = 1024, 4, 256


def _worker(case, steps):
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    from keras_torch_distribution._distributed import agreement

    torch.set_num_threads(1)
    keras.distribution.initialize()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    if case == "without":
        agreement.StopTogether._agree = lambda self, where: None
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(LAYERS):
        h = keras.layers.Dense(WIDTH, activation="relu")(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * (steps + 3), WIDTH)).astype(
        "float32"
    )
    y = rng.standard_normal((GLOBAL_BATCH * (steps + 3), WIDTH)).astype(
        "float32"
    )

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())

    timer = StepTimes()
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[timer],
    )
    per_step = [b - a for a, b in zip(timer.times[3:], timer.times[4:])]
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    raw = []
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(flags)
        raw.append(time.perf_counter() - start)
    _launch.write_rank_result(
        {
            "step_s": statistics.median(per_step),
            "raw_flag_all_reduce_s": statistics.median(raw),
        }
    )


def worker(case):
    _worker(case, int(os.environ["BENCH_STEPS"]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    script = os.path.abspath(__file__)
    rounds = {"with": [], "without": []}
    for _ in range(args.repeats):
        for case in rounds:
            rounds[case].append(
                _launch.launch(
                    script,
                    case,
                    2,
                    timeout=300,
                    extra_env={"BENCH_STEPS": str(args.steps)},
                )
            )

    def worst(case, key):
        return statistics.median(
            max(r[key] for r in ranks) for ranks in rounds[case]
        )

    result = {
        "machine": _launch.machine(),
        "steps": args.steps,
        "repeats": args.repeats,
        "with_step_s": worst("with", "step_s"),
        "without_step_s": worst("without", "step_s"),
        "raw_flag_all_reduce_s": worst("with", "raw_flag_all_reduce_s"),
        "rounds": rounds,
    }
    result["with_over_without"] = (
        result["with_step_s"] / result["without_step_s"]
    )
    print(
        f"fit step with StopTogether {result['with_step_s'] * 1e3:.2f} ms, "
        f"without {result['without_step_s'] * 1e3:.2f} ms: ratio "
        f"{result['with_over_without']:.3f}; raw flag all-reduce "
        f"{result['raw_flag_all_reduce_s'] * 1e3:.3f} ms"
    )
    _launch.save("stop_together", result)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
