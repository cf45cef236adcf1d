"""`ktd plan`'s errors, and that its simulated world leaves nothing behind
(the multi-process comparison is tests/multiprocess/test_plan.py)."""

import os

import pytest
import torch.distributed as dist

from keras_torch_distribution import cli
from keras_torch_distribution.plan import command
from keras_torch_distribution.plan import runner
from keras_torch_distribution.plan import world


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", ""])
def test_a_bad_world_is_named_with_the_fix(bad):
    with pytest.raises(ValueError) as error:
        world.check_world(bad)
    assert f"--world {bad!r}" in str(error.value)
    assert "whole number >= 1" in str(error.value)


def test_ktd_plan_refuses_world_zero_with_status_2(capsys):
    assert cli.main(["plan", "--world", "0", "train.py"]) == 2
    assert "--world '0'" in capsys.readouterr().err


def test_arguments():
    options, script, args = command.parse(
        ["--world", "8", "--json=out.json", "train.py", "--epochs", "3"]
    )
    assert options == {"world": "8", "json": "out.json", "step": "auto"}
    assert (script, args) == ("train.py", ["--epochs", "3"])
    with pytest.raises(ValueError, match="unknown option --wrld"):
        command.parse(["--wrld", "8", "train.py"])
    with pytest.raises(ValueError, match="--world N"):
        command.parse(["train.py"])
    with pytest.raises(ValueError, match="give the script"):
        command.parse(["--world", "2"])


def test_a_script_that_never_fits_is_named_and_no_group_is_left(tmp_path):
    script = tmp_path / "no_fit.py"
    script.write_text(
        "import keras\nassert len(keras.distribution.list_devices()) == 3\n"
    )
    with pytest.raises(runner.PlanError) as error:
        runner.plan(3, str(script))
    message = str(error.value)
    assert str(script) in message and "never" not in message.split(":")[0]
    assert "without calling fit" in message and "model.fit" in message
    assert not dist.is_initialized()
    assert "KTD_DEVICE" not in os.environ or os.environ["KTD_DEVICE"] != "cpu"


def test_a_missing_script_is_named(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(runner.PlanError, match="is not a file"):
        runner.plan(2, missing)
