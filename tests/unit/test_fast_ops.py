"""The fast ops (`_backend/core.py`, `numpy.py` (einsum, power), `nn.py`, SGD in
`_training/optimizer_update.py`, `_training/batch_logs.py`): each gives
Keras' own numbers, without the host reads Keras' own makes, and
KTD_FAST_OPS=0 leaves Keras' own in place.

In the pytest process; no process group.
"""

import itertools
import math

import keras
import numpy as np
import pytest
import torch

import keras_torch_distribution
from keras_torch_distribution import _install
from keras_torch_distribution import _keras
from keras_torch_distribution import testing
from keras_torch_distribution._backend import core
from keras_torch_distribution._backend import nn
from keras_torch_distribution._backend import numpy as backend_numpy
from keras_torch_distribution._training import optimizer_update


def keras_own(owner, name):
    """Keras' own attribute that the patch table replaced."""
    for patch in _install._installed:
        if patch.owner is owner and patch.name == name:
            return patch.original
    raise LookupError(f"{owner.__name__}.{name} is not patched")


# ---------------------------------------------------------------------------
# convert_to_tensor
# ---------------------------------------------------------------------------

NUMBERS = [
    0.1,
    1 / 3,
    -0.7 * 3.38953e38,  # dot_product_attention's large negative
    -0.7 * 65500.0,
    1e-7,
    2.5,
    -0.0,
    float("inf"),
    float("nan"),
    1e300,  # beyond float32: Keras gives inf
    7,
    2**31 - 1,
    -(2**31),
    2**40,  # int64 by Keras' rule
    True,
    False,
    np.float64(0.25),  # a float subclass, as Keras treats it
]
DTYPES = [None, "float32", "float16", "bfloat16", "float64", "int32", "bool"]


@pytest.mark.parametrize(
    "number,dtype", list(itertools.product(NUMBERS, DTYPES))
)
def test_python_numbers_become_keras_tensors_without_host_data(number, dtype):
    original = keras_own(_keras.torch_core_module, "convert_to_tensor")
    try:
        want = original(number, dtype=dtype)
    except (RuntimeError, OverflowError) as error:
        with pytest.raises(type(error)):
            core.convert_to_tensor(original, number, dtype=dtype)
        return
    with testing.count_ops() as counts:
        got = core.convert_to_tensor(original, number, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.device == want.device
    if want.is_floating_point() and math.isnan(float(want)):
        assert math.isnan(float(got))
    else:
        assert torch.equal(got, want), (number, dtype, got, want)
    assert counts.syncs == {}, counts.syncs


@pytest.mark.parametrize(
    "numbers,dtype",
    [
        ((2, 3, 4), "int32"),  # Keras' loss reduction: a shape's values
        ([1.5, 2], None),
        ([True, False], None),
        ((7,), None),
    ],
)
def test_short_lists_of_numbers_are_filled_on_the_device(numbers, dtype):
    original = keras_own(_keras.torch_core_module, "convert_to_tensor")
    want = original(numbers, dtype=dtype)
    with testing.count_ops() as counts:
        got = core.convert_to_tensor(original, numbers, dtype=dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert counts.syncs == {}


def test_arrays_tensors_and_long_lists_are_keras_own():
    original = keras_own(_keras.torch_core_module, "convert_to_tensor")
    long = list(range(core.MAX_LISTED_NUMBERS + 1))
    for value in (np.arange(6.0).reshape(2, 3), long, torch.ones(3)):
        got = core.convert_to_tensor(original, value)
        want = original(value)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_every_module_that_binds_convert_to_tensor_gets_the_fast_one():
    replaced = {
        patch.owner
        for patch in _install._installed
        if patch.name == "convert_to_tensor"
    }
    assert set(_keras.CONVERT_TO_TENSOR_OWNERS) <= replaced
    # keras_hub's RMS norm and rotary embedding reach it through these.
    assert _keras.torch_numpy_module in replaced
    assert _keras.torch_core_module in replaced


# ---------------------------------------------------------------------------
# einsum
# ---------------------------------------------------------------------------

PLANS = [
    # equation, shapes, plan (swap, kept rows dims, contracted dims)
    ("btd,dnh->btnh", [(2, 5, 8), (8, 3, 4)], (False, 2, 1)),
    ("btnh,nhd->btd", [(2, 5, 3, 4), (3, 4, 8)], (False, 2, 2)),
    ("ab,bc->ac", [(4, 6), (6, 5)], (False, 1, 1)),
    ("dn,btd->btn", [(8, 3), (2, 5, 8)], (True, 2, 1)),
    ("btd,d->bt", [(2, 5, 8), (8,)], (False, 2, 1)),
    ("abc,cd->abd", [(2, 3, 4), (4, 5)], (False, 2, 1)),
]
NOT_MATMULS = [
    ("bqh,bkh->bqk", [(2, 5, 4), (2, 6, 4)]),  # a batch dim both keep
    ("btd,nd->btn", [(2, 5, 8), (3, 8)]),  # contracted last in both
    ("abc,bcd->ad", [(2, 3, 4), (3, 4, 5)]),  # `a` ... order differs: fine
    ("ab,bc->ca", [(4, 6), (6, 5)]),  # output transposed
    ("...d,dn->...n", [(2, 5, 8), (8, 3)]),  # ellipsis
    ("aab,bc->ac", [(3, 3, 4), (4, 5)]),  # a repeated label
    ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),  # three operands
]


@pytest.mark.parametrize("equation,shapes,plan", PLANS)
def test_contractions_of_trailing_with_leading_dims_are_one_matmul(
    equation, shapes, plan
):
    assert tuple(backend_numpy.matmul_plan(equation, *map(len, shapes))) == (
        plan
    )
    _check_einsum(equation, shapes)


@pytest.mark.parametrize("equation,shapes", NOT_MATMULS)
def test_other_equations_are_left_to_keras(equation, shapes):
    if "..." not in equation and equation.count(",") == 1:
        plan = backend_numpy.matmul_plan(equation, *map(len, shapes))
        if equation != "abc,bcd->ad":
            assert plan is None
    _check_einsum(equation, shapes)


def _check_einsum(equation, shapes):
    original = keras_own(_keras.torch_numpy_module, "einsum")
    rng = np.random.default_rng(0)
    operands = [
        torch.tensor(
            rng.normal(size=s), dtype=torch.float32, requires_grad=True
        )
        for s in shapes
    ]
    want = original(equation, *operands)
    grads_want = torch.autograd.grad(want.sum(), operands)
    got = backend_numpy.einsum(original, equation, *operands)
    grads_got = torch.autograd.grad(got.sum(), operands)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_einsum_dense_runs_as_one_matmul_with_keras_numbers():
    keras.utils.set_random_seed(1)
    layer = keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 3, 4))
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    layer.build(x.shape)
    with testing.count_ops() as counts:
        got = layer(x)
    assert counts.ops["mm"] == 1 and "bmm" not in counts.ops
    assert "permute" not in counts.ops
    want = np.einsum(
        "btd,dnh->btnh", x, keras.ops.convert_to_numpy(layer.kernel)
    )
    got = keras.ops.convert_to_numpy(got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# power
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("exponent", [2, 2.0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_square_equals_keras(exponent, dtype):
    original = keras_own(_keras.torch_numpy_module, "power")
    rng = np.random.default_rng(0)
    x = torch.tensor(
        rng.normal(size=(3, 5)), dtype=getattr(torch, dtype), requires_grad=True
    )

    def run(power):
        y = power(x, exponent)
        (grad,) = torch.autograd.grad(y.sum(), [x])
        return y, grad

    want, grad_want = run(original)
    with testing.count_ops() as counts:
        got, grad_got = run(lambda x, e: backend_numpy.power(original, x, e))
    assert got.dtype == want.dtype and grad_got.dtype == grad_want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=0)
    # No tensor made of the exponent, no test of it for 0 in backward.
    assert not {"full", "lift_fresh", "eq", "where"} & set(counts.ops), counts


def test_power_of_other_operands_is_keras_own():
    original = keras_own(_keras.torch_numpy_module, "power")
    for x1, x2 in [
        # Other exponents: torch's pow by a number takes other roads
        # (sqrt, reciprocal, x * x * x), a rounding apart from Keras'.
        (torch.rand(3) + 0.5, 0.5),
        (torch.rand(3) + 0.5, -1),
        (torch.rand(3) + 0.5, 3),
        (torch.arange(4), 2),  # an integer tensor: Keras' dtype rules
        # float64: Keras 3.16 squares it in float32, 3.15 in float64.
        (torch.rand(3, dtype=torch.float64), 2),
        (torch.rand(3), torch.rand(3)),
        (torch.rand(3), True),
        (2, torch.rand(3)),
    ]:
        got = backend_numpy.power(original, x1, x2)
        want = original(x1, x2)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------
# sparse categorical cross-entropy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize(
    "output_shape,target_extra",
    [((2, 5, 7), ()), ((2, 3, 4, 7), ()), ((2, 5, 7), (1,)), ((4, 7), ())],
)
def test_cross_entropy_on_rows_equals_keras(
    from_logits, output_shape, target_extra
):
    original = keras_own(
        _keras.torch_nn_module, "sparse_categorical_crossentropy"
    )
    rng = np.random.default_rng(0)
    output = torch.tensor(rng.normal(size=output_shape), dtype=torch.float32)
    if not from_logits:
        output = torch.softmax(output, dim=-1)
    output.requires_grad_(True)
    target = torch.tensor(
        rng.integers(0, output_shape[-1], output_shape[:-1] + target_extra)
    )
    want = original(target, output, from_logits=from_logits)
    try:
        (grad_want,) = torch.autograd.grad(want.sum(), output)
    except RuntimeError as error:
        # Keras' own cannot be differentiated here (torch 2.13: nll_loss2d's
        # backward refuses the strided class dim): Keras' formula with the
        # class dim moved and made contiguous instead.
        assert "contiguous" in str(error)
        (grad_want,) = torch.autograd.grad(
            _keras_formula(target, output, from_logits).sum(), output
        )
    got = nn.sparse_categorical_crossentropy(
        original, target, output, from_logits=from_logits
    )
    (grad_got,) = torch.autograd.grad(got.sum(), output)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-6, atol=1e-7)


def _keras_formula(target, output, from_logits):
    classes_first = output.movedim(-1, 1).contiguous()
    if from_logits:
        return torch.nn.functional.cross_entropy(
            classes_first, target, reduction="none"
        )
    probabilities = classes_first / classes_first.sum(dim=1, keepdim=True)
    probabilities = torch.clip(
        probabilities, keras.config.epsilon(), 1 - keras.config.epsilon()
    )
    return torch.nn.functional.nll_loss(
        torch.log(probabilities), target, reduction="none"
    )


def test_cross_entropy_keeps_keras_errors_and_other_axes():
    original = keras_own(
        _keras.torch_nn_module, "sparse_categorical_crossentropy"
    )
    output = torch.randn(2, 7, 5)
    target = torch.randint(0, 7, (2, 5))
    torch.testing.assert_close(
        nn.sparse_categorical_crossentropy(
            original, target, output, from_logits=True, axis=1
        ),
        original(target, output, from_logits=True, axis=1),
    )
    with pytest.raises(ValueError, match="same shape"):
        nn.sparse_categorical_crossentropy(
            original, torch.zeros(2, 4, dtype=torch.long), torch.randn(2, 5, 7)
        )


def test_a_language_model_loss_moves_no_class_dim():
    """The loss Keras computes for (batch, sequence, vocabulary) logits
    runs on rows: no `movedim`, no `nll_loss2d`."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    with testing.count_ops() as counts:
        loss(labels, logits)
    assert "nll_loss2d_forward" not in counts.ops
    assert counts.ops["nll_loss_forward"] == 1
    assert counts.syncs == {}


# ---------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}],
)
def test_sgd_equals_keras_and_reads_nothing_on_the_host(options):
    def train(update):
        keras.utils.set_random_seed(3)
        variables = [
            keras.Variable(np.linspace(-1, 1, 12).reshape(3, 4), name="w"),
            keras.Variable(np.arange(4.0), name="b"),
        ]
        optimizer = keras.optimizers.SGD(0.1, **options)
        optimizer.build(variables)
        grads = [torch.full((3, 4), 0.5), torch.arange(4.0) / 10]
        with testing.count_ops() as counts, torch.no_grad():
            for _ in range(3):
                optimizer.iterations.assign_add(1)
                update(optimizer, grads, variables, optimizer.learning_rate)
        return [np.asarray(v) for v in variables], counts

    original = keras_own(_keras.TorchSGD, "_parallel_update_step")
    want, keras_counts = train(original)
    got, counts = train(
        lambda *args: optimizer_update.sgd_update(original, *args)
    )
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert counts.syncs == {}


# ---------------------------------------------------------------------------
# Batch logs
# ---------------------------------------------------------------------------


def _fit(verbose, callbacks=(), batches=8):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=["mae"])
    x = np.ones((4 * batches, 4), "float32")
    y = np.zeros((4 * batches, 2), "float32")
    with testing.count_ops() as counts:
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=1,
            verbose=verbose,
            callbacks=list(callbacks),
        )
    return counts


def test_fit_reads_no_batch_logs_when_nothing_shows_them():
    # The logs are read at the end of the epoch (History), never per batch:
    # as many reads for 16 batches as for 8.
    reads = [_fit(verbose=0, batches=n).host_reads["numpy"] for n in (8, 16)]
    assert reads[0] == reads[1] <= 4, reads


def test_a_callback_that_reads_batch_logs_gets_floats_after_each_batch():
    seen = []

    class Reader(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs))

    counts = _fit(verbose=0, callbacks=[Reader()])
    assert len(seen) == 8
    assert all(isinstance(v, float) for logs in seen for v in logs.values())
    assert counts.host_reads["numpy"] >= 8 * 2


def test_the_progress_bar_shows_the_step_values(capsys):
    _fit(verbose=1)
    shown = capsys.readouterr().out
    assert "loss:" in shown and "mae:" in shown


# ---------------------------------------------------------------------------
# KTD_FAST_OPS=0
# ---------------------------------------------------------------------------


def test_fast_ops_off_leaves_keras_own(monkeypatch):
    monkeypatch.setenv("KTD_FAST_OPS", "0")
    keras_torch_distribution.uninstall()
    try:
        keras_torch_distribution.install()
        names = {patch.name for patch in _install._installed}
        assert "convert_to_tensor" not in names
        assert "sparse_categorical_crossentropy" not in names
        assert "_on_train_batch_end" not in names
        einsum = next(
            p for p in _install._installed if p.describe().endswith("einsum")
        )
        assert einsum.replacement is not backend_numpy.einsum
    finally:
        monkeypatch.delenv("KTD_FAST_OPS")
        keras_torch_distribution.uninstall()
        keras_torch_distribution.install()


def test_fast_ops_setting_refuses_other_values(monkeypatch):
    from keras_torch_distribution import _env

    monkeypatch.setenv("KTD_FAST_OPS", "yes")
    with pytest.raises(ValueError, match="KTD_FAST_OPS='yes'"):
        _env.fast_ops()


def test_repr_of_a_variable_reads_no_value_while_torch_compiles():
    """Dynamo on torch 2.11/2.12 calls `repr` of the variables it guards
    on; Keras' repr copies the value to the host."""
    from torch._guards import CompileContext
    from torch._guards import CompileId
    from torch._guards import compile_context

    variable = keras.Variable(np.ones((2, 3)), name="kernel")
    with testing.count_ops() as counts:
        assert "[[1." in repr(variable)  # Keras' own: the value, read
    assert counts.host_reads["numpy"] >= 1
    context = CompileContext(CompileId(frame_id=0, frame_compile_id=0))
    with compile_context(context):
        with testing.count_ops() as counts:
            text = repr(variable)
    assert "shape=(2, 3)" in text and counts.syncs == {}
