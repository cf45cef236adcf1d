"""Run a script in the simulated world and assemble its plan.

`plan(world, script, args)` runs `script` (as `python script args` would:
`__main__`, its folder first on sys.path, sys.argv) as rank 0 of `world`
processes, with variables unwritten (`_values`) and its own collectives
that need real peers refused (`_peers`), up to its first fit /
evaluate / predict / save (`_stops`), and returns the plan: a dict of plain
values (see `_output` for its fields).
"""

import contextlib
import math
import os
import resource
import runpy
import sys
import time

from keras_torch_distribution import _keras
from keras_torch_distribution._backend import distribution_lib
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._log import say_grouped
from keras_torch_distribution._variables import left_whole
from keras_torch_distribution.plan import _fsdp_figure
from keras_torch_distribution.plan import _peers
from keras_torch_distribution.plan import _shards
from keras_torch_distribution.plan import _stops
from keras_torch_distribution.plan import _values
from keras_torch_distribution.plan import _world as simulated_world

# A fit's step runs on fake tensors (`_fake_step`: nothing allocated, any
# model size) unless --step real asks for rank 0's own tensors: a real step
# writes rank 0's whole state and holds FSDP's gathered weights and the
# activations, which a small shard does not bound (Gemma 2 9B at world
# 512: 285 MiB of state, 10 GiB resident in a real step). "auto" is the
# default's name (the fake step); "yes" the older name of "real".
STEP_CHOICES = ("auto", "fake", "real", "no", "yes")


class PlanError(RuntimeError):
    """The script cannot be planned as it is (the message says why)."""


def plan(world, script, args=(), step="auto", progress=None):
    """The plan of `script args` at `world` processes (see the module
    docstring). `progress(text)`, if given, hears each phase."""
    progress = progress or (lambda text: None)
    world = simulated_world.check_world(world)
    if step not in STEP_CHOICES:
        raise ValueError(
            f"--step {step!r} is not one of {', '.join(STEP_CHOICES[:4])}: "
            "fake (auto, the default) runs the training step on fake "
            "tensors (nothing allocated), real on rank 0's own tensors, no "
            "skips it."
        )
    if not os.path.isfile(script):
        raise PlanError(
            f"ktd plan: script {script!r} is not a file: give the path of "
            "the Python script to plan (ktd plan --world N script.py ARGS)."
        )
    started = time.perf_counter()

    def step_kind(model):
        if step == "no":
            progress("stopped at the script's first fit; no step (--step no)")
            return None, "--step no"
        kind = "real" if step in ("real", "yes") else "fake"
        progress(
            "stopped at the script's first fit: simulating one training "
            f"step on {kind} tensors, counting its collectives"
        )
        return kind, None

    progress(f"running {script} as rank 0 of {world} simulated processes")
    with (
        _planned_prefetch(),
        simulated_world.simulated(world),
        _values.unmaterialised(),
        _peers.refusing(script),
        _stops.stopping(step_kind) as record,
    ):
        _run_script(script, args, record)
        if record.model is None:
            raise PlanError(
                f"ktd plan: {script!r} ended without calling fit, evaluate, "
                "predict or save on a Keras model, where the plan reads the "
                "model's variables. Make the script build its model and call "
                "model.fit(...) (the plan stops there, before training)."
            )
        say_grouped()  # findings of a script stopped before its first update
        progress(
            f"stopped at {record.stopped_at}: each rank's bytes, {world} ranks"
        )
        result = assemble(record, world)
    result["script"] = [script, *args]
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    result["peak_rss_bytes"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return result


def len_devices():
    """The simulated world's size (while planning)."""
    import torch.distributed as dist

    return dist.get_world_size()


def _run_script(script, args, record):
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except _stops.Stopped:
        pass
    except _peers.NeedsPeers as error:
        raise PlanError(str(error)) from None
    except distribution_lib.MeshSizeError as error:
        raise PlanError(
            f"ktd plan: {script!r} builds a mesh for another number of "
            f"devices than the --world {len_devices()} planned for "
            f"({str(error).strip()}). Give --world the mesh's number of "
            "devices, or build the mesh from "
            "keras.distribution.list_devices(), whose length is --world."
        ) from None
    except SystemExit as exit_:
        if record.model is None:
            raise PlanError(
                f"ktd plan: {script!r} exited (code {exit_.code!r}) before "
                "calling fit, evaluate, predict or save: nothing to plan. "
                "Check that it runs with `python` and reaches model.fit."
            ) from exit_
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _prefetch():
    """FSDP's prefetch depth on the machines planned for: KTD_FSDP_PREFETCH
    if set, else CUDA's default (1)."""
    return (
        gathering.prefetch_depth() if os.environ.get("KTD_FSDP_PREFETCH") else 1
    )


@contextlib.contextmanager
def _planned_prefetch():
    """Within the block, FSDP prefetches as on the machines planned for
    (`_prefetch`), not as on this CPU (0)."""
    saved = os.environ.get("KTD_FSDP_PREFETCH")
    os.environ["KTD_FSDP_PREFETCH"] = str(_prefetch())
    try:
        yield
    finally:
        if saved is None:
            del os.environ["KTD_FSDP_PREFETCH"]
        else:
            os.environ["KTD_FSDP_PREFETCH"] = saved


def assemble(record, world):
    """The plan's dict from the stopped script's model."""
    model = record.model
    grads = record.gradient_layouts
    _shards.forget()
    _shards.check_rank0(model, grads)
    groups = _shards.fsdp_groups(model)
    prefetch = _prefetch()
    rows = {}
    for rank in range(world):
        row = {
            "params_bytes": _shards.params_bytes(model, rank),
            "grads_bytes": _shards.grads_bytes(model, rank, grads),
            "optimizer_bytes": _shards.optimizer_bytes(model, rank),
        }
        row["total_bytes"] = sum(row.values())
        row.update(
            _fsdp_figure.figures(groups, record.gathered, rank, prefetch)
        )
        row["peak_bytes"] = row["total_bytes"] + row.get(
            "fsdp_gathered_bytes", 0
        )
        key = tuple(sorted(row.items()))
        rows.setdefault(key, dict(row, rank=rank, ranks=[]))["ranks"].append(
            rank
        )
    per_rank = sorted(rows.values(), key=lambda r: r["rank"])
    worst = max(per_rank, key=lambda r: (r["peak_bytes"], -r["rank"]))
    variables = _shards.unique(model.variables)
    parameters = sum(math.prod(v.shape) for v in variables)
    model_bytes = sum(
        left_whole.global_bytes(v.shape, _keras.raw_value(v).dtype)
        for v in variables
    )
    distribution = _keras.current_distribution()
    mesh = getattr(distribution, "device_mesh", None)
    tally = record.tally
    return {
        "world": world,
        "stopped_at": record.stopped_at,
        "distribution": type(distribution).__name__ if distribution else None,
        "mesh": {
            "shape": list(mesh.shape),
            "axis_names": list(mesh.axis_names),
        }
        if mesh is not None
        else None,
        "parameters": int(parameters),
        "model_bytes": int(model_bytes),
        "accelerate_estimate": {
            "model_bytes": int(model_bytes),
            "training_adam_bytes": int(4 * model_bytes),
        },
        "optimizer": type(model.optimizer).__name__
        if getattr(model, "optimizer", None) is not None
        else None,
        "fsdp_groups": len(groups),
        "fsdp_prefetch": prefetch if groups else None,
        "per_rank": per_rank,
        "worst_rank": worst["rank"],
        "step_simulated": tally is not None,
        "step_kind": record.step_kind if tally is not None else None,
        "no_step_reason": record.no_step,
        "collectives_backend": "nccl",
        "collectives_per_step": _collectives(tally),
        "left_whole": [
            {
                "path": entry["variable"].path,
                "bytes": _shards.variable_bytes(entry["variable"], 0),
                "key": entry["key"],
                "axes": list(entry["axes"]),
            }
            for entry in left_whole.left_whole(variables, distribution)
        ],
    }


def _collectives(tally):
    """kind -> count and bytes of the counted step, as a CUDA (NCCL) mesh
    issues them (`_collective_counts`: a redistribution between sharded
    dims is one all_to_all, never the CPU's all-gather); all_to_all shown
    even where none. None without a counted step."""
    if tally is None:
        return None
    counts = dict(tally.counts)
    counts.setdefault("all_to_all", 0)
    return {
        kind: {"count": count, "bytes": tally.bytes.get(kind, 0)}
        for kind, count in counts.items()
    }
