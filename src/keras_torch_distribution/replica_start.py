"""Copies of a variable start equal: one broadcast before a model's first step.

Processes seeded differently (`keras.utils.set_random_seed(1000 + rank)`, a
common way to vary augmentation) initialize replicated variables
differently, and data-parallel training would keep them apart. As
DistributedDataParallel broadcasts parameters and buffers from rank 0 when it
wraps a module, the first train, test or predict step of each model under a
distribution makes every copy of its variables (weights, non-trainable
state, seed generator states) equal to the first copy:

- a plain variable (whole on every process): broadcast from rank 0;
- a sharded variable: its block, along each mesh axis that does not shard
  it (the processes there hold copies of one block), from that axis'
  coordinate 0. Blocks sharded on every axis are left as they are.

Flat broadcasts per process group and dtype, in buckets; a one-time cost
per model (see `benchmarks/one_device_numbers.py`). Variables created after
the first step, and training loops that call the model and
`optimizer.apply` themselves, are not covered.

Replaces, through the seam, Keras' `make_train_function` /
`make_test_function` / `make_predict_function` with one factory,
`make_step_function`: it wraps the step function `compiled` makes, once,
in the one wrapper every step kind gets under a distribution (replicas
made equal first; for predict, the predictions of every replica gathered
by `trainer`).
"""

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_torch_distribution import _keras
from keras_torch_distribution import collectives
from keras_torch_distribution import compiled
from keras_torch_distribution import runtime
from keras_torch_distribution import trainer
from keras_torch_distribution.log import logger


class EqualizedModels:
    """The models whose copies were made equal across replicas (once per
    model, before its first step)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.models = weakref.WeakSet()


equalized = EqualizedModels()


def make_step_function(kind, original, model, force=False):
    """Keras' `make_<kind>_function` (`kind`: "train", "test" or "predict"):
    the step function `compiled.make_step_function` makes, wrapped once
    under a distribution. On several processes its first call runs
    `equalize(model)`; a predict step returns the predictions of every
    replica in input order (`trainer.gather_predictions`). Collective per
    step: call on every rank."""
    result = compiled.make_step_function(kind, original, model, force)
    function = _keras.model_step_function(model, kind)
    if (
        function is None
        or getattr(function, "_ktd_distributed_step", False)
        or _keras.current_distribution() is None
    ):
        return result
    model_ref = weakref.ref(model)
    gathers = kind == "predict"

    def distributed_step(data):
        owner = model_ref()
        if owner is not None and owner not in equalized.models and runtime.is_multi_process():
            equalize(owner)
        outputs = function(data)
        return trainer.gather_predictions(outputs) if gathers else outputs

    distributed_step.__dict__.update(function.__dict__)  # the _ktd_* marks
    distributed_step._ktd_distributed_step = True
    _keras.set_model_step_function(model, kind, distributed_step)
    return distributed_step if result is function else result


def equalize(model):
    """Make every copy of `model`'s variables equal to the first copy (see
    the module docstring). Collective: call on every rank."""
    with torch.no_grad():
        count = _equalize(model.variables)
    equalized.models.add(model)
    logger.debug("Made %d variable blocks of model %r equal across replicas.", count, model.name)


def _equalize(variables):
    groups = {}  # process group -> (source rank, [local tensors])
    for variable in variables:
        value = _keras.raw_value(variable)
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            for axis, placement in enumerate(value.placements):
                if isinstance(placement, Replicate) and mesh.size(axis) > 1:
                    group = mesh.get_group(axis)
                    _add(groups, group, dist.get_global_rank(group, 0), value.to_local())
        else:
            _add(groups, dist.group.WORLD, 0, value)
    count = 0
    for group, (source, tensors) in groups.items():
        collectives.broadcast(tensors, source, group)
        count += len(tensors)
    return count


def _add(groups, group, source, tensor):
    if tensor.numel():
        groups.setdefault(group, (source, []))[1].append(tensor)

