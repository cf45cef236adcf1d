"""The backend module that `keras.distribution` calls on the torch backend.

Installed as Keras' backend `distribution_lib` module (and as the name Keras'
front end bound at import) by `keras_torch_distribution.install()`; see
`_keras`, the only module that touches Keras internals.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._processes import join
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._processes import seeds

if TYPE_CHECKING:
    import numpy as np
    from keras.distribution import DeviceMesh
    from keras.distribution import TensorLayout
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

list_devices = join.list_devices
get_device_count = join.get_device_count
num_processes = runtime.num_processes
process_id = runtime.process_id
initialize_rng = seeds.initialize_rng


def initialize(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on CUDA). Idempotent.

    Collective: call on every rank.

    Args:
        job_addresses: process 0's address, `"host:port"` (or a
            comma-separated list of every process's, whose first is
            process 0's), or a torch init method such as
            `"file:///shared/rendezvous"`. `None` reads it from the
            launcher's environment (see `join.initialize`).
        num_processes: the number of processes of the job. `None` reads it
            from the launcher's environment.
        process_id: this process's rank in `[0, num_processes)`. `None`
            reads it from the launcher's environment.
    """
    join.initialize(job_addresses, num_processes, process_id)


class MeshSizeError(ValueError):
    """A DeviceMesh shaped for another number of devices than it is given."""


def check_device_mesh(original, mesh, shape, axis_names, devices=None):
    """Keras `DeviceMesh.__init__`, where a shape whose product is not the
    number of devices (a mesh hard-coded for 8 devices, as on keras.io,
    under a job of 2 processes) is explained: the devices this job has, and
    the two ways out."""
    try:
        return original(mesh, shape, axis_names, devices)
    except ValueError as error:
        given = _device_count(devices)
        if "Shape does not match the number of devices" not in str(error):
            raise
        if given is None:
            raise
        needed = math.prod(int(n) for n in shape)
        raise MeshSizeError(
            f"DeviceMesh(shape={tuple(shape)}, axis_names={list(axis_names)}) "
            f"needs {needed} devices, but was given {given} (one device per "
            f"process: this job's keras.distribution.list_devices() has "
            f"{_world_text()}). Either run {needed} processes (`ktd run -n "
            f"{needed} ...`, or as many across nodes), or give the mesh a "
            f"shape whose product is {given}, e.g. "
            f"{_fitting_shape(shape, given)}, from list_devices()."
        ) from None


def _device_count(devices):
    """How many devices a DeviceMesh was given (Keras' list_devices() for
    None, as Keras does)."""
    if devices is None:
        return len(join.list_devices())
    try:
        return int(np.array(devices).size)
    except (TypeError, ValueError):
        return None


def _world_text():
    if runtime.is_initialized():
        return f"{runtime.num_processes()} device(s)"
    return "one device per process of the job"


def _fitting_shape(shape, count):
    """`shape` with its product made `count`, filled from its last axis (the
    model axis, usually): (2, 4) for 2 devices -> (1, 2)."""
    fitted = [1] * len(shape)
    left = count
    for axis in reversed(range(len(shape))):
        take = math.gcd(left, int(shape[axis])) if axis else left
        fitted[axis] = take
        left //= take
    return tuple(fitted)


def check_distribution(
    original, distribution, device_mesh, batch_dim_name=None, *args, **kwargs
):
    """Keras `Distribution.__init__`, which first checks that the batch axis
    is an axis of the mesh and, once processes run, that the mesh covers
    every process (DataParallel never builds a torch mesh, so a mesh of
    fewer devices would otherwise go unnoticed)."""
    axis_names = list(device_mesh.axis_names)
    if batch_dim_name is not None and batch_dim_name not in axis_names:
        raise ValueError(
            f"{type(distribution).__name__}"
            f"(batch_dim_name={batch_dim_name!r}): "
            f"the mesh has no axis {batch_dim_name!r}; its axes are "
            f"{axis_names}. Pass batch_dim_name= one of them (the "
            "data-parallel axis), or name that axis so in the DeviceMesh."
        )
    if runtime.is_initialized():
        layouts.check_mesh(device_mesh, runtime.num_processes())
    return original(distribution, device_mesh, batch_dim_name, *args, **kwargs)


def _to_backend_mesh(device_mesh: DeviceMesh) -> TorchDeviceMesh:
    """Convert the DeviceMesh to the torch DeviceMesh of its configuration.

    Built once per configuration (shape, axis names, devices). Collective
    the first time a configuration is seen: call on every rank.

    Args:
        device_mesh: `keras.distribution.DeviceMesh` instance to convert.

    Returns:
        A `torch.distributed.device_mesh.DeviceMesh` instance.
    """
    return layouts.to_torch_mesh(device_mesh)


def _to_backend_layout(tensor_layout: TensorLayout) -> layouts.TorchLayout:
    """Convert the TensorLayout to its torch mesh and DTensor placements.

    Collective the first time its mesh is seen: call on every rank.

    Args:
        tensor_layout: `keras.distribution.TensorLayout` instance to
            convert; it must have a device mesh.

    Returns:
        A `layouts.TorchLayout`: the torch mesh and one placement per mesh
        axis.
    """
    return layouts.to_torch_layout(tensor_layout)


def distribute_tensor(
    tensor: torch.Tensor, layout: TensorLayout | layouts.TorchLayout
) -> torch.Tensor:
    """A DTensor of `layout` holding `tensor`.

    A plain tensor is taken as the full value (the same on every rank); each
    rank keeps its block without communication. A DTensor is relayouted
    (a `Partial` one is reduced). A layout shorter than the tensor lays out
    its leading dims, as JAX reads a PartitionSpec. Collective for DTensors:
    call on every rank.

    Inside a layer call (Keras relayouts a layer's output named
    `<layer path>/output` in a LayoutMap) the tensor is an activation: this
    replica's rows, already split along the batch axis. Its layout applies
    on the other mesh axes (a DTensor on their mesh); a dim the layout puts
    on the batch axis stays whole (layouts never change numbers), and a
    tensor the rest of the layout does not shard is returned as it is, or
    made whole.

    Args:
        tensor: `torch.Tensor` (or DTensor) to distribute.
        layout: `TensorLayout` for the distribution information, or a
            `layouts.TorchLayout` instance.

    Returns:
        The distributed value: a DTensor of `layout`, or, inside a layer
        call, a plain tensor where the layout shards nothing but the batch
        axis.
    """
    scope = _keras.current_name_scope()
    what = "the tensor"
    if scope:
        what = (
            f"the tensor distributed in Keras name scope {scope!r} (a layer's "
            f"output, when a LayoutMap key matches {scope + '/output'!r})"
        )
    torch_layout = _resolve(layout)
    if not _keras.in_outer_call():
        distribution = _keras.current_distribution()
        batch_axis = (
            None if distribution is None else distribution.batch_dim_name
        )
        torch_layout = layouts.without_axis(torch_layout, batch_axis)
        if not torch_layout.is_sharded:
            return tensors.full_value(tensor)
        # On the mesh of the other axes, where layers compute (see
        # `layouts.compute_layout`).
        torch_layout = layouts.compute_layout(torch_layout, batch_axis)
    return tensors.to_layout(tensor, torch_layout, what)


def distribute_variable(
    value: torch.Tensor, layout: TensorLayout | layouts.TorchLayout
) -> torch.nn.Parameter:
    """A `torch.nn.Parameter` holding `value` distributed with `layout`.

    Args:
        value: the initial value of the variable: a `torch.Tensor` (or
            DTensor) holding the full value, the same on every rank.
        layout: `TensorLayout` for the created variable, or a
            `layouts.TorchLayout` instance.

    Returns:
        A `torch.nn.Parameter` wrapping a DTensor of `layout`, which
        requires grad when `value` is floating point or complex.
    """
    value = tensors.to_layout(value, _resolve(layout))
    requires_grad = value.is_floating_point() or value.is_complex()
    return torch.nn.Parameter(value, requires_grad=requires_grad)


def distribute_data_input(
    per_process_batch: torch.Tensor | np.ndarray | None,
    layout: TensorLayout | layouts.TorchLayout,
    batch_dim_name: str | None = None,
) -> torch.Tensor | None:
    """This process's rows of the global batch, as a plain tensor (None
    stays None: Keras 3.16's torch trainer calls this with 2 arguments on
    every leaf of a batch, an absent sample weight included).

    The batch axis is data, as on JAX: each coordinate along it holds its
    own rows of the global batch, and the model computes on them as plain
    local tensors. A plain `per_process_batch` already is those rows; a
    DTensor (a global batch) gives this process's block of it under
    `layout`. Collective for DTensors: call on every rank.

    Args:
        per_process_batch: this process's rows (a `torch.Tensor` or numpy
            array), or the global batch as a DTensor.
        layout: `TensorLayout` for the distribution information, or a
            `layouts.TorchLayout` instance.
        batch_dim_name: the name of the batch axis of the mesh (unused:
            the layout's axes name it).

    Returns:
        This process's rows of the global batch, as a plain `torch.Tensor`.
    """
    del batch_dim_name  # the layout's axes name it
    if per_process_batch is None:
        return None
    batch = tensors.as_torch(per_process_batch)
    if isinstance(batch, DTensor):
        return tensors.to_layout(batch, _resolve(layout)).to_local()
    return batch


def _resolve(
    layout: TensorLayout | layouts.TorchLayout,
) -> layouts.TorchLayout:
    if isinstance(layout, layouts.TorchLayout):
        return layout
    if layout is None or not hasattr(layout, "axes"):
        raise ValueError(
            f"layout={layout!r} is not a keras.distribution.TensorLayout. "
            "Pass TensorLayout(axes, device_mesh)."
        )
    return layout.backend_layout
