"""What checksums cost: sharded checkpoint save and load times with and without.

    python benchmarks/checkpoint_checksum.py [--width 2048] [--layers 6]
                                             [--repeats 7]

Model: Input(width) -> `layers` Dense(width), float32, no optimizer
(6 x 2048: 96 MiB of weights), kernels column / row sharded alternately on
2 processes (torchrun, gloo), so each rank writes about half of it.

Every rank records the size and CRC-32 of each file it writes, computed
while writing (`checkpoint._streams._HashingStream`), and `load` verifies each
file it reads first. Timed, alternately, `repeats` times each:
  save with checksums    -- `checkpoint.save` as shipped;
  save without checksums -- the same with `_streams.CHECKSUMS_ON_SAVE = False`
                            (the marker then lists no files);
  load verified          -- `checkpoint.load` of the first (every file read
                            once more for its CRC-32 before DCP reads it);
  load unverified        -- `checkpoint.load` of the second.
Each time is the slower rank's (the call is collective); the medians and
their ratios go to benchmarks/results/checkpoint_checksum.json, with the
single-thread throughput of zlib.crc32 on this machine.
"""

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
from creation_memory import _build  # noqa: E402
from creation_memory import _layouts  # noqa: E402
from creation_memory import _set_model_parallel  # noqa: E402
from creation_memory import _start_worker  # noqa: E402


def _crc32_mib_per_s():
    import zlib

    data = os.urandom(64 * 2**20)
    zlib.crc32(data)
    start = time.perf_counter()
    zlib.crc32(data)
    return 64 / (time.perf_counter() - start)


def worker(case):
    import keras
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution import checkpoint
    from keras_torch_distribution._log import logger
    from keras_torch_distribution.checkpoint import _streams

    logger.setLevel(logging.ERROR)  # the unverified checkpoint warns on load
    width, layers, full_bytes, rank, mesh = _start_worker()
    _set_model_parallel(keras, mesh, _layouts(width, layers))
    keras.utils.set_random_seed(0)
    model = _build(keras, width, layers)
    directory = os.environ["BENCH_CHECKPOINT"]
    paths = {
        True: os.path.join(directory, "with"),
        False: os.path.join(directory, "without"),
    }
    repeats = int(os.environ["BENCH_REPEATS"])

    def timed(call):
        dist.barrier()
        start = time.perf_counter()
        call()
        seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's
        return float(seconds)

    def save(checksums):
        _streams.CHECKSUMS_ON_SAVE = checksums
        try:
            checkpoint.save(model, paths[checksums])
        finally:
            _streams.CHECKSUMS_ON_SAVE = True

    times = {
        "save_with": [],
        "save_without": [],
        "load_with": [],
        "load_without": [],
    }
    for flag in (True, False):  # warm-up: first writes, imports, page cache
        save(flag)
        checkpoint.load(model, paths[flag])
    for repeat in range(repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        for flag in order:
            name = "with" if flag else "without"
            times[f"save_{name}"].append(timed(lambda: save(flag)))
        for flag in order:
            name = "with" if flag else "without"
            times[f"load_{name}"].append(
                timed(lambda: checkpoint.load(model, paths[flag]))
            )
    marker = checkpoint.read_marker(paths[True])
    _launch.write_rank_result(
        {
            "rank": rank,
            "width": width,
            "layers": layers,
            "full_model_bytes": full_bytes,
            "files": marker["files"],
            "times_s": times,
            "crc32_MiB_per_s": _crc32_mib_per_s(),
            "keras": keras.__version__,
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    full = args.layers * (args.width * args.width + args.width) * 4
    print(
        f"checkpoint checksums: {args.layers} x Dense({args.width}), "
        f"{full / 2**20:.1f} MiB float32, 2 processes, {args.repeats} repeats",
        flush=True,
    )
    directory = tempfile.mkdtemp(prefix="ktd-checksum-bench-")
    try:
        ranks = _launch.launch(
            os.path.abspath(__file__),
            "checksums",
            2,
            timeout=600,
            extra_env={
                "BENCH_WIDTH": str(args.width),
                "BENCH_LAYERS": str(args.layers),
                "BENCH_CHECKPOINT": directory,
                "BENCH_REPEATS": str(args.repeats),
            },
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    times = ranks[0]["times_s"]  # every rank holds the slower rank's times
    medians = {
        name: statistics.median(values) for name, values in times.items()
    }
    save_ratio = medians["save_with"] / medians["save_without"]
    load_ratio = medians["load_with"] / medians["load_without"]
    print(f"{'':16} {'with (s)':>10} {'without (s)':>12} {'ratio':>7}")
    for what, ratio in (("save", save_ratio), ("load", load_ratio)):
        print(
            f"{what + ' median':16} {medians[what + '_with']:>10.3f} "
            f"{medians[what + '_without']:>12.3f} {ratio:>7.3f}"
        )
    crc = ranks[0]["crc32_MiB_per_s"]
    print(f"zlib.crc32: {crc:,.0f} MiB/s on one thread")
    _launch.save(
        "checkpoint_checksum",
        {
            "benchmark": "checkpoint_checksum",
            "machine": dict(_launch.machine(), keras=ranks[0]["keras"]),
            "model": {
                "layers": args.layers,
                "width": args.width,
                "full_model_bytes": full,
            },
            "measure": (
                "wall time of checkpoint.save / checkpoint.load, the slower "
                "rank's, median of the repeats; 'without' = "
                "_streams.CHECKSUMS_ON_SAVE False (nothing recorded, so "
                "nothing verified on load)"
            ),
            "median_s": medians,
            "save_ratio_with_over_without": save_ratio,
            "load_ratio_with_over_without": load_ratio,
            "save_cost_ms": 1e3
            * (medians["save_with"] - medians["save_without"]),
            "load_cost_ms": 1e3
            * (medians["load_with"] - medians["load_without"]),
            "crc32_MiB_per_s": crc,
            "files": ranks[0]["files"],
            "ranks": ranks,
        },
    )


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
