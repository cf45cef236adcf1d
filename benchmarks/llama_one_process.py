"""Where keras_hub Llama's step goes on CPU, in one process, against the
torch model of the same shapes (benchmarks/fsdp.py's `llama` case, one
rank's rows: 4 sequences of 64 tokens).

    python benchmarks/llama_one_process.py [--steps 30] [--pairs 3]
                                           [--modes torch,keras,keras+ktd]
                                           [--profile MODE]

Modes, each in a fresh process (OMP_NUM_THREADS=1, as fsdp.py's workers),
interleaved `--pairs` times:
  torch      llama_shapes.torch_causal_lm, Adam(1e-3), cross-entropy
  keras      keras_hub LlamaCausalLM, plain Keras (this package not imported)
  keras+ktd  the same with keras_torch_distribution imported (installed into
             Keras), no distribution set: what the package adds to one
             process's step
  keras-jit  plain Keras with jit_compile=True (torch.compile)
  keras-xent plain Keras with its torch sparse cross-entropy replaced (in
             this process only) by one that keeps the class dim last
             (`F.cross_entropy` on (N, C) rows): what Keras' own
             `movedim(-1, 1)` before `cross_entropy` costs
Each: 3 warmup steps, then the median wall and CPU (process time) ms of
`--steps` steps. `--profile MODE`: cProfile of 10 more steps of that mode,
sorted by own time, to results/llama_one_process_<mode>.txt.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _rows_cross_entropy(target, output, from_logits=False, axis=-1):
    """Keras' torch sparse cross-entropy from logits on (N, C) rows."""
    import torch
    import torch.nn.functional as F

    if not from_logits or axis != -1 or output.dim() < 2:
        raise ValueError("the keras-xent experiment covers logits, axis=-1")
    target = torch.as_tensor(target).long()
    losses = F.cross_entropy(
        output.reshape(-1, output.shape[-1]),
        target.reshape(-1),
        reduction="none",
    )
    return losses.reshape(output.shape[:-1])


def _keras_step(mode):
    if mode == "keras+ktd":
        import keras_torch_distribution  # noqa: F401
    if mode == "keras-xent":
        try:  # Keras 3.15
            from keras.src.backend.torch import nn as torch_nn
        except ImportError:  # Keras 3.16: the torch ops moved
            from keras.src.backend.torch.ops import nn as torch_nn

        torch_nn.sparse_categorical_crossentropy = _rows_cross_entropy
    import keras
    import keras_hub
    import torch

    import llama_shapes

    keras.utils.set_random_seed(0)
    model = llama_shapes.keras_causal_lm(keras, keras_hub)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=(mode == "keras-jit"),
    )
    x, y = llama_shapes.arrays()
    rows = llama_shapes.GLOBAL_BATCH // 2
    x = llama_shapes.keras_inputs(x[:rows])
    y = y[:rows]
    model.fit(x, y, batch_size=rows, epochs=1, steps_per_epoch=1, verbose=0)
    model.make_train_function()
    batch = [(keras.tree.map_structure(torch.as_tensor, x), torch.as_tensor(y))]
    function = model.train_function
    return lambda: function(batch)


def _torch_step():
    import torch

    import llama_shapes

    torch.manual_seed(0)
    model = llama_shapes.torch_causal_lm()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = llama_shapes.arrays()
    rows = llama_shapes.GLOBAL_BATCH // 2
    x, y = torch.as_tensor(x[:rows]), torch.as_tensor(y[:rows]).long()
    step = llama_shapes.torch_train_step(model, optimizer, x, y)
    step()
    return step


def worker(mode, steps, profile):
    step = _torch_step() if mode == "torch" else _keras_step(mode)
    for _ in range(3):
        step()
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    if profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            step()
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(80)
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(
            os.path.join(HERE, "results", f"llama_one_process_{mode}.txt"), "w"
        ) as f:
            f.write(f"10 steps, {mode}\n{out.getvalue()}")
    print(
        json.dumps(
            {
                "mode": mode,
                "wall_ms": statistics.median(wall),
                "cpu_ms": statistics.median(cpu),
                "loadavg": os.getloadavg()[0],
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--modes", default="torch,keras,keras+ktd")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.profile == args.worker)
        return
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    results = {}
    for _ in range(args.pairs):
        for mode in args.modes.split(","):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    mode,
                    "--steps",
                    str(args.steps),
                ]
                + (["--profile", args.profile] if args.profile else []),
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            line = json.loads(out.stdout.strip().splitlines()[-1])
            results.setdefault(mode, []).append(line)
            print(line, flush=True)
    base = results.get("torch")
    for mode, lines in results.items():
        cpu = statistics.median(r["cpu_ms"] for r in lines)
        wall = statistics.median(r["wall_ms"] for r in lines)
        ratio = ""
        if base and mode != "torch":
            ratio = (
                "  / torch: wall "
                f"{wall / statistics.median(r['wall_ms'] for r in base):.2f} "
                f"cpu {cpu / statistics.median(r['cpu_ms'] for r in base):.2f}"
            )
        print(f"{mode:10s} wall {wall:7.1f} ms  cpu {cpu:7.1f} ms{ratio}")


if __name__ == "__main__":
    main()
