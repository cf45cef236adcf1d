"""The plan counts the collectives a CUDA mesh issues: a DTensor
redistribution between two sharded dims is one all_to_all (NCCL), which
torch runs on this CPU mesh as an all-gather plus a chunk. The counts are
checked against torch's redistribute planner: the transforms it plans
(what a CUDA mesh executes, one collective each) named by kind."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import _redistribute

from helpers import ROOT
from keras_torch_distribution.plan import _collective_counts
from keras_torch_distribution.plan import _world

PLAN_TRAIN = os.path.join(ROOT, "tests", "scripts", "plan_train.py")


def planned_kind(src, dst):
    """The collective a CUDA mesh issues for one planned transform."""
    if src.is_partial():
        return "all_reduce" if dst.is_replicate() else "reduce_scatter"
    if src.is_shard() and dst.is_replicate():
        return "all_gather"
    if src.is_shard() and dst.is_shard():
        return "all_to_all"
    return None  # local: Replicate -> Shard or Partial


class PlannedTransforms:
    """Within the block, the kinds of the transforms torch's redistribute
    planner gives every redistribution (`kinds`, a list)."""

    def __init__(self):
        self.kinds = []

    def __enter__(self):
        self.original = _redistribute._optimize_transform_infos

        def spy(*args, **kwargs):
            infos = self.original(*args, **kwargs)
            for info in infos:
                kind = planned_kind(*info.src_dst_placements)
                if kind:
                    self.kinds.append(kind)
            return infos

        _redistribute._optimize_transform_infos = spy
        return self

    def __exit__(self, *exc):
        _redistribute._optimize_transform_infos = self.original


CASES = [
    ((4,), [Shard(0)], [Shard(1)]),
    ((4,), [Shard(1)], [Shard(0)]),
    ((4,), [Shard(0)], [Replicate()]),
    ((4,), [Partial()], [Shard(0)]),
    ((4,), [Partial()], [Replicate()]),
    ((2, 2), [Shard(0), Shard(1)], [Shard(1), Shard(0)]),
    ((2, 2), [Shard(0), Replicate()], [Shard(1), Shard(0)]),
]


@pytest.mark.parametrize("shape,src,dst", CASES)
def test_counts_equal_the_redistribute_planners_transforms(shape, src, dst):
    from torch.distributed.device_mesh import init_device_mesh

    with _world.simulated(4):
        mesh = init_device_mesh("cpu", shape)
        whole = torch.arange(64.0).reshape(8, 8)
        local = whole
        for axis, placement in enumerate(src):
            if placement.is_shard():
                local = local.chunk(shape[axis], placement.dim)[0]
        value = DTensor.from_local(
            local.contiguous(), mesh, src, shape=(8, 8), stride=(8, 1)
        )
        with PlannedTransforms() as planned, _collective_counts.tally() as t:
            moved = value.redistribute(mesh, dst)
        assert tuple(moved.placements) == tuple(dst)
    expected = {}
    for kind in planned.kinds:
        expected[kind] = expected.get(kind, 0) + 1
    assert planned.kinds, "the planner planned no collective"
    assert {k: v for k, v in t.counts.items() if v} == expected
    if expected == {"all_to_all": 1}:
        # it sends this rank's whole input (its local shard)
        assert t.bytes["all_to_all"] == local.numel() * local.element_size()


ORACLE = """
import contextlib, json, sys
sys.path[:0] = [{tests!r}, {unit!r}]
from test_plan_collectives import PlannedTransforms
from keras_torch_distribution.plan import _collective_counts, _runner

planned = []
tally = _collective_counts.tally

@contextlib.contextmanager
def tally_and_plan():
    with PlannedTransforms() as transforms, tally() as counted:
        yield counted
    planned[:] = transforms.kinds

_collective_counts.tally = tally_and_plan
plan = _runner.plan(2, {script!r}, ["llama", "tp"])
print(json.dumps([plan["collectives_per_step"], planned]))
"""


def test_the_plans_all_to_all_row_counts_what_a_cuda_mesh_issues():
    """A tiny Llama under its tensor-parallel layout map at world 2: its
    step redistributes one activation from one sharded dim to another.
    The plan shows it as the all_to_all a CUDA mesh issues, as many as the
    redistribute planner planned in the counted step, and counts no
    all-gather for it (every all-gather the planner planned is counted,
    besides those the package issues itself)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KTD_DEVICE"):
        env.pop(key, None)
    tests = os.path.join(ROOT, "tests")
    code = ORACLE.format(
        tests=tests, unit=os.path.join(tests, "unit"), script=PLAN_TRAIN
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    counted, planned = json.loads(result.stdout.strip().splitlines()[-1])
    assert counted["all_to_all"]["count"] == planned.count("all_to_all")
    assert counted["all_gather"]["count"] >= planned.count("all_gather")
    if "all_to_all" in planned:  # torch 2.11's planner gathers instead
        assert counted["all_to_all"]["bytes"] > 0
