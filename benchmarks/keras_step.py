"""A Keras training step on torch against raw torch and Keras on JAX, in one
process: ops, host syncs, Python calls and time per step, and the time to
the first step (building and compiling included).

    python benchmarks/keras_step.py [--shapes small,wide] [--pairs 3]
        [--steps 20] [--modes torch,torch-compile,keras,ktd,ktd-keras-ops,
         ktd-jit,jax] [--jax-python PATH]

The model is benchmarks/llama_shapes.py's keras_hub Llama (4 blocks; the
`small` shape is hidden 128, `wide` hidden 512), its loss the next-token
cross-entropy from logits, Adam(1e-3); batches of 4 sequences of 64 tokens.
Modes, each in a fresh process (OMP_NUM_THREADS=1), interleaved `--pairs`
times:
  torch          the torch model of the same shapes, eager, foreach Adam
  torch-compile  the same, each block compiled (`block.compile()`, as
                 torchtitan does), the loss and Adam eager
  keras          plain Keras on torch (this package not imported), eager
  keras-jit      plain Keras, jit_compile=True (Keras compiles its whole
                 step; minutes to the first step)
  ktd            this package installed, no distribution, eager
  ktd-keras-ops  the same with KTD_FAST_OPS=0 (Keras' own ops and steps)
  ktd-jit        this package, jit_compile=True (repeated blocks compiled
                 once, Adam compiled)
  jax            Keras on JAX, jit_compile=True (needs JAX: --jax-python,
                 the Python of an environment with jax and keras)
Per mode: `first_s`, from building the model to the end of its first
`fit` step; `step_ms` (wall) and `cpu_ms` (process time), medians of
`--steps` steps of `fit` after a warm-up `fit` (fit's data pipeline and
callbacks included, as a user runs it; for raw torch a loop over the same
batches); for the torch-backed modes, one `train_function` step counted:
`ops` (aten ops dispatched), `kernels` (ops that are not views), `syncs`
(ops that would make the host wait for a GPU, `testing.count_ops`) and
`python_calls` (function calls the interpreter makes); torch's own Adam
reads its step counts on the host, where they live even on a GPU: those
reads wait for nothing and are not counted as syncs. Plain Keras is
counted without this package installed (`_op_counts` is loaded by its
path). Ratios are to raw
torch's eager step of the same run. For the package, `ops_gpu_path`,
`kernels_gpu_path` and `syncs_gpu_path` count the step as a GPU runs it
(its Adam in foreach kernels; on a CPU it updates one variable at a
time). Results: benchmarks/results/
keras_step.json.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPES = {
    "small": dict(hidden=128, ffn=384),
    "wide": dict(hidden=512, ffn=1536),
}
ROWS = 4  # sequences per batch
BATCHES = 8  # distinct batches per fit epoch
TORCH_MODES = ("torch", "torch-compile")
DEFAULT_MODES = "torch,torch-compile,keras,ktd,ktd-keras-ops,ktd-jit,jax"


def _shape(name):
    import llama_shapes

    return llama_shapes.Shape(global_batch=ROWS * BATCHES, **SHAPES[name])


def _python_calls(function):
    """Python function calls made while `function()` runs."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(None)
    return calls[0]


def _op_counts():
    """The package's `_op_counts` module, loaded by its path: importing it
    through the package would install the package into plain Keras."""
    name = "_ktd_op_counts"
    if name not in sys.modules:
        path = os.path.join(
            HERE, "..", "src", "keras_torch_distribution", "_op_counts.py"
        )
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


# torch's Adam (not capturable, not fused) keeps each variable's step count
# in a host tensor and reads it there: host reads that never wait for a GPU.
HOST_SIDE = "torch/optim/"


def _counted(step):
    with _op_counts().count_ops() as counts:
        step()
    syncs = sum(
        n
        for (_, issuer), n in counts.sync_sources.items()
        if not issuer.startswith(HOST_SIDE)
    )
    return dict(
        ops=counts.total,
        kernels=counts.kernels,
        syncs=syncs,
        python_calls=_python_calls(step),
    )


def _counted_gpu_path(step):
    """The package's counts with a GPU's code path: on a CPU its Adam
    updates one variable at a time, on a GPU (as Keras' and torch's Adam
    on any device) in foreach kernels."""
    from keras_torch_distribution._training import optimizer_update

    saved = optimizer_update._use_foreach
    optimizer_update._use_foreach = lambda value: True
    try:
        counts = _counted(step)
    finally:
        optimizer_update._use_foreach = saved
    return {
        f"{name}_gpu_path": counts[name] for name in ("ops", "kernels", "syncs")
    }


def _timed(run_steps, steps):
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        run_steps(1)
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return dict(step_ms=statistics.median(wall), cpu_ms=statistics.median(cpu))


def torch_worker(mode, shape_name, steps):
    import torch

    import llama_shapes

    shape = _shape(shape_name)
    started = time.perf_counter()
    torch.manual_seed(0)
    model = llama_shapes.torch_causal_lm(shape)
    if mode == "torch-compile":
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    ids_x, ids_y = llama_shapes.arrays(shape=shape)
    batches = [
        (
            torch.as_tensor(ids_x[i : i + ROWS]),
            torch.as_tensor(ids_y[i : i + ROWS]).long(),
        )
        for i in range(0, len(ids_x), ROWS)
    ]
    step_of = [
        llama_shapes.torch_train_step(model, optimizer, *batch)
        for batch in batches
    ]
    step_of[0]()
    first = time.perf_counter() - started
    position = [0]

    def run_steps(n):
        for _ in range(n):
            step_of[position[0] % len(step_of)]()
            position[0] += 1

    run_steps(3)
    result = dict(first_s=first, **_timed(run_steps, steps))
    result.update(_counted(step_of[0]))
    return result


def keras_worker(mode, shape_name, steps):
    if mode.startswith("ktd"):
        import keras_torch_distribution  # noqa: F401
    import keras
    import keras_hub
    import numpy as np

    import llama_shapes

    shape = _shape(shape_name)
    started = time.perf_counter()
    keras.utils.set_random_seed(0)
    model = llama_shapes.keras_causal_lm(keras, keras_hub, shape)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=mode in ("keras-jit", "ktd-jit", "jax"),
    )
    ids_x, ids_y = llama_shapes.arrays(shape=shape)
    x = llama_shapes.keras_inputs(ids_x)

    def fit(n):
        model.fit(
            x,
            ids_y,
            batch_size=ROWS,
            epochs=1,
            steps_per_epoch=n,
            shuffle=False,
            verbose=0,
        )

    fit(1)
    first = time.perf_counter() - started
    fit(BATCHES)  # warm-up: every batch seen once
    # One fit of n steps, timed per step: the fit's own start and end are
    # spread over its steps (a user's epoch has hundreds).
    wall, cpu = [], []
    for _ in range(3):
        w, c = time.perf_counter(), time.process_time()
        fit(steps)
        wall.append((time.perf_counter() - w) * 1e3 / steps)
        cpu.append((time.process_time() - c) * 1e3 / steps)
    result = dict(
        first_s=first, step_ms=statistics.median(wall), cpu_ms=min(cpu)
    )
    if mode != "jax":
        import torch

        batch = [
            (
                keras.tree.map_structure(
                    torch.as_tensor, llama_shapes.keras_inputs(ids_x[:ROWS])
                ),
                torch.as_tensor(ids_y[:ROWS]),
            )
        ]
        function = model.train_function
        function(batch)
        result.update(_counted(lambda: function(batch)))
        if mode.startswith("ktd"):
            result.update(_counted_gpu_path(lambda: function(batch)))
        del np
    return result


def worker(mode, shape_name, steps):
    if mode in TORCH_MODES:
        result = torch_worker(mode, shape_name, steps)
    else:
        result = keras_worker(mode, shape_name, steps)
    result.update(mode=mode, shape=shape_name, loadavg=os.getloadavg()[0])
    print(json.dumps(result))


def _run(mode, shape_name, steps, jax_python):
    env = dict(
        os.environ,
        KERAS_BACKEND="jax" if mode == "jax" else "torch",
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
        "intra_op_parallelism_threads=1",
    )
    if mode == "ktd-keras-ops":
        env["KTD_FAST_OPS"] = "0"
    python = jax_python if mode == "jax" else sys.executable
    out = subprocess.run(
        [python, __file__, "--worker", mode, "--shape", shape_name]
        + ["--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} {shape_name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="small,wide")
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--jax-python", default=None)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--shape", default="small")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.shape, args.steps)
        return
    modes = args.modes.split(",")
    if "jax" in modes and not args.jax_python:
        print("no --jax-python given: the jax mode is left out")
        modes.remove("jax")
    results = {}
    for shape_name in args.shapes.split(","):
        for _ in range(args.pairs):
            for mode in modes:
                line = _run(mode, shape_name, args.steps, args.jax_python)
                results.setdefault((shape_name, mode), []).append(line)
                print(json.dumps(line), flush=True)
    table = []
    for (shape_name, mode), lines in results.items():
        row = dict(shape=shape_name, mode=mode, runs=lines)
        for key in lines[0]:
            if isinstance(lines[0][key], (int, float)) and key != "loadavg":
                row[key] = statistics.median(line[key] for line in lines)
        table.append(row)
    for row in table:
        base = next(
            r
            for r in table
            if r["shape"] == row["shape"] and r["mode"] == "torch"
        )
        row["step_vs_torch"] = row["step_ms"] / base["step_ms"]
        row["cpu_vs_torch"] = row["cpu_ms"] / base["cpu_ms"]
        if "ops" in row:
            row["ops_vs_torch"] = row["ops"] / base["ops"]
            row["kernels_vs_torch"] = row["kernels"] / base["kernels"]
        print(
            f"{row['shape']:6s} {row['mode']:14s} first {row['first_s']:7.1f} s"
            f"  step {row['step_ms']:7.1f} ms ({row['step_vs_torch']:.2f}x)"
            f"  cpu {row['cpu_ms']:7.1f} ms ({row['cpu_vs_torch']:.2f}x)"
            + (
                f"  ops {row['ops']:5.0f} ({row['ops_vs_torch']:.2f}x)"
                f"  kernels {row['kernels']:4.0f}"
                f" ({row['kernels_vs_torch']:.2f}x)"
                f"  syncs {row['syncs']:3.0f}"
                + (
                    f"  gpu path: ops {row['ops_gpu_path']:5.0f}"
                    f" ({row['ops_gpu_path'] / base['ops']:.2f}x) kernels"
                    f" {row['kernels_gpu_path']:4.0f}"
                    f" ({row['kernels_gpu_path'] / base['kernels']:.2f}x)"
                    if "ops_gpu_path" in row
                    else ""
                )
                + f"  python calls {row['python_calls']:6.0f}"
                if "ops" in row
                else ""
            )
        )
    import _launch

    _launch.save("keras_step", dict(rows=table))


if __name__ == "__main__":
    main()
