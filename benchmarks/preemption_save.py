"""What a preemption costs: seconds from the signal to the exit, and the
backup's size, next to raw torch.distributed.checkpoint saving the same
state (issue 31).

    python benchmarks/preemption_save.py [--width 2048] [--layers 4]
        [--repeats 3]

2 processes, DataParallel, the WIDTH -> LAYERS x Dense(WIDTH) MLP (Adam,
MSE, global batch 64), `fit` with `BackupAndRestore`. After its third
batch rank 1 sends itself SIGTERM; every rank agrees at that step, writes
the backup, and raises `Preempted`:

- `ours`: per rank, seconds from the signal (rank 1's clock, sent to the
  others in a file before the signal) to `Preempted` caught, and the
  backup's bytes on disk;
- `raw`: the same model in raw torch (`nn.Sequential` of `nn.Linear`,
  `torch.optim.Adam` after one step), its model and optimizer state saved
  with `torch.distributed.checkpoint.save` on the same 2 processes:
  seconds for the save, and its bytes.

Reported: `ours / raw` of the seconds (the slower rank's, median over
repeats), and both sizes.
"""

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402

GLOBAL_BATCH = 64


def _bytes(path):
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def _ours(width, layers, directory):
    import keras
    import numpy as np
    import torch

    from keras_torch_distribution import Preempted
    from keras_torch_distribution._processes import runtime

    torch.set_num_threads(1)
    keras.distribution.initialize()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(layers):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((GLOBAL_BATCH * 8, width)).astype("float32")
    stamp = os.path.join(directory, "signal_time")

    class Signal(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and runtime.process_id() == 1:
                with open(stamp + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.rename(stamp + ".tmp", stamp)
                os.kill(os.getpid(), signal.SIGTERM)

    backup = os.path.join(directory, "backup")
    try:
        model.fit(
            x,
            x,
            batch_size=GLOBAL_BATCH,
            epochs=1,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Signal()],
        )
    except Preempted as preempted:
        caught = time.time()
        code = preempted.code
    else:
        raise RuntimeError("fit ended without the preemption")
    with open(stamp) as f:
        sent = float(f.read())
    _launch.write_rank_result(
        {
            "signal_to_exit_s": caught - sent,
            "exit_code": code,
            "backup_bytes": _bytes(os.path.join(backup, "latest.ckpt")),
        }
    )


def _raw(width, layers, directory):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            module
            for _ in range(layers)
            for module in (nn.Linear(width, width), nn.ReLU())
        ]
    )
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(GLOBAL_BATCH // 2, width)
    step = _launch.torch_step(model, optimizer, x, x)
    step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    path = os.path.join(directory, "raw")
    dist.barrier()
    start = time.time()
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    seconds = time.time() - start
    _launch.write_rank_result({"save_s": seconds, "bytes": _bytes(path)})
    dist.destroy_process_group()


def worker(case):
    width = int(os.environ["BENCH_WIDTH"])
    layers = int(os.environ["BENCH_LAYERS"])
    directory = os.environ["BENCH_DIR"]
    (_ours if case == "ours" else _raw)(width, layers, directory)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    script = os.path.abspath(__file__)
    rounds = {"ours": [], "raw": []}
    for _ in range(args.repeats):
        for case in rounds:
            directory = tempfile.mkdtemp(prefix="ktd-preempt-")
            try:
                rounds[case].append(
                    _launch.launch(
                        script,
                        case,
                        2,
                        timeout=600,
                        extra_env={
                            "BENCH_WIDTH": str(args.width),
                            "BENCH_LAYERS": str(args.layers),
                            "BENCH_DIR": directory,
                        },
                    )
                )
            finally:
                shutil.rmtree(directory)

    def worst(case, key):
        return statistics.median(
            max(r[key] for r in ranks) for ranks in rounds[case]
        )

    result = {
        "machine": _launch.machine(),
        "width": args.width,
        "layers": args.layers,
        "parameters": args.layers * (args.width * args.width + args.width),
        "ours_signal_to_exit_s": worst("ours", "signal_to_exit_s"),
        "ours_backup_bytes": rounds["ours"][0][0]["backup_bytes"],
        "raw_dcp_save_s": worst("raw", "save_s"),
        "raw_dcp_bytes": rounds["raw"][0][0]["bytes"],
        "rounds": rounds,
    }
    result["ours_over_raw"] = (
        result["ours_signal_to_exit_s"] / result["raw_dcp_save_s"]
    )
    mib = 2**20
    print(
        f"signal to exit {result['ours_signal_to_exit_s']:.2f} s (backup "
        f"{result['ours_backup_bytes'] / mib:.1f} MiB); raw DCP save "
        f"{result['raw_dcp_save_s']:.2f} s "
        f"({result['raw_dcp_bytes'] / mib:.1f} MiB): ratio "
        f"{result['ours_over_raw']:.2f}"
    )
    _launch.save("preemption_save", result)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
