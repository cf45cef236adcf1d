"""The model boundary, through the seam's `Layer.__call__`.

Once sharded variables exist, a layer's partial-sum outputs are reduced at
its boundary (so a value every consumer reads, e.g. a vocabulary-sharded
embedding lookup feeding two norms, is reduced once), and an outermost call
returns plain tensors (the model replica's whole outputs), so losses,
metrics and user code never meet DTensors. An outermost call takes DTensor
inputs as their whole values. While a compiled step runs
(`compiled.py`), the model's outermost call goes through its compiled
forward.
"""

import contextlib

import keras
import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._fsdp import groups
from keras_torch_distribution._variables import born_sharded
from keras_torch_distribution._variables import copies


class ActiveForward:
    """While a compiled step of `model` runs, its outermost calls go
    through `forward` (see `forward_through`)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.model = None
        self.forward = None


active_forward = ActiveForward()


def plain(value):
    """The whole value of a tensor (see `tensors.full_value`). Collective for
    DTensors: call on every rank."""
    return tensors.full_value(value)


def layer_call(original, layer, *args, **kwargs):
    """Keras `Layer.__call__`, as the module docstring says. When an
    outermost call returns, the copies of the variables it created (a
    model's build) are made equal across processes (`copies`)."""
    if not _keras.in_outer_call():
        if gathering.plans_exist() and not torch.compiler.is_compiling():
            with groups.group_scope(layer):
                return convert_outputs(original, layer, False, *args, **kwargs)
        return convert_outputs(original, layer, False, *args, **kwargs)
    with copies.equal_when_built():
        return _outermost_call(original, layer, *args, **kwargs)


def _outermost_call(original, layer, *args, **kwargs):
    args, kwargs = _plain_inputs(args, kwargs)
    if active_forward.model is layer and not torch.compiler.is_compiling():
        return active_forward.forward(original, layer, *args, **kwargs)
    if gathering.plans_exist():
        with (
            gathering.regathering_in_backward(),
            groups.forward_scope(layer),
            groups.group_scope(layer),
        ):
            return convert_outputs(original, layer, True, *args, **kwargs)
    return convert_outputs(original, layer, True, *args, **kwargs)


def _plain_inputs(args, kwargs):
    """An outermost call takes DTensor inputs (keras_hub's `generate()`
    distributes its prompt with `distribute_tensor`) as their whole values,
    as the plain inputs fit / evaluate / predict pass. Collective when an
    input is a sharded DTensor: call on every rank."""
    if not any(
        isinstance(t, DTensor) for t in keras.tree.flatten((args, kwargs))
    ):
        return args, kwargs
    return keras.tree.map_structure(plain, (args, kwargs))


def convert_outputs(original, layer, outermost, *args, **kwargs):
    """Call the layer; reduce partial sums, or, for an outermost call,
    return plain tensors."""
    if not born_sharded.has_sharded_variables():
        return original(layer, *args, **kwargs)
    try:
        outputs = original(layer, *args, **kwargs)
    except RuntimeError as error:
        _explain_uneven(layer, error)
        raise
    convert = plain if outermost else tensors.reduce_partial
    return keras.tree.map_structure(convert, outputs)


def _explain_uneven(layer, error):
    """Raise a ValueError naming the layer's unevenly sharded variables when
    DTensor failed on a sharded dim (it cannot reshape uneven shards, and
    every einsum kernel is reshaped)."""
    if "shard" not in str(error).lower():
        return
    found = []
    for variable in layer.weights:
        value = _keras.raw_value(variable)
        uneven = (
            layouts.uneven_dims(value) if isinstance(value, DTensor) else []
        )
        if uneven:
            found.append((variable, uneven))
    if not found:
        return
    lines = []
    for variable, uneven in found:
        axes = list(layouts.resolved_layout(variable).axes)
        axes += [None] * (len(variable.shape) - len(axes))
        for dim, _, _ in uneven:
            axes[dim] = None
        splits = ", ".join(
            f"dim {d} of size {n} over {k} processes" for d, n, k in uneven
        )
        lines.append(
            f"variable {variable.path!r} (shape {tuple(variable.shape)}, "
            f"layout {tuple(layouts.resolved_layout(variable).axes)}) splits "
            f"{splits}; a layout that works: {tuple(axes)}"
        )
    raise ValueError(
        f"{type(layer).__name__} {layer.name!r} failed on an "
        "unevenly sharded dim: DTensor cannot reshape a dim its mesh axis "
        "does not divide, which einsum does with its kernel. "
        + "; ".join(lines)
        + ". Use a layout whose sharded dims are multiples of their mesh "
        "axis sizes (or None for those dims)."
    ) from error


def plain_losses(original, layer):
    """Keras' `Layer._get_own_losses` / `_get_regularization_losses`: losses
    from `add_loss` (e.g. a mixture-of-experts router's load-balancing
    loss) and from regularizers of sharded variables as plain tensors
    (partial sums reduced), as model outputs are, so the total loss is
    plain. Collective for DTensor losses: call on every rank."""
    losses = original(layer)
    if not born_sharded.has_sharded_variables():
        return losses
    return [plain(loss) for loss in losses]


def outermost_call(original, layer, *args, **kwargs):
    return convert_outputs(original, layer, True, *args, **kwargs)


@contextlib.contextmanager
def forward_through(model, forward):
    """Within the block, `model`'s outermost calls run `forward(original,
    model, *args, **kwargs)` instead."""
    saved = (active_forward.model, active_forward.forward)
    active_forward.model, active_forward.forward = model, forward
    try:
        yield
    finally:
        active_forward.model, active_forward.forward = saved
