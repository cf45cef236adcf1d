"""LoRA factors laid out like the kernel they adapt.

`layer.enable_lora(rank)` (Keras' Dense and EinsumDense, so keras_hub's
`backbone.enable_lora`) adds `lora_kernel_a`, of the kernel's shape but
its last dim (`rank` instead), and `lora_kernel_b`, of shape (rank, the
kernel's last dim), at the layer's path. A LayoutMap written for the float
model has keys for `.../kernel` only, so the factors would be whole on
every rank, with their gradients and optimizer slots, while the kernel
(int8 or int4 after `quantize`, or float) is sharded.

Unless the LayoutMap has a key for the factor itself, `derived_layout`
lays each factor out along the dims it shares with the kernel: `a` as the
kernel but for its last dim (whole), `b` as the kernel's last dim (its
rank dim whole). Under FSDP the factors are then stored 1/N and gathered
with their layer's group; under tensor parallelism `x @ a @ b` follows
the kernel's column or row split (a column-parallel kernel's `b` is
column-parallel, its `a` whole; a row-parallel kernel's `a` is
row-parallel, a partial sum reduced at the layer's boundary as the
kernel's product is). Layouts change no number.
"""

import keras

from keras_torch_distribution import _keras

_FACTORS = ("lora_kernel_a", "lora_kernel_b")


def derived_layout(distribution, variable):
    """The TensorLayout of a LoRA factor derived from its kernel's (see the
    module docstring), or None: not a LoRA factor, the LayoutMap has a key
    for it, or its kernel's layout shards nothing."""
    path = getattr(variable, "path", None) or ""
    prefix, _, name = path.rpartition("/")
    if name not in _FACTORS or not prefix:
        return None
    if _keras.layout_map_layout(distribution, path) is not None:
        return None
    kernel = _keras.layout_map_layout(distribution, f"{prefix}/kernel")
    if kernel is None or all(axis is None for axis in kernel.axes):
        return None
    axes = tuple(kernel.axes)
    if name == "lora_kernel_a":
        derived = axes[:-1] + (None,)
    else:
        derived = (None, axes[-1])
    if len(derived) != len(variable.shape) or all(a is None for a in derived):
        return None
    return keras.distribution.TensorLayout(derived, kernel.device_mesh)
