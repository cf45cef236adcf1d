"""Keras' float8 layers with the package (one process, issue 47): the
package's float8 call gives Keras' own numbers, and its float8 matrix
products (`torch._scaled_mm`, KTD_FLOAT8_MATMUL=1 on torch 2.13's CPU)
Keras' fake-quantized numbers within float rounding.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from keras_torch_distribution import _install  # noqa: E402
from keras_torch_distribution._backend import float8  # noqa: E402
from keras_torch_distribution._training import float8 as float8_call  # noqa: E402

STEPS, ROWS, WIDTH = 3, 16, 16


def _model(einsum):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    if einsum:
        x = keras.layers.EinsumDense(
            "bm,mh->bh",
            output_shape=(2 * WIDTH,),
            bias_axes="h",
            activation="relu",
            name="hidden",
        )(inputs)
    else:
        x = keras.layers.Dense(2 * WIDTH, activation="relu", name="hidden")(
            inputs
        )
    x = keras.layers.Dense(WIDTH, activation="tanh", name="proj")(x)
    outputs = keras.layers.Dense(WIDTH, name="out")(x)
    model = keras.Model(inputs, outputs)
    model.quantize("float8")
    return model


def _fit(einsum, policy="float32", keras_call=False):
    """Losses and every variable after STEPS steps of float8 fit;
    `keras_call`: Keras' own `_float8_call` instead of the package's."""
    keras.config.set_dtype_policy(policy)
    patches = [  # the layers' `_float8_call` (3.15), `Float8Strategy.call`
        p
        for p in _install._installed
        if getattr(p.replacement, "__module__", None) == float8_call.__name__
    ]
    ours = {p: p.owner.__dict__[p.name] for p in patches}
    try:
        model = _model(einsum)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(ROWS * STEPS, WIDTH)).astype("float32")
        y = rng.normal(size=(ROWS * STEPS, WIDTH)).astype("float32")
        if keras_call:
            for patch in patches:
                setattr(patch.owner, patch.name, patch.original)
        history = model.fit(
            x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0
        )
    finally:
        for patch, replacement in ours.items():
            setattr(patch.owner, patch.name, replacement)
        keras.config.set_dtype_policy("float32")
    return history.history["loss"], {
        v.path: np.asarray(v, "float32") for v in model.weights
    }


@pytest.mark.parametrize("einsum", [False, True], ids=["Dense", "EinsumDense"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_package_call_gives_keras_numbers_exactly(
    einsum, policy, monkeypatch
):
    monkeypatch.setenv("KTD_FLOAT8_MATMUL", "0")
    keras_losses, keras_weights = _fit(einsum, policy, keras_call=True)
    losses, weights = _fit(einsum, policy)
    assert losses == keras_losses
    for path, value in keras_weights.items():
        np.testing.assert_array_equal(weights[path], value, err_msg=path)


def _scaled_mm_on_cpu():
    return float8._probe(torch.device("cpu"))


@pytest.mark.skipif(
    not _scaled_mm_on_cpu(), reason="this torch has no _scaled_mm on CPU"
)
@pytest.mark.parametrize("einsum", [False, True], ids=["Dense", "EinsumDense"])
@pytest.mark.parametrize(
    "policy, tolerance", [("float32", 1e-6), ("mixed_bfloat16", 2e-3)]
)
def test_scaled_mm_gives_keras_numbers_within_rounding(
    einsum, policy, tolerance, monkeypatch
):
    """The same quantized operands and scales; the scales multiply after
    the sum (float32: the last bits; bfloat16: Keras rounds each
    dequantized operand to bfloat16, the float8 product does not)."""
    keras_losses, keras_weights = _fit(einsum, policy, keras_call=True)
    calls = []
    real = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setenv("KTD_FLOAT8_MATMUL", "1")
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    losses, weights = _fit(einsum, policy)
    # 3 layers x 3 products (forward, and both gradients but the first
    # layer's inputs') per step, the first step's symbolic build aside.
    assert len(calls) >= STEPS * 8
    np.testing.assert_allclose(losses, keras_losses, rtol=tolerance)
    for path, value in keras_weights.items():
        np.testing.assert_allclose(
            weights[path], value, rtol=tolerance, atol=tolerance, err_msg=path
        )


def test_the_float8_product_is_keras_formula_with_the_scales_after_the_sum():
    """`_backend.float8.matmul` against a float emulation of Keras'
    formula: x and k quantized to e4m3 by their scales, the output
    gradient to e5m2; the gradients of the scale and history inputs are
    Keras' next scales and histories."""
    if not _scaled_mm_on_cpu():
        pytest.skip("this torch has no _scaled_mm on CPU")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=generator, requires_grad=True)
    k = torch.randn(16, 32, generator=generator, requires_grad=True)
    scales = [torch.tensor(s, requires_grad=True) for s in (0.01, 0.004, 2.0)]
    histories = [
        torch.tensor([3.0, 1.0, 0.0, 0.0], requires_grad=True) for _ in range(3)
    ]
    y = float8.matmul(x, k, scales, histories, 1, 1, training=True)
    upstream = torch.randn(8, 32, generator=generator)
    y.backward(upstream)

    def qdq(value, scale, dtype):
        return float8.quantize(value, scale, dtype).float() * scale

    with torch.no_grad():
        xq, kq = qdq(x, scales[0], float8.E4M3), qdq(k, scales[1], float8.E4M3)
        gq = qdq(upstream, scales[2], float8.E5M2)
        torch.testing.assert_close(y, xq @ kq, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, gq @ kq.T, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k.grad, xq.T @ gq, rtol=1e-6, atol=1e-6)
        # The next histories: max |.| rolled in; the next scales: e4m3's
        # (e5m2's) largest over the history's maximum, 3.
        for history, value in zip(histories, (x, k, upstream)):
            assert history.grad[0] == value.abs().max()
            assert history.grad[1:].tolist() == [0.0, 0.0, 3.0]
        assert scales[0].grad == pytest.approx(3.0 / 448.0)
        assert scales[2].grad == pytest.approx(3.0 / 57344.0)


def test_where_scaled_mm_runs(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("KTD_FLOAT8_MATMUL", "0")
    assert not float8.uses_scaled_mm(cpu)
    monkeypatch.setenv("KTD_FLOAT8_MATMUL", "auto")
    assert not float8.uses_scaled_mm(cpu)  # auto: GPUs with float8 only
    monkeypatch.setenv("KTD_FLOAT8_MATMUL", "1")
    assert float8.uses_scaled_mm(cpu) == _scaled_mm_on_cpu()
    monkeypatch.setenv("KTD_FLOAT8_MATMUL", "yes")
    with pytest.raises(ValueError, match="KTD_FLOAT8_MATMUL='yes'"):
        float8.uses_scaled_mm(cpu)
