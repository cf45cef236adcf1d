"""A replica's dropout mask (random_slices) holds only its own rows.

The mask is saved for backward; a view of the global-batch draw would keep
replicas x the activation alive until then. On CUDA the global draw is made
at once and sliced (`draws_at_once`); here that path runs on the CPU
(patched), with the numbers of one process's draw."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402,F401
import pytest  # noqa: E402
import torch  # noqa: E402

from keras_torch_distribution._batch import random_slices  # noqa: E402
from keras_torch_distribution._distributed import replicas  # noqa: E402


@pytest.fixture(params=[False, True], ids=["chunked", "at-once"])
def at_once(request, monkeypatch):
    monkeypatch.setattr(
        random_slices, "draws_at_once", lambda device: request.param
    )
    return request.param


@pytest.fixture
def second_replica_of_four():
    """This replica's batch: rows [8, 16) of a global batch of 32."""
    replicas.batch_weight.set(1.0, (32, 8, 8))
    yield 32, 8, 8
    replicas.batch_weight.forget()


def _saved_by(function, inputs):
    """The tensors autograd saves while `function(inputs)` runs."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = function(inputs)
    return output, [t for t in saved if t is not inputs]


def _never_called(*args, **kwargs):
    raise AssertionError(
        "Keras' own dropout ran: the replica's draw was not made"
    )


def test_unseeded_mask_is_this_replicas_rows_and_only_them(
    at_once, second_replica_of_four
):
    global_rows, first, rows = second_replica_of_four
    x = torch.randn(rows, 1000, requires_grad=True)
    torch.manual_seed(7)
    output, saved = _saved_by(
        lambda t: random_slices.dropout(_never_called, t, 0.25), x
    )
    torch.manual_seed(7)  # one process's draw for the global batch
    expected = (
        torch.empty(global_rows, 1000)
        .bernoulli_(0.75)
        .div_(0.75)[first : first + rows]
    )
    torch.testing.assert_close(output, x * expected, rtol=0, atol=0)
    (mask,) = saved
    assert mask.untyped_storage().nbytes() == x.numel() * x.element_size()


def test_seeded_mask_is_this_replicas_rows_and_only_them(
    at_once, second_replica_of_four
):
    global_rows, first, rows = second_replica_of_four
    x = torch.randn(rows, 1000, requires_grad=True)
    output, saved = _saved_by(
        lambda t: random_slices.dropout(_never_called, t, 0.25, seed=1234), x
    )
    keras_mask = (
        keras.src.backend.torch.random.dropout(
            torch.ones(global_rows, 1000), 0.25, seed=1234
        )
        != 0
    )
    expected = torch.where(
        keras_mask[first : first + rows], x / 0.75, torch.zeros_like(x)
    )
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    masks = [t for t in saved if t.dtype == torch.bool]
    assert len(masks) == 1
    assert (
        masks[0].untyped_storage().nbytes() == x.numel()
    )  # one byte per value
