"""Data-parallel replicas of the current distribution.

A replica is the group of processes that share one data shard (the same
coordinate on the batch axis of the mesh). Replicas compute on their own
rows with plain local tensors; their gradients and metric states meet in one
all-reduce over the batch process group.

The batch axis is always data, as on JAX, also when variables are sharded
on it (Keras' ModelParallel on a 1-D "model" mesh uses its only axis for
both): those variables are FSDP (`_fsdp.gathering`), gathered along the
batch axis for use, while each replica computes on its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._processes import runtime

if TYPE_CHECKING:
    from keras.distribution import DataParallel
    from keras.distribution import ModelParallel


@dataclass(frozen=True)
class Replicas:
    """The data-parallel replicas of a distribution, seen from this
    process."""

    count: int  # number of data-parallel replicas
    index: int  # this process's replica (its data shard)
    # process group over the batch axis (None when count == 1)
    group: dist.ProcessGroup | None

    @property
    def is_distributed(self) -> bool:
        """True when there is more than one replica."""
        return self.count > 1


_SINGLE = Replicas(1, 0, None)


class ReplicasCache:
    """The Replicas of each (mesh configuration, batch axis), and of the
    last distribution asked about.

    `current()` runs several times per step (optimizer apply, metric
    reduction), and the mesh key (every device name of the mesh) costs more
    than the step's other bookkeeping, so the last answer is kept by
    identity: a Distribution's mesh and batch axis never change, and a new
    process group (destroyed and started again) is a new world group.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.by_key = {}  # (mesh_key, batch axis) -> Replicas
        self.last = (None, None, None)  # (distribution, world group, Replicas)


cache = ReplicasCache()


def current() -> Replicas:
    """The replicas of the current distribution (one when there is none)."""
    distribution = _keras.current_distribution()
    if distribution is None:
        return _SINGLE
    world = dist.group.WORLD if runtime.is_initialized() else None
    last_distribution, last_world, last_replicas = cache.last
    if distribution is last_distribution and world is last_world:
        return last_replicas
    if not runtime.is_multi_process():
        return _SINGLE
    key = (
        layouts.mesh_key(distribution.device_mesh),
        distribution.batch_dim_name,
    )
    replicas = cache.by_key.get(key)
    if replicas is None:
        replicas = _build(distribution)
        cache.by_key[key] = replicas
    cache.last = (distribution, world, replicas)
    return replicas


def _build(distribution: DataParallel | ModelParallel) -> Replicas:
    keras_mesh = distribution.device_mesh
    axis_names = list(keras_mesh.axis_names)
    batch_axis = distribution.batch_dim_name
    if batch_axis not in axis_names:
        raise ValueError(
            f"batch_dim_name={batch_axis!r} is not an axis of the mesh "
            f"{axis_names}. Name one of the mesh axes."
        )
    index = axis_names.index(batch_axis)
    count = int(keras_mesh.shape[index])
    if count == 1:
        return Replicas(1, 0, None)
    torch_mesh = layouts.to_torch_mesh(keras_mesh)
    coordinate = torch_mesh.get_coordinate()[index]
    if count == runtime.num_processes():
        group = dist.group.WORLD
    else:
        group = torch_mesh.get_group(batch_axis)
    return Replicas(count, int(coordinate), group)


class BatchWeight:
    """The batch in use on this replica: its weight against an even share
    (rows here * replicas / rows in the global batch; 1.0 for even batches)
    and, when fit / evaluate / predict fed it, where it sits in the global
    batch (`rows`: global rows, first row, rows; None otherwise).

    Set for each batch as the data adapter yields it (`_batch.adapter`, the
    only writer besides the resets), read by that batch's step: gradient
    averaging (`_training.overlap`'s backward hooks, `_training.gradients`,
    FSDP's reduce-scatter in backward, `_fsdp.gathering` / `_fsdp.groups`),
    random draws (`_batch.random_slices`) and batch statistics
    (`_batch.sync_batch_norm`). It is one object rather than an argument
    because those readers run inside autograd hooks and layer calls that
    Keras makes, which no argument of ours reaches. The weight is reset to
    1.0 once the step's update is applied (`_training.trainer`), and both
    when fit / evaluate / predict end, so no step inherits another's batch
    (train_on_batch after a fit whose last batch was partial, direct calls).
    """

    def __init__(self) -> None:
        self.value = 1.0
        self.rows = None
        # True while a train step runs whose loss each replica scales to
        # its share of the global batch's loss before backward (`value` /
        # replicas: `_training.reductions.scale_loss`): its gradients are
        # then summed over the replicas, not averaged (`gradient_factor`).
        self.loss_share = False

    def set(
        self, value: float, rows: tuple[int, int, int] | None = None
    ) -> None:
        self.value = float(value)
        self.rows = rows

    def reset(self) -> None:
        self.value = 1.0

    def forget(self) -> None:
        self.value = 1.0
        self.rows = None
        self.loss_share = False

    clear = forget


batch_weight = BatchWeight()


def batch_scale() -> float:
    """The current batch's weight (see BatchWeight)."""
    return batch_weight.value


def gradient_factor(count: int) -> float:
    """What this replica's gradient is multiplied by before the sum over
    `count` replicas (the ranks of the batch axis): 1.0 when the step's
    loss was scaled to the replica's share of the global batch before
    backward (`BatchWeight.loss_share`: the sum is one process's
    gradient), else the batch's weight over `count` (the mean, a last,
    uneven batch's rows weighted). The one factor every gradient reduction
    over the batch axis applies (the all-reduce, overlapped or not, FSDP's
    reduce-scatter)."""
    if batch_weight.loss_share:
        return 1.0
    return batch_weight.value / count


def uniform_gradient_factor() -> bool:
    """Whether `gradient_factor` is the same on every replica this step."""
    return batch_weight.loss_share or batch_weight.value == 1.0
