"""`ktd plan`'s errors, that its simulated world leaves nothing behind,
its FSDP figure measured in a step on fake tensors against a count by
hand, and a step that fake tensors cannot run (the multi-process
comparison with real runs is tests/multiprocess/test_plan.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from helpers import ROOT
from keras_torch_distribution.plan import _command
from keras_torch_distribution.plan import _runner
from keras_torch_distribution.plan import _world
from keras_torch_distribution_cli import main as ktd_main

PLAN_TRAIN = os.path.join(ROOT, "tests", "scripts", "plan_train.py")


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", ""])
def test_a_bad_world_is_named_with_the_fix(bad):
    with pytest.raises(ValueError) as error:
        _world.check_world(bad)
    assert f"--world {bad!r}" in str(error.value)
    assert "whole number >= 1" in str(error.value)


def test_ktd_plan_refuses_world_zero_with_status_2(capsys):
    assert ktd_main(["plan", "--world", "0", "train.py"]) == 2
    assert "--world 0 is not a number of processes" in capsys.readouterr().err


def test_arguments():
    options, script, args = _command.parse(
        ["--world", "8", "--json=out.json", "train.py", "--epochs", "3"]
    )
    assert options == {"world": "8", "json": "out.json", "step": "auto"}
    assert (script, args) == ("train.py", ["--epochs", "3"])
    with pytest.raises(ValueError, match="unknown option --wrld"):
        _command.parse(["--wrld", "8", "train.py"])
    with pytest.raises(ValueError, match="--world N"):
        _command.parse(["train.py"])
    with pytest.raises(ValueError, match="give the script"):
        _command.parse(["--world", "2"])


def test_a_script_that_never_fits_is_named_and_no_group_is_left(tmp_path):
    script = tmp_path / "no_fit.py"
    script.write_text(
        "import keras\nassert len(keras.distribution.list_devices()) == 3\n"
    )
    with pytest.raises(_runner.PlanError) as error:
        _runner.plan(3, str(script))
    message = str(error.value)
    assert str(script) in message and "never" not in message.split(":")[0]
    assert "without calling fit" in message and "model.fit" in message
    assert not dist.is_initialized()
    assert "KTD_DEVICE" not in os.environ or os.environ["KTD_DEVICE"] != "cpu"


def test_a_missing_script_is_named(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(_runner.PlanError, match="is not a file"):
        _runner.plan(2, missing)


def _plan_json(tmp_path, world, script, *args, step="auto"):
    """`ktd plan --json` in a subprocess (the fake process group never
    enters the pytest process): the plan's dict."""
    out = tmp_path / "plan.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KTD_DEVICE"):
        env.pop(key, None)
    env.pop("KTD_FSDP_PREFETCH", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_torch_distribution",
            "plan",
            "--world",
            str(world),
            "--json",
            str(out),
            "--step",
            step,
            str(script),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_bad_step_choice_is_named(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError) as error:
        _runner.plan(2, str(script), step="maybe")
    assert "--step 'maybe'" in str(error.value)
    assert "auto, fake, real, no" in str(error.value)


def test_fsdp_gathers_measured_on_fake_tensors_by_hand(tmp_path):
    """The MLP of plan_train.py under FSDP at world 4, its step on fake
    tensors, prefetching one group (CUDA's default). dense_0's kernel
    (12x20, float32, sharded on dim 0) is gathered in one flat buffer of
    960 B and used as views of it; dense_1's (20x10, sharded on dim 1 into
    3, 3, 3 and 1 columns) travels padded to 20x12 (960 B) and is copied
    out (800 B); dense_2's (10x3) in 144 B. The most held at once is
    dense_0's gather in use with dense_1's prefetched: 1920 B (dense_1's
    flat buffer with its copy, 1760 B, comes after dense_0's is let go)."""
    plan = _plan_json(tmp_path, 4, PLAN_TRAIN, "mlp", "fsdp", step="fake")
    assert plan["step_kind"] == "fake" and plan["fsdp_prefetch"] == 1
    for row in plan["per_rank"]:
        assert row["fsdp_figure"] == "measured"
        assert row["fsdp_gathered_bytes"] == 1920
        assert row["fsdp_largest_gather_bytes"] == 960
        assert row["peak_bytes"] == row["total_bytes"] + 1920
    assert plan["collectives_per_step"]["all_gather"] == {
        "count": 4,
        "bytes": 960 + 960 + 144 + 960,  # dense_1 regathered for backward
    }


def test_a_fake_step_that_needs_a_value_says_so(tmp_path):
    """A layer that branches on a tensor's value cannot run on fake
    tensors: the plan says which op needed a value and what to do, and
    still gives the per-rank bytes (FSDP's figure estimated, and said
    so)."""
    script = tmp_path / "branchy.py"
    script.write_text(
        "import keras, numpy as np\n"
        "import keras_torch_distribution  # noqa: F401\n"
        "devices = keras.distribution.list_devices()\n"
        "mesh = keras.distribution.DeviceMesh(\n"
        "    (len(devices), 1), ['batch', 'model'], devices)\n"
        "layout_map = keras.distribution.LayoutMap(mesh)\n"
        "layout_map['.*kernel'] = ('batch', None)\n"
        "keras.distribution.set_distribution(keras.distribution."
        "ModelParallel(layout_map=layout_map, batch_dim_name='batch'))\n"
        "class Branchy(keras.layers.Layer):\n"
        "    def call(self, x):\n"
        "        return x if float(keras.ops.sum(x)) > 0 else -x\n"
        "model = keras.Sequential([keras.Input((4,)), "
        "keras.layers.Dense(8), Branchy(), keras.layers.Dense(1)])\n"
        "model.compile(optimizer='adam', loss='mse')\n"
        "x = np.ones((4, 4), 'float32')\n"
        "model.fit(x, np.ones((4, 1), 'float32'), batch_size=4, verbose=0)\n"
    )
    plan = _plan_json(tmp_path, 2, script, step="fake")
    assert not plan["step_simulated"] and plan["collectives_per_step"] is None
    reason = plan["no_step_reason"]
    assert "needs a value" in reason and "_local_scalar_dense" in reason
    assert "--step real" in reason
    assert plan["per_rank"][0]["fsdp_figure"] == "estimated"
    assert plan["per_rank"][0]["params_bytes"] > 0


def _plan_command(argv, tmp_path):
    """`ktd plan ARGV` through `_command.main` in a subprocess:
    (status, stdout, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KTD_DEVICE"):
        env.pop(key, None)
    code = (
        "import sys\nfrom keras_torch_distribution.plan import _command\n"
        "sys.exit(_command.main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.returncode, result.stdout, result.stderr


def test_json_to_stdout_keeps_the_scripts_prints_off_it(tmp_path):
    """`--json -`: stdout is the JSON alone (with its format version); the
    script's own prints, the progress lines and the text plan go to
    stderr."""
    script = tmp_path / "chatty.py"
    script.write_text(
        "import os, runpy, sys\n"
        "print('hello from the script')\n"
        "os.write(1, b'native write\\n')\n"
        f"sys.argv = [{PLAN_TRAIN!r}, 'mlp', 'dp']\n"
        f"runpy.run_path({PLAN_TRAIN!r}, run_name='__main__')\n"
    )
    status, out, err = _plan_command(
        ["--world", "2", "--json", "-", str(script)], tmp_path
    )
    assert status == 0, err[-3000:]
    plan = json.loads(out)
    assert plan["format_version"] == _command.FORMAT_VERSION == 1
    assert plan["world"] == 2 and plan["collectives_backend"] == "nccl"
    assert "hello from the script" in err and "native write" in err
    assert "collectives per training step" in err  # the text plan
    progress = [
        line for line in err.splitlines() if line.startswith("ktd plan [")
    ]
    assert len(progress) == 3, progress
    assert "rank 0 of 2 simulated processes" in progress[0]
    assert "one training step on fake tensors" in progress[1]
    assert not list(tmp_path.glob("-"))


def test_the_json_path_is_checked_before_planning(tmp_path):
    """A --json into a missing folder is refused at once, status 2, naming
    the path: the script never runs."""
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    path = str(tmp_path / "missing" / "plan.json")
    status, out, err = _plan_command(
        ["--world", "2", "--json", path, str(script)], tmp_path
    )
    assert status == 2 and out == ""
    assert f"--json {path!r}" in err and "does not exist" in err
    assert "--json -" in err
    assert not marker.exists()
    with pytest.raises(ValueError, match="is a folder"):
        _command.check_json_path(str(tmp_path))


def test_a_mesh_for_another_world_names_world(tmp_path):
    """A script whose mesh needs 4 devices, planned at --world 2: the error
    names --world 2 and the fix, with Keras' own words."""
    script = tmp_path / "mesh4.py"
    script.write_text(
        "import keras\nimport keras_torch_distribution  # noqa: F401\n"
        "keras.distribution.DeviceMesh((2, 2), ['batch', 'model'],\n"
        "    keras.distribution.list_devices())\n"
    )
    with pytest.raises(_runner.PlanError) as error:
        _runner.plan(2, str(script))
    message = str(error.value)
    assert "--world 2" in message and "needs 4 devices" in message
    assert "list_devices()" in message
    assert not dist.is_initialized()
