"""examples/lora_finetune.py under `ktd run -n 4`: LoRA fine-tuning of a
keras_hub causal LM on a 2 x 2 mesh, generation, adapters saved on 4
processes and loaded back."""

import ast
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytest.importorskip(
    "keras_hub",
    reason="keras_hub is not installed; .ci/run installs it with: pip install "
    "--no-deps keras-hub==0.32.0 (the test extra holds what it needs)",
)


def _printed(stdout, prefix):
    line = next(s for s in stdout.splitlines() if s.startswith(prefix))
    return ast.literal_eval(line[len(prefix) :].strip())


@pytest.mark.slow
def test_lora_example_on_a_2x2_mesh(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu")
    env.pop("KERAS_BACKEND", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_torch_distribution",
            "run",
            "-n",
            "4",
            "examples/lora_finetune.py",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    base = _printed(run.stdout, "base loss per epoch:")
    lora = _printed(run.stdout, "LoRA loss per epoch:")
    assert base[-1] < base[0] / 2 and lora[-1] < lora[0], (base, lora)
    generated = _printed(run.stdout, "generated:")
    assert generated[0].startswith("the cat sat") and generated[1].startswith(
        "the dog"
    )
    assert "reloaded adapters generate the same: True" in run.stdout
    assert sorted(os.listdir(tmp_path)) == [
        "adapters.lora.h5",
        "base.weights.h5",
    ]
    # Printed once (rank 0), not by every process.
    assert run.stdout.count("generated:") == 1
