"""jit_compile's fallback (compiled.py): a compiled forward that fails runs
eagerly, except when it ran out of memory or a collective failed: those
are raised, so that no rank goes on eagerly while others stay compiled
(their collectives would no longer match)."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from keras_torch_distribution._training import compiled  # noqa: E402
from keras_torch_distribution._training import regions  # noqa: E402


@pytest.fixture
def forward(monkeypatch):
    """A model's compiled forward whose compiled call raises what the test
    puts in `raising`, and whose eager call returns "eager"."""
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1)], name="m"
    )
    forward = compiled._CompiledForward(model)
    monkeypatch.setattr(
        compiled.boundary, "convert_outputs", lambda *a, **k: "eager"
    )
    raising = []

    def compiled_call(*args, **kwargs):
        raise raising[0]

    forward.compiled = compiled_call
    return forward, raising


def _wrapped(error):
    """`error` as dynamo and Keras' layer call hand it on: the cause of
    another exception."""
    try:
        try:
            raise error
        except Exception as inner:
            raise RuntimeError(
                "Exception encountered when calling Sequential.call()"
            ) from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ),
        dist.DistBackendError("NCCL error: unhandled system error"),
        dist.DistNetworkError("Connection reset by peer"),
        dist.DistStoreError("Timed out waiting for key"),
        dist.DistError("watchdog"),
    ],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize("wrap", [False, True], ids=["raised", "wrapped"])
def test_out_of_memory_and_distributed_errors_are_raised(forward, error, wrap):
    forward, raising = forward
    raising.append(_wrapped(error) if wrap else error)
    with pytest.raises(type(raising[0])) as caught:
        forward(None, None)
    assert regions.unrecoverable_cause(caught.value) is error
    assert forward.error is None  # not marked eager: the next call compiles


def test_other_errors_fall_back_to_eager(forward):
    forward, raising = forward
    raising.append(_wrapped(RuntimeError("dynamo cannot trace this")))
    assert forward(None, None) == "eager"
    assert forward.error is raising[0]
    assert forward(None, None) == "eager"  # stays eager
