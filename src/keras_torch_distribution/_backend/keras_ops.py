"""Keras ops on DTensors: the torch backend's ops that Keras layers call
with sharded values and that need a DTensor-aware replacement (through the
seam's patch table).

- `to_numpy`: a DTensor's global value, assembled in host memory.
- `slice_update` / `scatter_update`: writes into a plain or replicated
  container (keras_hub's cached attention and samplers).
- `batch_normalization`: a plain input beside sharded statistics.
"""

import keras
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate

from keras_torch_distribution._distributed import sharding_rules
from keras_torch_distribution._distributed.tensors import full_value
from keras_torch_distribution._distributed.tensors import host_value


def to_numpy(original, value):
    """Keras' `convert_to_numpy`: a DTensor, or a variable holding one,
    gives its global value assembled in host memory (`host_value`); so do
    those in a list or tuple. (Keras 3.16's own converts variables and
    DTensors too, but gathers them whole on the device.)

    Collective for DTensors: call on every rank.
    """
    if isinstance(value, (list, tuple)):
        on_host = [_on_host(v) for v in value]
        if any(h is not v for h, v in zip(on_host, value)):
            value = on_host
        return original(value)
    return original(_on_host(value))


def _on_host(value):
    if isinstance(value, keras.Variable):
        stored = value.value
        return (
            host_value(stored.detach())
            if isinstance(stored, DTensor)
            else value
        )
    if isinstance(value, DTensor):
        return host_value(value.detach())
    return value


def _writable_by(inputs, updates):
    """`inputs` in a container that `updates` can be written into.

    Keras' torch `slice_update` / `scatter_update` clone `inputs` and write
    `updates` into the clone in place. DTensor refuses in-place ops on a
    plain tensor (keras_hub's cached attention writes head-sharded
    key/value updates into a plain cache) and in-place index writes that
    would change a sharded tensor's placement (keras_hub's samplers write
    each new token into a batch-sharded prompt). When either is a DTensor,
    the write goes into a replicated DTensor: a plain `inputs` is the
    replicated value it stands for (see `_replicated_beside`), a sharded one
    is gathered. Collective when `inputs` is a sharded DTensor: call on
    every rank.
    """
    if isinstance(inputs, DTensor):
        mesh = inputs.device_mesh
        if all(isinstance(p, Replicate) for p in inputs.placements):
            return inputs
        return inputs.redistribute(mesh, [Replicate()] * mesh.ndim)
    return _replicated_beside(inputs, [updates])


def _replicated_beside(value, others):
    """A plain `value` as the replicated DTensor implicit replication reads
    it as, on the mesh of the first DTensor among `others` (for Keras ops
    that update a plain tensor in place with them); else `value`."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    like = next((t for t in others if isinstance(t, DTensor)), None)
    if like is None:
        return value
    mesh = like.device_mesh
    return DTensor.from_local(
        value.to(like.device), mesh, [Replicate()] * mesh.ndim, run_check=False
    )


def batch_normalization(
    original, x, mean, variance, axis, offset=None, scale=None, epsilon=1e-3
):
    """Keras' torch `batch_normalization`, which scales `x - mean` in place
    by `scale`: a plain `x` with sharded `gamma` / `beta` / moving
    statistics (a LayoutMap sharding a BatchNormalization) becomes the
    replicated DTensor it stands for."""
    x = _replicated_beside(x, (mean, variance, offset, scale))
    return original(x, mean, variance, axis, offset, scale, epsilon)


def slice_update(original, inputs, start_indices, updates):
    """Keras' torch `slice_update`, also for plain `inputs` and DTensor
    `updates` or start indices (an index computed from a DTensor, as
    keras_hub's samplers compute the cache position, is used as its full
    value).

    Unless the start indices are Python ints, Keras writes `updates.flatten()`
    at every index of every dim (`index_put_`), which a replicated result
    takes replicated; torch<2.13 cannot flatten a DTensor sharded on a dim
    after its first (keras_hub's cached attention writes heads-sharded keys
    at a tensor position), so there `updates` is replicated first, as
    torch 2.13 does it for the write. Collective then: call on every rank.
    """
    if isinstance(start_indices, (list, tuple)):
        start_indices = type(start_indices)(
            full_value(i) for i in start_indices
        )
        by_ints = all(
            isinstance(i, int) for i in start_indices
        )  # Keras' fast path
    else:
        start_indices = full_value(start_indices)
        by_ints = False
    inputs = _writable_by(inputs, updates)
    if (
        not by_ints
        and sharding_rules.VIEWS_REFUSE_LATER_SHARDED_DIMS
        and isinstance(updates, DTensor)
        and not all(isinstance(p, Replicate) for p in updates.placements)
    ):
        updates = updates.redistribute(
            updates.device_mesh, [Replicate()] * updates.device_mesh.ndim
        )
    return original(inputs, start_indices, updates)


def scatter_update(original, inputs, indices, updates, reduction=None):
    """Keras' torch `scatter_update`, also for plain `inputs` and DTensor
    `updates` or indices."""
    inputs = _writable_by(inputs, updates)
    if not isinstance(inputs, DTensor):
        indices = full_value(indices)
    return original(inputs, indices, updates, reduction=reduction)
