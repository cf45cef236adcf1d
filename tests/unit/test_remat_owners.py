"""`keras.remat` reaches the package's `remat` (its recompute in the
forward's Keras call context) on every supported Keras: 3.15 calls
`backend.torch.core.remat`, 3.16 the `remat` its `backend.torch.ops`
package binds by a star import (unpatched, rematerialization under FSDP
failed there with torch's CheckpointError)."""

import keras
import torch

from keras_torch_distribution import _keras


def test_keras_remat_runs_the_packages_remat(monkeypatch):
    calls = []
    real = _keras.current_call_context
    monkeypatch.setattr(
        _keras, "current_call_context", lambda: calls.append(1) or real()
    )
    x = torch.ones(3, requires_grad=True)
    y = keras.remat(lambda t: torch.sin(t) * 2)(x)
    y.sum().backward()
    assert calls, "keras.remat did not go through the package's remat"
    torch.testing.assert_close(x.grad, 2 * torch.cos(torch.ones(3)))
