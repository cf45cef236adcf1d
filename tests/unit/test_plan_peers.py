"""`ktd plan` stops a script whose own collective needs real peers, with
its file and line, the collective and the fix; collectives that leave
rank 0's values as on N ranks, or skipped with `is_planning()`, pass."""

import os

import pytest
import torch.distributed as dist

from helpers import ROOT
from keras_torch_distribution.plan import _runner
from keras_torch_distribution.plan import is_planning
from keras_torch_distribution_cli import main as ktd_main

PLAN_PEERS = os.path.join(ROOT, "tests", "scripts", "plan_peers.py")


def _line_of(collective):
    """The line of plan_peers.py that calls `collective`."""
    with open(PLAN_PEERS) as script:
        lines = script.read().splitlines()
    return next(
        number
        for number, line in enumerate(lines, 1)
        if f"dist.{collective}(" in line and line.endswith("# needs peers")
    )


@pytest.mark.parametrize(
    "call,collective",
    [
        ("all_reduce", "all_reduce"),
        ("all_gather_object", "all_gather_object"),
        ("broadcast_object_list_from_1", "broadcast_object_list"),
    ],
)
def test_a_collective_of_the_script_is_refused_with_its_line(call, collective):
    with pytest.raises(_runner.PlanError) as error:
        _runner.plan(4, PLAN_PEERS, [call], step="no")
    message = str(error.value)
    assert f"{PLAN_PEERS}:{_line_of(collective)} calls " in message
    assert f"torch.distributed.{collective}," in message
    assert "depends on the other ranks" in message
    assert "if not is_planning()" in message and "ktd run" in message
    assert not dist.is_initialized()
    assert dist.all_reduce.__module__.startswith("torch.distributed")


def test_ktd_plan_exits_2_naming_the_collective(capsys):
    assert ktd_main(["plan", "--world", "2", PLAN_PEERS, "all_reduce"]) == 2
    assert "calls torch.distributed.all_reduce" in capsys.readouterr().err


@pytest.mark.parametrize("call", ["from_rank_0", "guarded"])
def test_collectives_that_need_no_peers_pass(call):
    plan = _runner.plan(4, PLAN_PEERS, [call], step="no")
    assert plan["world"] == 4 and plan["stopped_at"] == "fit"
    assert not is_planning()


def test_a_helper_module_is_named_with_the_script_line(tmp_path):
    (tmp_path / "helper.py").write_text(
        "import torch, torch.distributed as dist\n"
        "def agree():\n"
        "    dist.all_reduce(torch.ones(1))\n"
    )
    script = tmp_path / "train.py"
    script.write_text(
        "import keras\n"
        "import keras_torch_distribution\n"
        "import helper\n"
        "try:\n"
        "    helper.agree()\n"
        "except Exception:\n"
        "    pass\n"
    )
    with pytest.raises(_runner.PlanError) as error:
        _runner.plan(2, str(script))
    message = str(error.value)
    assert "helper.py:3 (called from " in message
    assert "train.py:5)" in message
