"""The model boundary, through the seam's `Layer.__call__`.

Once sharded variables exist, a layer's partial-sum outputs are reduced at
its boundary (so a value every consumer reads, e.g. a vocabulary-sharded
embedding lookup feeding two norms, is reduced once), and an outermost call
returns plain tensors (the model replica's whole outputs), so losses,
metrics and user code never meet DTensors. While a compiled step runs
(`compiled.py`), the model's outermost call goes through its compiled
forward.
"""

import contextlib

import keras
import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution import fsdp
from keras_torch_distribution import tensors
from keras_torch_distribution import variables

_active_forward = [None]  # (model, forward) while a compiled step runs


def plain(value):
    return tensors.full_value(value) if isinstance(value, DTensor) else value


def layer_call(original, layer, *args, **kwargs):
    """Keras `Layer.__call__`, as the module docstring says."""
    outermost = _keras.in_outer_call()
    if outermost:
        active = _active_forward[0]
        if active is not None and active[0] is layer and not torch.compiler.is_compiling():
            return active[1](original, layer, *args, **kwargs)
        if fsdp.plans_exist():
            with fsdp.regathering_in_backward():
                return convert_outputs(original, layer, outermost, *args, **kwargs)
    return convert_outputs(original, layer, outermost, *args, **kwargs)


def convert_outputs(original, layer, outermost, *args, **kwargs):
    """Call the layer; reduce partial sums, or, for an outermost call,
    return plain tensors."""
    if not variables.has_sharded_variables():
        return original(layer, *args, **kwargs)
    outputs = original(layer, *args, **kwargs)
    convert = plain if outermost else tensors.reduce_partial
    return keras.tree.map_structure(convert, outputs)


def outermost_call(original, layer, *args, **kwargs):
    return convert_outputs(original, layer, True, *args, **kwargs)


@contextlib.contextmanager
def forward_through(model, forward):
    """Within the block, `model`'s outermost calls run `forward(original,
    model, *args, **kwargs)` instead."""
    saved = _active_forward[0]
    _active_forward[0] = (model, forward)
    try:
        yield
    finally:
        _active_forward[0] = saved
