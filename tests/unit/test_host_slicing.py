"""Whole values of sharded variables stay on the host (GPU audit M6): a
full value given for a sharded layout (initial value, set_weights, assign)
is sliced in host memory and only this rank's block goes to the device.

"meta" stands for the accelerator (Keras' torch device) on this CPU
machine: `Allocations` then tells what went to the device from what stayed
on the host. No process group: the layout's mesh is a stand-in that puts
this process at coordinate 1 of 4 (torch's DTensor is not built).
"""

import os
import types

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

from helpers import Allocations  # noqa: E402
from keras_torch_distribution import _keras  # noqa: E402
from keras_torch_distribution._distributed import layouts  # noqa: E402
from keras_torch_distribution._distributed import tensors  # noqa: E402
from keras_torch_distribution._variables import born_sharded  # noqa: E402


class _SecondOfFour:
    """A 1-D mesh of 4 as `layouts.local_box` reads it, seen from coordinate
    1."""

    ndim = 1

    def get_coordinate(self):
        return [1]

    def size(self, axis=0):
        return 4


@pytest.fixture
def rows_layout(monkeypatch):
    """Rows sharded over 4: this process holds rows [10, 20) of 40. The
    block is returned as it is, not wrapped in a DTensor."""
    monkeypatch.setattr(
        tensors, "from_local_block", lambda block, layout, shape: block
    )
    return layouts.TorchLayout(_SecondOfFour(), (Shard(0),), ("model", None))


VALUE = np.arange(40 * 3, dtype="float32").reshape(40, 3)


def test_a_numpy_value_is_sliced_on_the_host(rows_layout, monkeypatch):
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "meta")
    with Allocations() as made:
        block = tensors.to_layout(VALUE, rows_layout)
    assert block.device.type == "meta" and tuple(block.shape) == (10, 3)
    assert made.largest("meta") == 10 * 3
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "cpu")
    block = tensors.to_layout(VALUE, rows_layout)
    np.testing.assert_array_equal(block.numpy(), VALUE[10:20])
    assert (
        block.untyped_storage().nbytes() == 10 * 3 * 4
    )  # a copy, not a view of it all


class _Sharded:
    """Stands for a DTensor as a sharded variable's stored value."""


def _keras_conversion(variable, value, dtype=None):
    return _keras.torch_core_module.convert_to_tensor(value, dtype=dtype)


def test_assign_converts_a_value_for_a_sharded_variable_on_the_host(
    monkeypatch,
):
    """`assign` converts the new value before `_direct_assign` reshards it:
    for a sharded variable a numpy value becomes a CPU tensor; a plain
    variable's goes to Keras' device as Keras puts it."""
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "meta")
    monkeypatch.setattr(born_sharded, "DTensor", _Sharded)
    sharded = types.SimpleNamespace(_value=_Sharded())
    plain = types.SimpleNamespace(_value=None)
    value = born_sharded.convert_for_assign(
        _keras_conversion, sharded, VALUE, dtype="bfloat16"
    )
    assert value.device.type == "cpu" and str(value.dtype) == "torch.bfloat16"
    assert (
        born_sharded.convert_for_assign(
            _keras_conversion, plain, VALUE
        ).device.type
        == "meta"
    )


def test_assign_conversion_is_installed():
    from keras_torch_distribution import _install

    assert any(
        patch.owner is _keras.TorchVariable
        and patch.name == "_convert_to_tensor"
        and patch.replacement is born_sharded.convert_for_assign
        for patch in _install._installed
    )
