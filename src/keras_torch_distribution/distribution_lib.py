"""The backend module that `keras.distribution` calls on the torch backend.

Installed as Keras' backend `distribution_lib` module (and as the name Keras'
front end bound at import) by `keras_torch_distribution.install()`; see
`_keras`, the only module that touches Keras internals.
"""

import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution import layouts
from keras_torch_distribution import runtime
from keras_torch_distribution import seeds
from keras_torch_distribution import tensors

list_devices = runtime.list_devices
get_device_count = runtime.get_device_count
num_processes = runtime.num_processes
process_id = runtime.process_id
initialize_rng = seeds.initialize_rng


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Start torch.distributed (gloo on CPU, NCCL on CUDA). Idempotent.

    Collective: call on every rank.
    """
    runtime.initialize(job_addresses, num_processes, process_id)


def _to_backend_mesh(device_mesh):
    return layouts.to_torch_mesh(device_mesh)


def _to_backend_layout(tensor_layout):
    return layouts.to_torch_layout(tensor_layout)


def distribute_tensor(tensor, layout):
    """A DTensor of `layout` holding `tensor`.

    A plain tensor is taken as the full value (the same on every rank); each
    rank keeps its block without communication. A DTensor is relayouted
    (a `Partial` one is reduced). Collective for DTensors: call on every rank.

    Inside a layer call (Keras relayouts a layer's output named
    `<layer path>/output` in a LayoutMap) the tensor is an activation: this
    replica's rows, already split along the batch axis. Its layout applies
    on the other mesh axes; a dim the layout puts on the batch axis stays
    whole (layouts never change numbers), and a tensor the rest of the
    layout does not shard is returned as it is, or made whole.
    """
    torch_layout = _resolve(layout)
    if not _keras.in_outer_call():
        distribution = _keras.current_distribution()
        batch_axis = None if distribution is None else distribution.batch_dim_name
        torch_layout = layouts.without_axis(torch_layout, batch_axis)
        if not torch_layout.is_sharded:
            return tensors.full_value(tensor)
    return tensors.to_layout(tensor, torch_layout)


def distribute_variable(value, layout):
    """A `torch.nn.Parameter` holding `value` distributed with `layout`."""
    value = tensors.to_layout(value, _resolve(layout))
    requires_grad = value.is_floating_point() or value.is_complex()
    return torch.nn.Parameter(value, requires_grad=requires_grad)


def distribute_data_input(per_process_batch, layout, batch_dim_name):
    """The global batch as a DTensor made of every process's local rows.

    Processes in the same model replica must pass the same rows.
    """
    torch_layout = _resolve(layout)
    batch = tensors.as_torch(per_process_batch)
    if isinstance(batch, DTensor):
        return tensors.to_layout(batch, torch_layout)
    return DTensor.from_local(
        batch, torch_layout.mesh, torch_layout.placements, run_check=False
    )


def _resolve(layout):
    if isinstance(layout, layouts.TorchLayout):
        return layout
    if layout is None or not hasattr(layout, "axes"):
        raise ValueError(
            f"layout={layout!r} is not a keras.distribution.TensorLayout. "
            "Pass TensorLayout(axes, device_mesh)."
        )
    return layout.backend_layout
