"""A finding many variables share is one line: the variables named (a
few) and counted, their optimizer slots counted apart. `ktd plan` of
examples/transformer_lm.py at world 8 said "replicated instead" 42 times
(14 variables and their 28 slots); now once per layout."""

import os
import re
import subprocess
import sys

from helpers import ROOT
from keras_torch_distribution import _log


def test_variables_and_slots_counted_apart():
    variables = [
        f"block{i}/attention/{n}/kernel" for i in range(7) for n in "qk"
    ]
    slots = [
        f"adam/{v.replace('/', '_')}_{slot}"
        for v in variables
        for slot in ("momentum", "velocity")
    ]
    assert _log.subjects_text(variables + slots) == (
        "14 variables ('block0/attention/q/kernel', 'block0/attention/k/"
        "kernel', 'block1/attention/q/kernel', ... 11 more) and their 28 "
        "optimizer slots"
    )
    assert _log.subjects_text(["a/kernel"]) == "variable 'a/kernel'"


def test_the_plan_says_replicated_instead_once_per_layout():
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KTD_DEVICE"):
        env.pop(key, None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_torch_distribution",
            "plan",
            "--world",
            "8",
            "--step",
            "no",
            os.path.join(ROOT, "examples", "transformer_lm.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [
        line
        for line in result.stderr.splitlines()
        if "replicated instead" in line
    ]
    counts = sorted(
        tuple(
            map(
                int,
                re.search(
                    r"(\d+) variables .* their (\d+) optimizer", line
                ).groups(),
            )
        )
        for line in lines
    )
    assert counts == [(2, 4), (6, 12), (6, 12)], lines
