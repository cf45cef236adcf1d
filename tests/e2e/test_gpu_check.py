"""tools/gpu-check without a GPU: it runs what runs on CPU tensors (world-1
fits against plain Keras, simulated worlds under the fake process group),
lists the GPU-only sections as skipped, and writes its JSON. Its analysis
helpers (fit comparison, the memory trace replay) are checked on made-up
inputs."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402


def _fit(name, losses, precision="float32", jit=False, **extra):
    return dict(name=name, precision=precision, jit=jit, losses=losses, **extra)


def test_fits_are_compared_with_plain_keras_of_the_same_configuration():
    plain = [
        _fit("plain/float32", [1.0, 0.5]),
        _fit("plain/bf16", [1.0, 0.5], "mixed_bfloat16"),
    ]
    package = [
        _fit("DataParallel/float32", [1.0, 0.5]),
        _fit("ModelParallel/float32", [1.0, 0.51]),
        _fit("DataParallel/bf16", [1.01, 0.5], "mixed_bfloat16"),
        _fit("DataParallel/bf16/jit", [1.0, 0.5], "mixed_bfloat16", True),
        _fit(
            "DataParallel/float32/fallback",
            [1.0, 0.5],
            fallback="could not run",
        ),
        dict(
            name="broken",
            precision="float32",
            jit=False,
            error="Traceback: boom",
        ),
    ]
    rows = {r["fit"]: r for r in gpu_check.compare_fits(plain, package)}
    assert rows["DataParallel/float32"]["ok"]
    assert rows["DataParallel/float32"]["max_relative_difference"] == 0.0
    assert not rows["ModelParallel/float32"]["ok"]  # 2 % off in float32
    assert rows["ModelParallel/float32"][
        "max_relative_difference"
    ] == pytest.approx(0.02)
    assert rows["DataParallel/bf16"]["ok"]  # 1 % is within bf16's tolerance
    assert not rows["DataParallel/bf16/jit"][
        "ok"
    ]  # no plain jit fit to compare with
    assert "no plain Keras fit" in rows["DataParallel/bf16/jit"]["error"]
    assert not rows["DataParallel/float32/fallback"][
        "ok"
    ]  # eager fallback is a failure
    assert rows["broken"]["error"] == "Traceback: boom"


def test_the_memory_trace_is_replayed_to_what_was_alive_at_its_peak():
    def frames(where):
        return [
            {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "f"},
            {
                "filename": f"/s/keras_torch_distribution/{where}",
                "line": 7,
                "name": "g",
            },
        ]

    mib = 2**20
    trace = [
        {
            "action": "alloc",
            "addr": 1,
            "size": 4 * mib,
            "stream": 0,
            "frames": frames("a.py"),
        },
        {
            "action": "alloc",
            "addr": 2,
            "size": 8 * mib,
            "stream": 7,
            "frames": frames("b.py"),
        },
        {"action": "free_requested", "addr": 1, "size": 4 * mib},
        {
            "action": "alloc",
            "addr": 3,
            "size": 1 * mib,
            "stream": 0,
            "frames": frames("a.py"),
        },
        {"action": "free_completed", "addr": 1, "size": 4 * mib},
        {"action": "free_completed", "addr": 2, "size": 8 * mib},
        {
            "action": "alloc",
            "addr": 4,
            "size": 2 * mib,
            "stream": 0,
            "frames": [],
        },
    ]
    result = gpu_check.live_at_peak({"device_traces": [trace]})
    assert (
        result["peak_mib"] == 13.0
    )  # 4 + 8 + 1: a block counts until its free completes
    assert result["by_origin"] == [
        {"mib": 8.0, "where": "keras_torch_distribution/b.py:7 g", "stream": 7},
        {"mib": 5.0, "where": "keras_torch_distribution/a.py:7 g", "stream": 0},
    ]


@pytest.mark.slow
def test_without_cuda_the_cpu_sections_run_and_the_rest_are_skipped(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            os.path.join(ROOT, "tools", "gpu-check"),
            "--quick",
            "--jobs",
            "2",
            "--sections",
            "environment,fit_mlp,world2,attention,speed",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["skipped"] == {
        "attention": "no CUDA device",
        "speed": "no CUDA device",
    }
    sections = report["sections"]
    assert sections["environment"]["cuda_available"] is False
    comparisons = sections["fit_mlp"]["comparisons"]
    assert [c["fit"] for c in comparisons] == [
        "DataParallel/float32/jit=False",
        "DataParallel/mixed_bfloat16/jit=False",
        "ModelParallel/float32/jit=False",
        "ModelParallel/mixed_bfloat16/jit=False",
    ]
    assert all(c["ok"] for c in comparisons), comparisons
    assert sections["fit_mlp"]["package"]["list_devices"] == ["cpu:0"]
    world = sections["world2"]
    assert [r["name"] for r in world["runs"]] == ["fsdp(2, 1)/prefetch=0"]
    # Rank 0 of 2 holds half of every variable the layout map shards on
    # the batch axis: less than the whole model's parameters.
    assert (
        0 < world["runs"][0]["params_bytes"] < world["runs"][0]["model_bytes"]
    )
    assert "skipped: no CUDA device" in proc.stdout


def test_on_a_small_cpu_machine_the_check_is_sized_for_it():
    """Issue 48: `tools/gpu-check` without CUDA ran every CPU section at
    full size (15 min) with 4 sections at a time on 2 cores."""
    assert gpu_check.default_jobs(2) == 1
    assert gpu_check.default_jobs(1) == 1
    assert gpu_check.default_jobs(16) == 4
    assert gpu_check.chosen_sections(None, False, cuda=False) == (
        gpu_check.QUICK,
        True,
    )
    assert gpu_check.chosen_sections(None, False, cuda=True) == (
        list(gpu_check.SECTIONS),
        False,
    )
    assert gpu_check.chosen_sections("world2,fit_mlp", False, cuda=False) == (
        ["world2", "fit_mlp"],
        False,
    )


def test_a_timed_out_section_says_so_and_no_peak_is_shown_as_nan():
    timed_out = gpu_check.run_child("environment", timeout=0.001)
    assert timed_out["status"] == "failed"
    assert timed_out["output"].startswith(
        "timed out after 0.001 s (this section's limit); its last output:"
    ), timed_out
    world = {
        "status": "ok",
        "seconds": 1.0,
        "runs": [
            {
                "name": "fsdp(2, 1)/prefetch=0",
                "peak_mib": None,
                "expected_mib": 1.5,
            }
        ],
    }
    summary = "\n".join(
        gpu_check.summarize(
            {
                "device": "cpu",
                "skipped": {},
                "sections": {"world2": world, "checkpoint": timed_out},
            }
        )
    )
    assert "nan" not in summary
    assert (
        "expected      1.5 MiB (the peak is measured on CUDA only)" in summary
    )
    assert "timed out after 0.001 s" in summary
