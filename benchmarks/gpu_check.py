"""The GPU check: everything GPU-specific, in one command.

    tools/gpu-check [--sections a,b,...] [--quick] [--jobs N]

Without CUDA and without --sections, it runs the CPU part (--quick: a few
minutes); `--sections NAME` runs a section at full size anyway.

Writes benchmarks/results/gpu.json and prints a readable summary. Every
section runs in a fresh child process (a crash, a hang or a CUDA error in
one does not stop the others; each has a timeout). Correctness sections run
`--jobs` at a time; speed sections run alone, one after another.

Sections (CUDA: needs a GPU; else it also runs on CPU tensors):
  environment      torch, CUDA, NCCL, device, memory, Keras, the package
  fit_mlp          world 1: DataParallel and ModelParallel fit of an MLP,
                   float32 and mixed_bfloat16, jit_compile off and on,
                   against plain Keras (this package not imported) from the
                   same initial weights
  fit_llama        the same for a tiny keras_hub Llama under its own layout map
  attention        (CUDA) flash / memory-efficient / cuDNN attention on
                   heads-sharded DTensors (simulated world of 2): rank 0's
                   heads and their gradients against a slice of the full op
  checkpoint       world 1: save, async_save and load of a sharded model:
                   timings, round trip, GPU memory
  world2/4/8       simulated worlds in one process (torch's fake process
                   group): FSDP (prefetch 0, 1, 2) and a 2-D mesh on a small
                   keras_hub Llama; each rank's max_memory_allocated against
                   what its layout needs. Numbers are not checked: the fake
                   group's reduce-scatter returns uninitialized memory.
  sanitizer        (CUDA) world 2, FSDP with prefetch, under
                   TORCH_CUDA_SANITIZER=1 (unsynchronized stream use)
  multiprocess     (2+ GPUs) the multiprocess tests with one GPU per rank
  float8           (CUDA) the speed section's Llama compiled, in bfloat16
                   (mixed_bfloat16) and after `quantize("float8")`, its
                   matrix products as torch._scaled_mm (the package's) and
                   as Keras' fake-quantized matmul (KTD_FLOAT8_MATMUL=0):
                   step times side by side, and the float8 losses against
                   the fake-quantized ones (issue 47)
  speed            (CUDA) a keras_hub Llama (about 1.1 B parameters) train
                   step: raw torch, plain Keras, the package (DataParallel
                   and ModelParallel under Llama's layout map), Keras on JAX
                   where JAX is installed: tokens/s, MFU, peak memory; and
                   the losses of the first steps against plain Keras

Without CUDA it runs what can run on CPU tensors and lists the rest as
skipped. On a machine without network access: see the README ("A GPU
check").
"""

import argparse
import concurrent.futures
import faulthandler
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

# bf16 dense peak of one GPU, for MFU; by device name.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}

# In order of what a short run needs first: raw torch, the package eager and
# compiled, Keras on JAX (where JAX is installed, added after ktd_jit), then
# the rest. Plain Keras' own jit_compile compiles for minutes: last.
SPEED_MODES = (
    "torch",
    "ktd_jit",
    "ktd",
    "torch_compile",
    "keras",
    "ktd_dp_jit",
    "ktd_dp",
    "ktd_mp",
    "keras_jit",
)
SPEED_MODE_TIMEOUT = 300

# Tolerances of a world-1 fit against plain Keras, relative to the loss.
TOLERANCE = {"float32": 1e-5, "mixed_bfloat16": 2e-2}


# ---------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------

SECTIONS = {
    # name: (needs CUDA, timeout seconds, alone)
    "environment": (False, 120, False),
    "fit_mlp": (False, 360, False),
    "fit_llama": (False, 400, False),
    "attention": (True, 240, False),
    "checkpoint": (False, 240, False),
    "world2": (False, 300, False),
    "world4": (False, 300, False),
    "world8": (False, 300, False),
    "sanitizer": (True, 300, False),
    "multiprocess": (True, 1800, True),
    "speed": (True, 7 * 240, True),
    "float8": (True, 3 * 300, True),
}
QUICK = ["environment", "fit_mlp", "world2", "world4"]


def _quick():
    """--quick: smaller models and fewer configurations (the CPU run CI
    makes)."""
    return os.environ.get("KTD_GPU_CHECK_QUICK") == "1"


def _child_env(extra=None):
    env = dict(os.environ)
    env["KERAS_BACKEND"] = "torch"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "src"), HERE]
        + [p for p in [env.get("PYTHONPATH")] if p]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.update(extra or {})
    return env


def run_child(section, args=(), timeout=600, env=None):
    """Run `section` in a fresh process; its result dict, or a failure
    record with the end of its output."""
    with tempfile.TemporaryDirectory(prefix="ktd-gpu-check-") as tmp:
        out = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            __file__,
            "--child",
            section,
            "--result",
            out,
            "--timeout",
            str(timeout),
            *args,
        ]
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                command,
                env=env or _child_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            tail = (proc.stdout + proc.stderr)[-4000:]
            code = proc.returncode
        except subprocess.TimeoutExpired as expired:
            tail = (
                f"timed out after {timeout:g} s (this section's limit); its "
                "last output:\n"
                + (_text(expired.stdout) + _text(expired.stderr) or "(none)")[
                    -4000:
                ]
            )
            code = "timeout"
        seconds = round(time.perf_counter() - start, 1)
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
            result.setdefault("status", "ok")
        else:
            result = {"status": "failed", "exit": code, "output": tail}
        result["seconds"] = seconds
        if result["status"] != "ok" and "output" not in result:
            result["output"] = tail
        return result


def _text(output):
    """A child's captured output as text (bytes where it timed out)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def default_jobs(cpus=None):
    """Sections run at a time: half the CPUs (each section computes on
    several threads), 1 to 4."""
    cpus = os.cpu_count() if cpus is None else cpus
    return max(1, min(4, (cpus or 1) // 2))


def chosen_sections(sections, quick, cuda):
    """(section names, quick): the --sections given, else every section;
    without CUDA and without --sections, the CPU part (--quick)."""
    if sections:
        return sections.split(","), quick
    if quick or not cuda:
        return list(QUICK), True
    return list(SECTIONS), False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sections",
        default=None,
        help="comma-separated; default: all (--quick: " + ",".join(QUICK) + ")",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--speed-modes",
        default=None,
        help="comma-separated speed modes (default: all of "
        + ",".join(SPEED_MODES)
        + ", keras_jax where JAX is installed)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help=(
            "a torch profile of 3 more steps of the keras and ktd_dp speed "
            "modes"
        ),
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="sections run at a time (default: half the CPUs, 1 to 4)",
    )
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results", "gpu.json")
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--timeout", type=float, default=None, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    import torch

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    names, quick = chosen_sections(args.sections, args.quick, cuda)
    if quick and not args.quick:
        print(
            "gpu-check: no CUDA here: the CPU part (--quick); --sections NAME "
            "runs a section at full size.",
            flush=True,
        )
    if quick:
        os.environ["KTD_GPU_CHECK_QUICK"] = "1"
    if args.profile:
        os.environ["KTD_GPU_CHECK_PROFILE"] = "1"
    if args.speed_modes:
        os.environ["KTD_GPU_CHECK_SPEED_MODES"] = args.speed_modes

    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(
            f"unknown sections {unknown}; known: {', '.join(SECTIONS)}"
        )
    results, skipped = {}, {}
    for name in names:
        needs_cuda = SECTIONS[name][0]
        if needs_cuda and not cuda:
            skipped[name] = "no CUDA device"
        elif name == "multiprocess" and gpus < 2:
            skipped[name] = f"needs 2 or more GPUs, {gpus} visible"
    runnable = [n for n in names if n not in skipped]
    together = [n for n in runnable if not SECTIONS[n][2]]
    alone = [n for n in runnable if SECTIONS[n][2]]

    def write():
        """The report so far (written after every section, so that a run
        stopped part way keeps what it measured)."""
        report = {
            "device": "cuda" if cuda else "cpu",
            "skipped": skipped,
            "sections": {n: results[n] for n in names if n in results},
        }
        report["summary"] = summarize(report)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
        return report

    def run(name):
        print(f"gpu-check: {name} ...", flush=True)
        result = RUNNERS.get(name, _run_plain)(name)
        print(
            f"gpu-check: {name} {result['status']} ({result['seconds']} s)",
            flush=True,
        )
        results[name] = result
        write()
        return result

    jobs = max(1, args.jobs or default_jobs())
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, together))
    for name in alone:
        run(name)
    report = write()
    print("\n".join(report["summary"]))
    print(f"wrote {args.out}")
    failed = [n for n, r in results.items() if r["status"] != "ok"]
    return 1 if failed else 0


def _run_plain(name):
    return run_child(name, timeout=SECTIONS[name][1])


def _run_compared(name):
    """A section run twice: by plain Keras (the package not imported) and
    by the package; the package's losses are compared with plain Keras'."""
    timeout = SECTIONS[name][1]
    plain = run_child(name, ["--mode", "plain"], timeout)
    package = run_child(name, ["--mode", "package"], timeout)
    result = {
        "status": "ok",
        "plain": plain,
        "package": package,
        "seconds": round(plain["seconds"] + package["seconds"], 1),
    }
    if plain["status"] != "ok" or package["status"] != "ok":
        result["status"] = "failed"
        return result
    result["comparisons"] = compare_fits(plain["fits"], package["fits"])
    if any(not c["ok"] for c in result["comparisons"]):
        result["status"] = "mismatch"
    return result


def compare_fits(plain, package):
    """Each package fit against the plain fit of the same precision and
    jit: the largest relative loss difference, against TOLERANCE."""
    rows = []
    for fit in package:
        key = (fit["precision"], fit["jit"])
        reference = next(
            (p for p in plain if (p["precision"], p["jit"]) == key), None
        )
        row = {
            "fit": fit["name"],
            "precision": fit["precision"],
            "jit": fit["jit"],
        }
        if fit.get("error") or reference is None or reference.get("error"):
            row.update(
                ok=False,
                error=fit.get("error")
                or (reference or {}).get("error")
                or "no plain Keras fit to compare with",
            )
        else:
            diff = max(
                abs(a - b) / max(abs(b), 1e-12)
                for a, b in zip(fit["losses"], reference["losses"])
            )
            row.update(
                max_relative_difference=diff,
                tolerance=TOLERANCE[fit["precision"]],
                ok=diff <= TOLERANCE[fit["precision"]]
                and not fit.get("fallback"),
            )
            if fit.get("fallback"):
                row["fallback"] = fit["fallback"]
        rows.append(row)
    return rows


def _run_speed(name):
    modes = list(SPEED_MODES)
    try:
        import jax  # noqa: F401

        modes.insert(modes.index("ktd_jit") + 1, "keras_jax")
    except ImportError:
        pass
    chosen = os.environ.get("KTD_GPU_CHECK_SPEED_MODES")
    if chosen:
        modes = chosen.split(",")
    runs = {}
    for mode in modes:
        env = _child_env(
            {"KERAS_BACKEND": "jax", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
            if mode == "keras_jax"
            else None
        )
        runs[mode] = run_child(name, ["--mode", mode], SPEED_MODE_TIMEOUT, env)
    result = {
        "status": "ok",
        "modes": runs,
        "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
    }
    keras_run = runs.get("keras", {})
    torch_run = runs.get("torch", {})
    for mode, run in runs.items():
        if run.get("status") != "ok":
            continue
        if torch_run.get("status") == "ok":
            run["time_vs_torch"] = run["step_ms"] / torch_run["step_ms"]
        if keras_run.get("status") == "ok":
            run["time_vs_keras"] = run["step_ms"] / keras_run["step_ms"]
    if keras_run.get("status") == "ok":
        for mode, run in runs.items():
            if run.get("status") == "ok":
                if mode.startswith("ktd") or mode == "keras_jit":
                    diff = max(
                        abs(a - b) / abs(b)
                        for a, b in zip(run["losses"], keras_run["losses"])
                    )
                    run["loss_max_relative_difference"] = diff
                    if diff > TOLERANCE["mixed_bfloat16"]:
                        result["status"] = "mismatch"
    if any(r.get("status") != "ok" for r in runs.values()):
        result["status"] = "failed"
    return result


def _run_sanitizer(name):
    return run_child(
        name,
        timeout=SECTIONS[name][1],
        env=_child_env({"TORCH_CUDA_SANITIZER": "1"}),
    )


def _run_multiprocess(name):
    env = _child_env({"KTD_TEST_DEVICE": "cuda"})
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "tests/multiprocess",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SECTIONS[name][1],
    )
    return {
        "status": "ok" if proc.returncode == 0 else "failed",
        "output": (proc.stdout + proc.stderr)[-4000:],
        "seconds": round(time.perf_counter() - start, 1),
    }


# The float8 section's modes: bfloat16, float8 with torch._scaled_mm, float8
# fake-quantized (Keras' own matmul: KTD_FLOAT8_MATMUL=0); all compiled.
FLOAT8_MODES = ("ktd_jit", "ktd_f8_jit", "ktd_f8fake_jit")


def _run_float8(name):
    runs = {}
    for mode in FLOAT8_MODES:
        env = _child_env(
            {"KTD_FLOAT8_MATMUL": "0"} if mode == "ktd_f8fake_jit" else None
        )
        runs[mode] = run_child(name, ["--mode", mode], SPEED_MODE_TIMEOUT, env)
    result = {
        "status": "ok",
        "modes": runs,
        "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
    }
    if any(r.get("status") != "ok" for r in runs.values()):
        result["status"] = "failed"
        return result
    bf16, f8, fake = (runs[m] for m in FLOAT8_MODES)
    result["float8_speedup_over_bfloat16"] = bf16["step_ms"] / f8["step_ms"]
    result["fake_float8_speedup_over_bfloat16"] = (
        bf16["step_ms"] / fake["step_ms"]
    )
    diff = max(
        abs(a - b) / abs(b) for a, b in zip(f8["losses"], fake["losses"])
    )
    result["loss_max_relative_difference_scaled_mm_vs_fake"] = diff
    if diff > TOLERANCE["mixed_bfloat16"] or not f8.get("uses_scaled_mm"):
        result["status"] = "mismatch"
    return result


RUNNERS = {
    "float8": _run_float8,
    "fit_mlp": _run_compared,
    "fit_llama": _run_compared,
    "speed": _run_speed,
    "sanitizer": _run_sanitizer,
    "multiprocess": _run_multiprocess,
}


def summarize(report):
    lines = [f"GPU check on {report['device']}:"]
    env = report["sections"].get("environment", {})
    if env.get("status") == "ok":
        lines.append(
            "  "
            + ", ".join(
                f"{k} {v}"
                for k, v in env.items()
                if k in ("device_name", "torch", "cuda", "nccl", "keras")
            )
        )
    for name, result in report["sections"].items():
        line = f"  {name:12} {result['status']:8} {result['seconds']:7.1f} s"
        if name in ("fit_mlp", "fit_llama") and "comparisons" in result:
            worst = [c for c in result["comparisons"] if not c["ok"]]
            total = len(result["comparisons"])
            line += f"  {total - len(worst)}/{total} fits match plain Keras"
            for c in worst:
                line += (
                    f"\n      {c['fit']} {c['precision']} jit={c['jit']}: "
                    + str(
                        c.get("error")
                        or c.get("fallback")
                        or c.get("max_relative_difference")
                    )[:300]
                )
        elif name.startswith("world") or name == "sanitizer":
            for run in result["runs"]:
                if "error" in run:
                    line += f"\n      {run['name']:24} failed"
                    continue
                peak = run.get("peak_mib")
                line += f"\n      {run['name']:24} " + (
                    f"peak {peak:8.1f} MiB, expected "
                    f"{run['expected_mib']:8.1f} MiB"
                    if isinstance(peak, (int, float)) and peak == peak
                    else f"expected {run['expected_mib']:8.1f} MiB (the peak "
                    "is measured on CUDA only)"
                )
                for row in run.get("peak_above_start", {}).get("by_origin", [])[
                    :6
                ]:
                    line += (
                        f"\n          {row['mib']:7.1f} MiB stream "
                        f"{row['stream']} {row['where']}"
                    )
        elif name == "speed":
            for mode, run in result["modes"].items():
                if run.get("status") == "ok":
                    line += (
                        f"\n      {mode:13} {run['step_ms']:8.1f} ms/step "
                        f"({run.get('time_vs_torch', 0):.2f}x torch) "
                        f"{run['tokens_per_s']:9.0f} tok/s  MFU "
                        f"{run.get('mfu') or 0:.3f}  first step "
                        f"{run['first_s']:6.1f} s  syncs "
                        f"{run.get('syncs_in_timed_steps')}  peak "
                        f"{run.get('peak_mib') or 0:.0f} MiB"
                    )
                else:
                    line += f"\n      {mode:13} {run.get('status')}"
        elif name == "float8" and "float8_speedup_over_bfloat16" in result:
            for mode, run in result["modes"].items():
                line += (
                    f"\n      {mode:15} {run['step_ms']:8.1f} ms/step "
                    f"{run['tokens_per_s']:9.0f} tok/s  peak "
                    f"{run.get('peak_mib') or 0:.0f} MiB"
                )
            line += (
                "\n      float8 (torch._scaled_mm) / bfloat16 speed: "
                f"{result['float8_speedup_over_bfloat16']:.3f}x; fake-"
                "quantized: "
                f"{result['fake_float8_speedup_over_bfloat16']:.3f}x; losses "
                "vs fake-quantized: "
                f"{result['loss_max_relative_difference_scaled_mm_vs_fake']:.2e}"
            )
        elif name == "attention" and result["status"] in ("ok", "mismatch"):
            for row in result["kernels"]:
                line += (
                    f"\n      {row['kernel']:10} "
                    f"{row.get('max_abs_difference', row.get('error'))}"
                )
        elif name == "checkpoint" and result["status"] == "ok":
            line += "  " + ", ".join(
                f"{k} {v}"
                for k, v in result.items()
                if k.endswith("_s") or k.endswith("_mib")
            )
        if result["status"] not in ("ok", "mismatch"):
            line += "\n      " + (result.get("output") or "")[-1500:].replace(
                "\n", "\n      "
            )
        lines.append(line)
    for name, why in report["skipped"].items():
        lines.append(f"  {name:12} skipped: {why}")
    return lines


# ---------------------------------------------------------------------------
# The children
# ---------------------------------------------------------------------------


def child_main(args):
    if args.timeout:
        # A hung child prints every thread's stack before the driver kills it.
        faulthandler.dump_traceback_later(
            max(5.0, args.timeout - 10), exit=True
        )
    try:
        result = CHILDREN[args.child](args.mode)
    except BaseException:  # the driver records it as the section's failure
        result = {"status": "failed", "output": traceback.format_exc()[-4000:]}
    with open(args.result, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return 0


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def child_environment(mode):
    import keras
    import torch

    import keras_torch_distribution as ktd

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "keras_torch_distribution": ktd.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            device_count=torch.cuda.device_count(),
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            bf16=torch.cuda.is_bf16_supported(),
        )
    return info


class _Fallbacks:
    """Collects the package's warnings (its logger) during a fit."""

    def __init__(self):
        import logging

        self.messages = []
        handler = logging.Handler()
        handler.emit = lambda record: self.messages.append(record.getMessage())
        self.handler = handler

    def __enter__(self):
        import logging

        logging.getLogger("keras_torch_distribution").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("keras_torch_distribution").removeHandler(
            self.handler
        )


def _initial_weights(model, seed=1):
    """Deterministic initial weights (numpy), the same in every process:
    plain Keras draws on the GPU, the package's sharded variables on the
    CPU (gpu.md M5), so fits compare from set weights."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(w.shape) * 0.05).astype(w.dtype)
        if "float" in str(w.dtype)
        else w.numpy()
        for w in model.weights
    ]


def _fits(mode, build, data, distributions, configurations):
    """Fit `build()` under each distribution and configuration; losses per
    epoch and the package's warnings."""
    import keras

    fits = []
    package_mode = mode == "package"
    if package_mode:
        import keras_torch_distribution  # noqa: F401

        keras.distribution.initialize()
    x, y = data
    for dist_name, make_distribution in (
        distributions if package_mode else [("plain", None)]
    ):
        for precision, jit in configurations:
            name = f"{dist_name}/{precision}/jit={jit}"
            record = {"name": name, "precision": precision, "jit": jit}
            try:
                keras.backend.clear_session()
                keras.config.set_dtype_policy(precision)
                keras.distribution.set_distribution(
                    make_distribution() if make_distribution else None
                )
                model = build(jit)
                weights = _initial_weights(model)
                model.set_weights(weights)
                if package_mode:
                    with _Fallbacks() as warned:
                        history = model.fit(
                            x,
                            y,
                            batch_size=8,
                            epochs=3,
                            shuffle=False,
                            verbose=0,
                        )
                    fallback = [
                        m for m in warned.messages if "could not run" in m
                    ]
                    if fallback:
                        record["fallback"] = fallback[0][:500]
                else:
                    history = model.fit(
                        x, y, batch_size=8, epochs=3, shuffle=False, verbose=0
                    )
                record["losses"] = [float(v) for v in history.history["loss"]]
                record["variable_devices"] = sorted(
                    {
                        str(getattr(v.value, "device", "?"))
                        for v in model.weights
                    }
                )
            except Exception:  # recorded: the driver reports it as a failed fit
                record["error"] = traceback.format_exc()[-2000:]
            finally:
                keras.distribution.set_distribution(None)
                keras.config.set_dtype_policy("float32")
            fits.append(record)
    return fits


_CONFIGURATIONS = [
    ("float32", False),
    ("mixed_bfloat16", False),
    ("mixed_bfloat16", True),
]


def _process_facts():
    import torch
    import torch.distributed as dist

    facts = {"device": _device()}
    if dist.is_initialized():
        facts["backend"] = str(dist.get_backend())
        facts["cuda_initialized"] = torch.cuda.is_initialized()
        import keras

        facts["list_devices"] = keras.distribution.list_devices()
    return facts


def child_fit_mlp(mode):
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(32, 16)).astype("float32") / 4)

    def build(jit):
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(128, activation="relu", name="up"),
                keras.layers.Dense(16, name="down"),
            ]
        )
        model.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=jit)
        return model

    def model_parallel():
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (len(devices),), ["model"], devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*up/kernel"] = (None, "model")
        layout_map[".*down/kernel"] = ("model", None)
        return keras.distribution.ModelParallel(layout_map=layout_map)

    distributions = [
        ("DataParallel", keras.distribution.DataParallel),
        ("ModelParallel", model_parallel),
    ]
    fits = _fits(
        mode,
        build,
        (x, y),
        distributions,
        _CONFIGURATIONS[:2]
        if _quick()
        else _CONFIGURATIONS + [("float32", True)],
    )
    return {"fits": fits, **_process_facts()}


TINY_LLAMA = dict(
    vocab=256,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    ffn=128,
    seq=32,
    global_batch=16,
)


def child_fit_llama(mode):
    import keras
    import keras_hub

    import llama_shapes

    shape = llama_shapes.Shape(**TINY_LLAMA)
    x, y = llama_shapes.arrays(0, shape)
    x = llama_shapes.keras_inputs(x)

    def build(jit):
        keras.utils.set_random_seed(0)
        model = llama_shapes.keras_causal_lm(keras, keras_hub, shape)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[],
            jit_compile=jit,
        )
        return model

    def model_parallel():
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (1, len(devices)), ["batch", "model"], devices
        )
        return keras.distribution.ModelParallel(
            layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )

    distributions = [
        ("DataParallel", keras.distribution.DataParallel),
        ("ModelParallel", model_parallel),
    ]
    fits = _fits(mode, build, (x, y), distributions, _CONFIGURATIONS)
    return {"fits": fits, **_process_facts()}


def _fake_world(world):
    """This process as rank 0 of a simulated world (torch's fake process
    group); CUDA device 0 where there is one."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def child_attention(mode):
    """Rank 0 of 2 holds half the heads; each CUDA SDPA kernel on the
    heads-sharded DTensors must give the slice of the full op."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel

    import keras_torch_distribution  # noqa: F401  (installs the sharding rules)

    _fake_world(2)
    mesh = init_device_mesh("cuda", (2,))
    torch.manual_seed(0)
    batch, heads, seq, dim = 2, 8, 128, 64
    full = [
        torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    ]
    rows = []
    for kernel in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        row = {"kernel": kernel}
        try:
            backend = getattr(SDPBackend, kernel)
            with sdpa_kernel(backend):
                leaves = [t.clone().requires_grad_(True) for t in full]
                reference = F.scaled_dot_product_attention(
                    *leaves, is_causal=True
                )
                reference.sum().backward()
                local = [
                    t[:, : heads // 2].clone().requires_grad_(True)
                    for t in full
                ]
                sharded = [
                    DTensor.from_local(t, mesh, [Shard(1)], run_check=False)
                    for t in local
                ]
                out = F.scaled_dot_product_attention(*sharded, is_causal=True)
                row["output_placements"] = str(out.placements)
                out.to_local().sum().backward()
            diffs = [
                (out.to_local() - reference[:, : heads // 2]).abs().max().item()
            ]
            diffs += [
                (a.grad - b.grad[:, : heads // 2]).abs().max().item()
                for a, b in zip(local, leaves)
            ]
            row["max_abs_difference"] = max(diffs)
            row["ok"] = out.placements == (Shard(1),) and max(diffs) < 2e-2
        except Exception:  # recorded per kernel
            row["error"] = traceback.format_exc()[-1500:]
            row["ok"] = False
        rows.append(row)
    return {
        "status": "ok" if all(r["ok"] for r in rows) else "mismatch",
        "kernels": rows,
    }


def child_checkpoint(mode):
    import keras
    import numpy as np
    import torch

    import keras_torch_distribution as ktd

    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r"dense_\d+/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    width = 4096 if torch.cuda.is_available() else 256
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, name=f"dense_{i}") for i in range(6)]
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = np.random.default_rng(0).normal(size=(16, width)).astype("float32")
    model.fit(x, x, batch_size=16, epochs=1, verbose=0)
    before = [w.numpy() for w in model.weights]
    cuda = torch.cuda.is_available()
    result = {"parameters": int(model.count_params())}
    with tempfile.TemporaryDirectory(prefix="ktd-gpu-ckpt-") as tmp:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        ktd.checkpoint.save(model, os.path.join(tmp, "a"))
        result["save_s"] = round(time.perf_counter() - start, 3)
        if cuda:
            result["save_extra_peak_mib"] = round(
                (torch.cuda.max_memory_allocated() - base) / 2**20, 1
            )
        start = time.perf_counter()
        pending = ktd.checkpoint.async_save(model, os.path.join(tmp, "b"))
        result["async_save_return_s"] = round(time.perf_counter() - start, 3)
        pending.result()
        result["async_save_total_s"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        pending = ktd.checkpoint.async_save(model, os.path.join(tmp, "c"))
        result["async_save_again_return_s"] = round(
            time.perf_counter() - start, 3
        )
        pending.result()
        for w in model.weights:
            w.assign(np.zeros(w.shape, w.dtype))
        start = time.perf_counter()
        ktd.checkpoint.load(model, os.path.join(tmp, "b"))
        result["load_s"] = round(time.perf_counter() - start, 3)
        after = [w.numpy() for w in model.weights]
    result["round_trip_equal"] = all(
        np.array_equal(a, b) for a, b in zip(before, after)
    )
    result["checkpoint_mib"] = round(sum(b.nbytes for b in before) / 2**20, 1)
    if not result["round_trip_equal"]:
        result["status"] = "mismatch"
    return result


SMALL_LLAMA = dict(
    vocab=8192,
    hidden=512,
    layers=4,
    heads=8,
    kv_heads=4,
    ffn=1536,
    seq=128,
    global_batch=8,
)


def _world_child(world):
    """FSDP (batch axis = all ranks) with prefetch 0, 1, 2 and, from world 4,
    a 2-D (world/2, 2) mesh, on a small keras_hub Llama, as rank 0 of
    `world`."""
    _fake_world(world)
    import keras
    import keras_hub
    import torch

    import keras_torch_distribution  # noqa: F401
    import llama_shapes

    size = TINY_LLAMA if _quick() else SMALL_LLAMA
    shape = llama_shapes.Shape(**dict(size, global_batch=2 * world))
    x, y = llama_shapes.arrays(0, shape)
    x = llama_shapes.keras_inputs(x)
    cuda = torch.cuda.is_available()
    runs = []
    meshes = [((world, 1), "fsdp")] + (
        [((world // 2, 2), "2d")] if world >= 4 else []
    )
    for mesh_shape, kind in meshes:
        prefetches = (0, 1, 2) if kind == "fsdp" else (1,)
        for prefetch in prefetches[:1] if _quick() else prefetches:
            os.environ["KTD_FSDP_PREFETCH"] = str(prefetch)
            name = f"{kind}{mesh_shape}/prefetch={prefetch}"
            run = {"name": name}
            try:
                keras.backend.clear_session()
                devices = keras.distribution.list_devices()
                mesh = keras.distribution.DeviceMesh(
                    mesh_shape, ["batch", "model"], devices
                )
                keras.distribution.set_distribution(
                    keras.distribution.ModelParallel(
                        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(
                            mesh
                        ),
                        batch_dim_name="batch",
                    )
                )
                keras.config.set_dtype_policy("mixed_bfloat16")
                model = llama_shapes.keras_causal_lm(keras, keras_hub, shape)
                model.compile(
                    optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True
                    ),
                    weighted_metrics=[],
                )
                model.fit(
                    x, y, batch_size=shape.global_batch, epochs=1, verbose=0
                )
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                tracing = cuda and kind == "fsdp" and prefetch == 1
                if tracing:
                    torch.cuda.memory._record_memory_history(max_entries=200000)
                model.fit(
                    x, y, batch_size=shape.global_batch, epochs=2, verbose=0
                )
                if tracing:
                    run["peak_above_start"] = live_at_peak(
                        torch.cuda.memory._snapshot()
                    )
                    torch.cuda.memory._record_memory_history(enabled=None)
                state = _state_bytes(model)
                run.update(state)
                run["model_bytes"] = sum(_numel(w) * 4 for w in model.weights)
                largest = _largest_block_bytes(model, mesh_shape[1])
                # Activations of one rank's rows are not counted: small here.
                run["expected_mib"] = round(
                    (state["params_bytes"] * 4 + largest * (prefetch + 1))
                    / 2**20,
                    1,
                )
                if cuda:
                    torch.cuda.synchronize()
                    run["peak_mib"] = round(
                        torch.cuda.max_memory_allocated() / 2**20, 1
                    )
                    run["steady_mib"] = round(base / 2**20, 1)
                    run["alloc_retries"] = torch.cuda.memory_stats().get(
                        "num_alloc_retries", 0
                    )
                else:  # (measured on CUDA only)
                    run["peak_mib"] = None
            except Exception:  # recorded per run
                run["error"] = traceback.format_exc()[-2000:]
            finally:
                keras.distribution.set_distribution(None)
                keras.config.set_dtype_policy("float32")
            runs.append(run)
    status = "ok" if not any("error" in r for r in runs) else "failed"
    return {
        "status": status,
        "world": world,
        "runs": runs,
        **(
            {"output": "\n".join(r["error"] for r in runs if "error" in r)}
            if status != "ok"
            else {}
        ),
    }


def live_at_peak(snapshot, top=10):
    """Replay a CUDA memory trace: the allocations made during it that were
    alive at its highest point, grouped by the innermost frame of this
    package (or else of Keras) that made them and by stream, largest
    first."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    groups = {}
    for event in at_peak.values():
        key = (_where(event.get("frames", [])), event.get("stream", 0))
        groups[key] = groups.get(key, 0) + event["size"]
    rows = sorted(groups.items(), key=lambda item: -item[1])[:top]
    return {
        "peak_mib": round(peak / 2**20, 1),
        "by_origin": [
            {"mib": round(size / 2**20, 1), "where": where, "stream": stream}
            for (where, stream), size in rows
        ],
    }


def _where(frames):
    for marker in ("keras_torch_distribution", "keras"):
        for frame in frames:
            if marker in frame.get("filename", ""):
                name = frame["filename"].split(marker, 1)[1].lstrip("/")
                return f"{marker}/{name}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "?"


def _state_bytes(model):
    """This rank's bytes of parameters and optimizer state."""
    from keras_torch_distribution._report import shard_table

    rows = shard_table(model)
    params = sum(r["bytes"] for r in rows if r.get("kind") != "optimizer")
    optimizer = sum(r["bytes"] for r in rows if r.get("kind") == "optimizer")
    return {"params_bytes": params, "optimizer_bytes": optimizer}


def _largest_block_bytes(model, model_axis):
    """The largest decoder block or embedding, whole on the batch axis
    (what one FSDP gather makes), in the compute dtype (bf16)."""
    sizes = [
        sum(_numel(w) for w in layer.weights)
        for layer in model.backbone.layers
        if layer.weights
    ]
    return max(sizes) * 2 // model_axis


def _numel(variable):
    size = 1
    for d in variable.shape:
        size *= d
    return size


def child_world(world):
    return lambda mode: _world_child(world)


def child_sanitizer(mode):
    return _world_child(2)


def _speed_shape():
    """The ~1.1 B keras_hub Llama of the speed section (4 x 512 tokens a
    step); KTD_GPU_CHECK_SPEED_SHAPE=tiny: a small one that runs on a CPU
    in seconds (to try the section's code without a GPU)."""
    import llama_shapes

    if os.environ.get("KTD_GPU_CHECK_SPEED_SHAPE") == "tiny":
        return llama_shapes.Shape(global_batch=4)
    return llama_shapes.Shape(
        vocab=32000,
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        ffn=8192,
        seq=512,
        global_batch=4,
    )


def child_speed(mode):
    """One mode's steps of the speed section's keras_hub Llama, bf16: the
    time from building to the end of the first step (compiling included),
    the losses of the first steps, then `SPEED_STEPS` steps timed together
    (one device sync at each end, none between: the host runs ahead as it
    would in training), with torch's sync debug mode counting the host
    syncs they make."""

    import llama_shapes

    shape = _speed_shape()
    warmup, steps = 3, SPEED_STEPS
    total = 1 + warmup + steps
    x, y = llama_shapes.arrays(
        0,
        llama_shapes.Shape(
            **dict(shape._asdict(), global_batch=shape.global_batch * total)
        ),
    )
    tokens = shape.global_batch * shape.seq
    runner = _torch_speed if mode.startswith("torch") else _keras_speed
    measured = runner(mode, shape, x, y, warmup, steps)
    step_s = measured.pop("seconds") / steps
    flops = 6 * shape.parameters() * tokens
    peak_flops = _peak_flops()
    return {
        "mode": mode,
        "parameters": shape.parameters(),
        "tokens_per_step": tokens,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s / peak_flops if peak_flops else None,
        **measured,
    }


SPEED_STEPS = 10


def _rows(shape, index):
    return slice(index * shape.global_batch, (index + 1) * shape.global_batch)


def _torch_speed(mode, shape, x, y, warmup, steps):
    """Raw torch: eager, or each block compiled (`block.compile()`, as
    torchtitan does); bf16 autocast; torch's Adam (fused on CUDA)."""
    import torch

    import llama_shapes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    torch.manual_seed(0)
    model = llama_shapes.torch_causal_lm(shape).to(device)
    if mode == "torch_compile":
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, fused=device == "cuda"
    )
    batches = [
        (
            torch.as_tensor(x[_rows(shape, i)]).long().to(device),
            torch.as_tensor(y[_rows(shape, i)]).long().to(device),
        )
        for i in range(1 + warmup + steps)
    ]

    def step(i):
        with torch.autocast(device, dtype=torch.bfloat16):
            one = llama_shapes.torch_train_step(model, optimizer, *batches[i])
            one()
        return one.last_loss

    _reset_peak(mode)
    losses = [float(step(0))]
    first_s = time.perf_counter() - started
    losses += [float(step(i)) for i in range(1, 1 + warmup)]
    with _counting_syncs() as syncs:
        _sync(mode)
        start = time.perf_counter()
        for i in range(1 + warmup, 1 + warmup + steps):
            step(i)
        _sync(mode)
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "first_s": first_s,
        "losses": losses,
        "syncs_in_timed_steps": syncs.count,
        "peak_mib": _peak(mode) / 2**20 if _peak(mode) else None,
    }


def _keras_speed(mode, shape, x, y, warmup, steps):
    """Keras: plain (the package not imported), the package without a
    distribution, under DataParallel or ModelParallel (Llama's layout map),
    eager or jit_compile (`_jit`), or Keras on JAX; each `fit` as a user
    runs it, `verbose=0`."""
    import keras
    import keras_hub

    import llama_shapes

    started = time.perf_counter()
    if mode.startswith("ktd"):
        import keras_torch_distribution  # noqa: F401

        keras.distribution.initialize()
        if mode.startswith("ktd_dp"):
            keras.distribution.set_distribution(
                keras.distribution.DataParallel()
            )
        elif mode.startswith("ktd_mp"):
            devices = keras.distribution.list_devices()
            mesh = keras.distribution.DeviceMesh(
                (1, len(devices)), ["batch", "model"], devices
            )
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(
                    layout_map=keras_hub.models.LlamaBackbone.get_layout_map(
                        mesh
                    ),
                    batch_dim_name="batch",
                )
            )
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = llama_shapes.keras_causal_lm(keras, keras_hub, shape)
    float8 = {}
    if "_f8" in mode:
        from keras_torch_distribution._backend import float8 as f8

        model.quantize("float8")
        float8["uses_scaled_mm"] = f8.uses_scaled_mm(keras.ops.zeros(()).device)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=mode.endswith("_jit") or mode == "keras_jax",
    )
    losses = []

    class Losses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    def fit(first, count, callbacks):
        rows = slice(
            first * shape.global_batch, (first + count) * shape.global_batch
        )
        model.fit(
            llama_shapes.keras_inputs(x[rows]),
            y[rows],
            batch_size=shape.global_batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )

    _reset_peak(mode)
    fit(0, 1, [Losses()])
    first_s = time.perf_counter() - started
    fit(1, warmup, [Losses()])
    profile = {}
    if mode in PROFILED_MODES:
        profile["profiler"] = _start_profiler()
    timing = _FitTiming(mode, steps)
    fit(1 + warmup, steps, [timing])
    if "profiler" in profile:
        profile["profiler"].stop()
        averages = profile["profiler"].key_averages()
        profile = {
            "steps": steps,
            "by_self_cpu": averages.table(
                sort_by="self_cpu_time_total", row_limit=25
            ),
            "by_self_cuda": averages.table(
                sort_by="self_device_time_total", row_limit=15
            ),
        }
    peak = _peak(mode)
    return {
        "seconds": timing.seconds,
        "first_s": first_s,
        "losses": losses,
        "syncs_in_timed_steps": timing.syncs,
        "peak_mib": peak / 2**20 if peak else None,
        **({"profile": profile} if profile else {}),
        **float8,
    }


def _fit_timing_class():
    import keras

    class FitTiming(keras.callbacks.Callback):
        """Times a fit's steps together: a device sync before the first
        and after the last (none between); torch's sync debug mode counts
        the syncs in between (the end of the epoch, where History reads
        the logs, is outside)."""

        reads_batch_logs = False

        def __init__(self, mode, steps):
            super().__init__()
            self.mode, self.steps = mode, steps
            self.seconds, self.syncs = None, None
            self.counting = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                _sync(self.mode)
                self.start = time.perf_counter()
                if self.mode != "keras_jax":
                    self.counting = _counting_syncs()
                    self.counted = self.counting.__enter__()

        def on_train_batch_end(self, batch, logs=None):
            if batch == self.steps - 1:
                if self.counting is not None:
                    self.counting.__exit__(None, None, None)
                    self.syncs = self.counted.count
                _sync(self.mode)
                self.seconds = time.perf_counter() - self.start

    return FitTiming


def _FitTiming(mode, steps):
    return _fit_timing_class()(mode, steps)


class _SyncCount:
    count = None


class _counting_syncs:
    """Within the block, torch's CUDA sync debug mode warns on every host
    sync; `count` is how many there were (None without CUDA)."""

    def __enter__(self):
        import torch

        self.result = _SyncCount()
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            import warnings

            self.warnings = warnings.catch_warnings(record=True)
            self.caught = self.warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self.result

    def __exit__(self, *exc_info):
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
            self.warnings.__exit__(*exc_info)
            self.result.count = sum(
                "synchroniz" in str(w.message) for w in self.caught
            )


# KTD_GPU_CHECK_PROFILE=1: a torch profile of PROFILED_STEPS more steps of
# these modes (after the timed ones) in the result.
PROFILED_MODES = (
    ("keras", "ktd_dp")
    if os.environ.get("KTD_GPU_CHECK_PROFILE") == "1"
    else ()
)
PROFILED_STEPS = 3


def _start_profiler():
    import torch

    activities = [
        torch.profiler.ProfilerActivity.CPU,
        torch.profiler.ProfilerActivity.CUDA,
    ]
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def _sync(mode):
    if mode == "keras_jax":
        import jax

        jax.effects_barrier()
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak(mode):
    if mode != "keras_jax":
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()


def _peak(mode):
    if mode == "keras_jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated()


def _peak_flops():
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


CHILDREN = {
    "environment": child_environment,
    "fit_mlp": child_fit_mlp,
    "fit_llama": child_fit_llama,
    "attention": child_attention,
    "checkpoint": child_checkpoint,
    "world2": child_world(2),
    "world4": child_world(4),
    "world8": child_world(8),
    "sanitizer": child_sanitizer,
    "speed": child_speed,
    "float8": child_speed,
}


if __name__ == "__main__":
    sys.exit(main())
