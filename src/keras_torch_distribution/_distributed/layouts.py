"""Keras `DeviceMesh` / `TensorLayout` onto torch `DeviceMesh` / DTensor
placements.

A Keras device is a string "cpu:R" or "gpu:R" where R is the global rank of
the process that owns it (one device per process, as torchrun runs them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_torch_distribution._log import warn_grouped
from keras_torch_distribution._processes import join
from keras_torch_distribution._processes import runtime

if TYPE_CHECKING:
    from collections.abc import Sequence

    from keras.distribution import DeviceMesh
    from keras.distribution import TensorLayout
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Placement


class TorchMeshCache:
    """The torch mesh of each Keras mesh configuration, built once.

    Building a torch mesh creates process groups, a collective that must
    not run per step. Keyed by configuration (`mesh_key`), not by `id()`:
    Keras meshes rebuilt with the same configuration must find the same
    torch mesh on every rank. Each entry remembers the world group it was
    built in, because a mesh built before the process group was destroyed
    and started again holds dead groups.
    """

    def __init__(self):
        self._meshes = {}  # mesh_key -> (world group, torch mesh)
        # (torch mesh, batch axis name) -> the mesh of its other axes, on
        # which layers compute (`compute_layout`): one object per mesh, so
        # that the DTensors layers make from different variables meet on
        # the same mesh.
        self._compute_meshes = {}

    def get(self, key, world_group):
        cached = self._meshes.get(key)
        if cached is not None and cached[0] is world_group:
            return cached[1]
        return None

    def put(self, key, world_group, mesh):
        self._meshes[key] = (world_group, mesh)

    def compute_mesh(self, mesh, batch_axis):
        """The submesh of `mesh` without its axis `batch_axis`, sliced once
        (slicing reuses the mesh's process groups)."""
        key = (mesh, batch_axis)
        submesh = self._compute_meshes.get(key)
        if submesh is None:
            names = tuple(n for n in mesh.mesh_dim_names if n != batch_axis)
            submesh = mesh[names[0] if len(names) == 1 else names]
            self._compute_meshes[key] = submesh
        return submesh

    def on_full_mesh(self, mesh, placements):
        """`(mesh, placements)` of a DTensor on a compute mesh
        (`compute_mesh`) as the same layout on the mesh it was sliced
        from, Replicate on the batch axis (each replica's own value); any
        other mesh as it is."""
        for (full, batch_axis), submesh in self._compute_meshes.items():
            if submesh is mesh:
                index = full.mesh_dim_names.index(batch_axis)
                placements = tuple(placements)
                return full, (
                    placements[:index] + (Replicate(),) + placements[index:]
                )
        return mesh, placements

    def clear(self):
        self._meshes.clear()
        self._compute_meshes.clear()

    def release_process_groups(self):
        """Let go of the (destroyed) process groups the cached meshes hold.

        A torch DeviceMesh keeps its process groups alive after
        `destroy_process_group()` (its `_pg_registry`), and so does every
        DTensor on it, such as a model's variables: the groups' native
        objects (gloo contexts and their worker threads) would be destroyed
        only when those objects are, during interpreter finalization.
        Called by the exit sequence, once the process group is destroyed.
        """
        meshes = [mesh for _, mesh in self._meshes.values()]
        for mesh in meshes + list(self._compute_meshes.values()):
            registry = getattr(mesh, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


torch_meshes = TorchMeshCache()


def device_rank(device: str) -> int:
    """Global rank of a Keras device string such as "gpu:3" (3)."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind.lower() not in ("cpu", "gpu", "cuda") or not index.isdigit():
        raise ValueError(
            f"Device {text!r} is not a device of this package: expected "
            "'cpu:R' or 'gpu:R' with R a process rank, as listed by "
            "keras.distribution.list_devices()."
        )
    return int(index)


def mesh_key(
    keras_mesh: DeviceMesh,
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]:
    """The configuration that identifies a mesh: shape, axis names, ranks."""
    devices = [str(d) for d in keras_mesh.devices.flatten()]
    return (
        tuple(int(s) for s in keras_mesh.shape),
        tuple(keras_mesh.axis_names),
        tuple(devices),
    )


def to_torch_mesh(keras_mesh: DeviceMesh) -> TorchDeviceMesh:
    """The torch DeviceMesh of a Keras DeviceMesh, built once per configuration.

    Collective (the first time a configuration is seen): call on every rank.
    """
    key = mesh_key(keras_mesh)
    world = join.ensure_initialized()
    world_group = dist.group.WORLD
    cached = torch_meshes.get(key, world_group)
    if cached is not None:
        return cached
    check_mesh(keras_mesh, world)
    shape, axis_names, devices = key
    ranks = [device_rank(d) for d in devices]
    kinds = {str(d).split(":")[0].lower() for d in devices}
    device_type = "cuda" if kinds & {"gpu", "cuda"} else "cpu"
    if device_type == "cuda" and not runtime.uses_cuda():
        why = (
            "KTD_DEVICE=cpu runs this process on the CPU"
            if torch.cuda.is_available()
            else "CUDA is not available in this process"
        )
        raise ValueError(
            f"DeviceMesh devices {list(devices)} are GPUs, but {why}. Use "
            "keras.distribution.list_devices() for this run's devices."
        )
    if device_type == "cpu" and runtime.uses_cuda():
        raise ValueError(
            f"DeviceMesh devices {list(devices)} are CPUs, but this run "
            "computes on CUDA (Keras' tensors are CUDA tensors, which a 'cpu' "
            "mesh cannot hold). Use keras.distribution.list_devices() for "
            "this run's devices ('gpu:R'), or set KTD_DEVICE=cpu before the "
            "processes start to run on CPU processes (gloo)."
        )
    rank_grid = torch.tensor(ranks, dtype=torch.int64).reshape(shape)
    _check_rank_order(rank_grid, axis_names, devices)
    mesh = TorchDeviceMesh(device_type, rank_grid, mesh_dim_names=axis_names)
    torch_meshes.put(key, world_group, mesh)
    return mesh


def check_mesh(keras_mesh: DeviceMesh, world: int) -> None:
    """Refuse a mesh that does not hold each of the `world` processes once
    (one device per process) or that repeats an axis name."""
    shape, axis_names, devices = mesh_key(keras_mesh)
    if len(devices) != world:
        raise ValueError(
            f"DeviceMesh shape={shape} has {len(devices)} devices, but "
            f"{world} processes run. The mesh must cover every process, one "
            "device per process: build it from "
            "keras.distribution.list_devices() with a shape whose product is "
            f"{world}."
        )
    ranks = [device_rank(d) for d in devices]
    if sorted(ranks) != list(range(world)):
        raise ValueError(
            f"DeviceMesh devices {list(devices)} do not name each of the "
            f"{world} processes once. Use keras.distribution.list_devices()."
        )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(
            f"DeviceMesh axis_names {list(axis_names)} repeat a name; each "
            "mesh axis needs its own name."
        )


def _check_rank_order(rank_grid, axis_names, devices):
    """Refuse meshes whose ranks decrease along an axis.

    torch.distributed orders the members of a process group by rank (and a
    1-D mesh over the whole world reuses the default group), while DTensor
    places shards by mesh coordinate. Along an axis whose ranks are not
    increasing the two disagree, and gathers would silently permute shards.
    """
    for axis, name in enumerate(axis_names):
        if rank_grid.shape[axis] > 1 and not bool(
            (torch.diff(rank_grid, dim=axis) > 0).all()
        ):
            raise ValueError(
                f"DeviceMesh devices {list(devices)} (as a grid of ranks "
                f"{rank_grid.tolist()}) do not increase along mesh axis "
                f"{name!r}. torch.distributed orders each axis' process group "
                "by rank, so DTensor would assemble shards in the wrong order. "
                "List the devices in increasing rank order along every axis, "
                "e.g. keras.distribution.list_devices() reshaped to the mesh."
            )


def placements_for(
    axes: Sequence[str | Sequence[str] | None], axis_names: Sequence[str]
) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh axis) for a Keras layout's `axes`.

    `axes[d]` names the mesh axis (or a tuple of axes, major first) that
    shards tensor dim `d`, or None.
    """
    placements = [Replicate()] * len(axis_names)
    used = {}
    for dim, entry in enumerate(axes):
        if entry is None:
            continue
        names = entry if isinstance(entry, (tuple, list)) else (entry,)
        previous_index = -1
        for name in names:
            if name not in axis_names:
                raise ValueError(
                    f"Layout axes {tuple(axes)} name the mesh axis {name!r}, "
                    f"which the mesh does not have; its axes are "
                    f"{list(axis_names)}. Use one of those names or None."
                )
            if name in used:
                raise ValueError(
                    f"Layout axes {tuple(axes)} use the mesh axis {name!r} "
                    f"for dims {used[name]} and {dim}; a mesh axis can shard "
                    "only one tensor dim."
                )
            index = list(axis_names).index(name)
            if index < previous_index:
                raise ValueError(
                    f"Layout axes {tuple(axes)} shard dim {dim} over {names}, "
                    f"out of the mesh's axis order {list(axis_names)}; list "
                    "them in mesh order."
                )
            previous_index = index
            used[name] = dim
            placements[index] = Shard(dim)
    return tuple(placements)


@dataclass(frozen=True)
class TorchLayout:
    """A Keras TensorLayout in torch terms: a mesh and one placement per
    axis."""

    mesh: TorchDeviceMesh
    # One per mesh axis (Shard(dim) or Replicate()).
    placements: tuple[Placement, ...]
    # The Keras layout's axes: one entry per tensor dim, a mesh axis name,
    # a tuple of them (major first) or None.
    axes: tuple[str | tuple[str, ...] | None, ...]

    @property
    def is_sharded(self) -> bool:
        """True when a placement shards a dim."""
        return any(isinstance(p, Shard) for p in self.placements)


def without_axis(
    torch_layout: TorchLayout, axis_name: str | None
) -> TorchLayout:
    """`torch_layout` with nothing sharded on the mesh axis `axis_name`."""
    names = tuple(torch_layout.mesh.mesh_dim_names or ())
    if axis_name not in names:
        return torch_layout
    index = names.index(axis_name)
    if not isinstance(torch_layout.placements[index], Shard):
        return torch_layout
    placements = list(torch_layout.placements)
    placements[index] = Replicate()
    axes = tuple(_drop_name(entry, axis_name) for entry in torch_layout.axes)
    return TorchLayout(torch_layout.mesh, tuple(placements), axes)


def compute_layout(
    torch_layout: TorchLayout, batch_axis: str | None
) -> TorchLayout:
    """The layout a value of `torch_layout` has while layers compute with
    it: on the mesh of the axes other than the batch axis, with their
    placements (`torch_layout` as it is when its mesh has no batch axis or
    no other axis).

    The batch axis is data: processes at different coordinates of it
    compute on different rows, so a layer's values differ along it. A
    DTensor that held the batch axis would call them Replicate there, and
    DTensor's sharding propagation may then choose to shard such a value
    on that axis for an op (torch 2.13 picks (Shard(0), Shard(1)) for the
    `threshold_backward` of a ReLU between two column-parallel Dense
    layers: the slicing looks free) and to reduce or gather it over the
    batch axis later, mixing the rows of different replicas into each
    other's gradients. Without the axis, no collective of sharding
    propagation can cross it; the batch axis' one reduction is the
    gradient average (`_training.gradients`).

    `torch_layout` must shard nothing on the batch axis (a variable sharded
    there is gathered first: `_fsdp.gathering`)."""
    names = tuple(torch_layout.mesh.mesh_dim_names or ())
    if batch_axis not in names or len(names) == 1:
        return torch_layout
    index = names.index(batch_axis)
    placement = torch_layout.placements[index]
    if not isinstance(placement, Replicate):
        raise ValueError(
            f"compute_layout: the layout {tuple(torch_layout.axes)} places "
            f"{placement} on the batch axis {batch_axis!r}; expected it "
            "replicated there (a value sharded on the batch axis is gathered "
            "along it before layers compute with it)."
        )
    mesh = torch_meshes.compute_mesh(torch_layout.mesh, batch_axis)
    placements = (
        torch_layout.placements[:index] + torch_layout.placements[index + 1 :]
    )
    axes = tuple(_drop_name(entry, batch_axis) for entry in torch_layout.axes)
    return TorchLayout(mesh, tuple(placements), axes)


def _drop_name(entry, name):
    if isinstance(entry, (tuple, list)):
        kept = tuple(n for n in entry if n != name)
        return kept if len(kept) > 1 else (kept[0] if kept else None)
    return None if entry == name else entry


def to_torch_layout(keras_layout: TensorLayout) -> TorchLayout:
    """The TorchLayout of a Keras TensorLayout (its mesh built once per
    configuration). Collective the first time its mesh is seen: call on
    every rank."""
    if keras_layout.device_mesh is None:
        raise ValueError(
            f"TensorLayout axes={keras_layout.axes} has no device mesh. Give "
            "it one (TensorLayout(axes, device_mesh)) or put it in a "
            "LayoutMap, which sets the LayoutMap's mesh."
        )
    keras_mesh = keras_layout.device_mesh
    placements = placements_for(keras_layout.axes, list(keras_mesh.axis_names))
    return TorchLayout(
        to_torch_mesh(keras_mesh), placements, tuple(keras_layout.axes)
    )


def check_rank(
    layout: TorchLayout | TensorLayout, shape: Sequence[int], what: str
) -> None:
    """Refuse a layout with more entries than `shape` has dims.

    A shorter layout is read as a prefix, as JAX reads a PartitionSpec: its
    entries lay out the leading dims and the rest are replicated.
    """
    if len(layout.axes) > len(shape):
        raise ValueError(
            f"Layout axes {tuple(layout.axes)} have {len(layout.axes)} "
            f"entries, but {what} has shape {tuple(shape)} (rank "
            f"{len(shape)}). Give the layout one entry (an axis name or None) "
            "per dim, or fewer: a shorter layout lays out the leading dims "
            "and replicates the rest "
            f"(e.g. {tuple(layout.axes)[: len(shape)]})."
        )


def for_variable(
    torch_layout: TorchLayout,
    shape: Sequence[int],
    what: str,
    path: str | None = None,
) -> TorchLayout:
    """The layout of a variable of `shape` under `torch_layout`.

    Refuses a layout longer than the shape; a shorter one lays out the
    leading dims. Mesh axes of size 1 split nothing and are dropped (DTensor
    then propagates sharding over fewer axes). A dim smaller than the number
    of processes sharding it (1 key/value head over 2) is replicated
    instead, with a warning, as Megatron replicates key/value heads when
    there are fewer than tensor-parallel ranks: otherwise some ranks would
    hold nothing of it, and DTensor cannot reshape such a dim (every einsum
    kernel reshapes). The warning is one line for all the variables
    (`path`: the variable's) that share it, and their optimizer slots.
    """
    check_rank(torch_layout, shape, what)
    mesh = torch_layout.mesh
    pieces = [1] * len(shape)
    for axis, placement in enumerate(torch_layout.placements):
        if isinstance(placement, Shard):
            pieces[placement.dim] *= mesh.size(axis)
    too_small = [d for d, n in enumerate(shape) if 0 < int(n) < pieces[d]]
    placements = tuple(
        Replicate()
        if isinstance(p, Shard) and (p.dim in too_small or mesh.size(axis) == 1)
        else p
        for axis, p in enumerate(torch_layout.placements)
    )
    if placements == tuple(torch_layout.placements):
        return torch_layout
    axes = _axes_of(placements, mesh.mesh_dim_names, len(shape))
    if too_small:
        key = ("replicated-small-dims", tuple(shape), tuple(torch_layout.axes))
        warn_grouped(
            key,
            path or what,
            "shape %s: layout %s splits dims %s over more processes than "
            "they have entries, so they are replicated instead (layout %s).",
            tuple(shape),
            tuple(torch_layout.axes),
            too_small,
            axes,
        )
    return TorchLayout(mesh, placements, axes)


def _axes_of(placements, axis_names, rank):
    """Keras layout axes (one entry per dim) for DTensor placements."""
    names = [[] for _ in range(rank)]
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard):
            names[placement.dim].append(axis_names[axis])
    return tuple(
        None if not n else n[0] if len(n) == 1 else tuple(n) for n in names
    )


def uneven_dims(value: DTensor) -> list[tuple[int, int, int]]:
    """[(dim, size, processes)] of the dims a DTensor shards unevenly."""
    pieces = {}
    for axis, placement in enumerate(value.placements):
        if isinstance(placement, Shard):
            pieces[placement.dim] = pieces.get(
                placement.dim, 1
            ) * value.device_mesh.size(axis)
    return [
        (d, int(value.shape[d]), n)
        for d, n in sorted(pieces.items())
        if int(value.shape[d]) % n
    ]


def local_box(
    global_shape: Sequence[int],
    mesh: TorchDeviceMesh,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """This rank's block of a tensor (or the block of the process at mesh
    `coordinate`): one (start, stop) per dim.

    Follows DTensor's `Shard` semantics (torch.chunk: ceil-sized pieces, the
    last ones smaller or empty); mesh axes sharding the same dim nest in
    mesh order.
    """
    box = [[0, int(n)] for n in global_shape]
    if coordinate is None:
        coordinate = mesh.get_coordinate()
    for axis, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        start, stop = box[placement.dim]
        length = stop - start
        pieces = mesh.size(axis)
        chunk = math.ceil(length / pieces) if length else 0
        lo = min(coordinate[axis] * chunk, length)
        hi = min(lo + chunk, length)
        box[placement.dim] = [start + lo, start + hi]
    return tuple((lo, hi) for lo, hi in box)


def box_slices(box: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    step = 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(stride))


def resolved_layout(variable):
    """The TorchLayout of a Keras variable whose layout shards it, once
    `_variables.born_sharded.sharded_layout` has resolved it (and stored it
    as `variable._ktd_layout`); None for a variable kept whole or not
    resolved yet. Only reads: the one accessor for modules below
    `variables`, and for those that must not resolve a layout."""
    return getattr(variable, "_ktd_layout", None)
