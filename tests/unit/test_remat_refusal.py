"""Rematerialization under FSDP on Keras 3.16 is refused with one clear
error (its recompute saved another number of tensors than the forward, or
gave another loss than one process, on the 3.16 nightly); under FSDP on
3.15, and without FSDP on either, `keras.remat` runs."""

import keras
import pytest
import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._training import remat


def _remat_gradient():
    x = torch.ones(3, requires_grad=True)
    y = keras.remat(lambda t: torch.sin(t) * 2)(x)
    y.sum().backward()
    return x.grad


def test_under_fsdp_on_keras_316_remat_is_refused(monkeypatch):
    monkeypatch.setattr(_keras, "NATIVE_TORCH_TRAINING", True)
    monkeypatch.setattr(gathering.state, "plans_exist", True)
    with pytest.raises(
        NotImplementedError,
        match=r"keras.RematScope / keras.remat under FSDP .* Keras "
        r".*Use Keras 3.15 \(pip install 'keras==3.15.1'\)",
    ):
        _remat_gradient()


@pytest.mark.parametrize("native, fsdp", [(False, True), (True, False)])
def test_elsewhere_remat_runs(monkeypatch, native, fsdp):
    monkeypatch.setattr(_keras, "NATIVE_TORCH_TRAINING", native)
    monkeypatch.setattr(gathering.state, "plans_exist", fsdp)
    remat.refuse_under_fsdp_on_keras_316()  # no error
    torch.testing.assert_close(_remat_gradient(), 2 * torch.cos(torch.ones(3)))
