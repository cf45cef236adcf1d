"""einsum_grad: Keras' einsum under FSDP saves its operands, not copies,
and gives torch.einsum's gradients (issue 18: the attention kernels of
keras_hub's Llama were kept whole from forward to backward)."""

import pytest
import torch

from keras_torch_distribution import einsum_grad
from keras_torch_distribution import fsdp

# keras_hub Llama's attention projections and two more shapes of EinsumDense.
EQUATIONS = {
    "btd,dnh->btnh": ((2, 5, 8), (8, 3, 4)),
    "btnh,nhd->btd": ((2, 5, 3, 4), (3, 4, 8)),
    "bqnh,bknh->bnqk": ((2, 5, 3, 4), (2, 6, 3, 4)),
    "ab,bc->ac": ((4, 6), (6, 3)),
}


@pytest.fixture
def fsdp_on(monkeypatch):
    monkeypatch.setattr(fsdp.state, "plans_exist", True)


@pytest.mark.parametrize("equation", sorted(EQUATIONS))
def test_gradients_are_torch_einsums(fsdp_on, equation):
    shapes = EQUATIONS[equation]
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=generator, requires_grad=True) for s in shapes)
    want = torch.einsum(equation, a, b)
    grad = torch.randn(want.shape, generator=generator)
    want_a, want_b = torch.autograd.grad(want, (a, b), grad)
    got = einsum_grad.einsum(torch.einsum, equation, a, b)
    assert got.grad_fn is not None and "_Einsum" in type(got.grad_fn).__name__
    got_a, got_b = torch.autograd.grad(got, (a, b), grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_a, want_a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_b, want_b, rtol=1e-6, atol=1e-6)


def test_saves_the_operands_themselves(fsdp_on):
    """"btnh,nhd->btd": torch.einsum saves a copy of the kernel; ours the
    kernel (a view of its storage, which fsdp's regathering recognises)."""
    x = torch.randn(1, 8, 4, 16, requires_grad=True)
    kernel = torch.randn(4, 16, 64, requires_grad=True)

    def saved_kernel_storages(function):
        seen = []

        def pack(t):
            seen.append(t.untyped_storage().data_ptr() == kernel.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            function("btnh,nhd->btd", x, kernel)
        return seen

    assert not any(saved_kernel_storages(torch.einsum))  # a copy
    ours = saved_kernel_storages(lambda *a: einsum_grad.einsum(torch.einsum, *a))
    assert ours.count(True) == 1


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("ii->i", [(3, 3)]),  # one operand, a diagonal
        ("ab,bc", [(2, 3), (3, 4)]),  # implicit output
        ("...a,ab->...b", [(2, 3), (3, 4)]),  # ellipsis
        ("ab,b->b", [(2, 3), (3,)]),  # a's "a" is summed in a alone
        ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),  # three operands
    ],
)
def test_other_equations_go_to_kerases_einsum(fsdp_on, equation, shapes):
    operands = [torch.randn(s, requires_grad=True) for s in shapes]
    calls = []

    def original(*args, **kwargs):
        calls.append(args[0])
        return torch.einsum(*args, **kwargs)

    einsum_grad.einsum(original, equation, *operands)
    assert calls == [equation]


def test_without_fsdp_variables_keras_einsum_runs(monkeypatch):
    monkeypatch.setattr(fsdp.state, "plans_exist", False)
    calls = []
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(3, 4)
    einsum_grad.einsum(lambda *args: calls.append(args) or torch.einsum(*args), "ab,bc->ac", a, b)
    assert len(calls) == 1


def test_keras_einsum_dense_kernel_is_saved_itself(fsdp_on):
    """EinsumDense passes its kernel as a Keras variable: converted first
    (gathered, under FSDP), then saved as it is."""
    import keras

    layer = keras.layers.EinsumDense("btnh,nhd->btd", output_shape=(None, 64))
    x = torch.randn(1, 8, 4, 16)
    layer.build(x.shape)
    kernel = layer.kernel.value
    # The output is kept: torch<2.13 frees a custom Function's saved
    # tensors once its output is gone.
    out = layer(x)
    node = out.grad_fn
    assert "_Einsum" in type(node).__name__, node
    saved_x, saved_kernel = node.saved_tensors
    assert saved_kernel.untyped_storage().data_ptr() == kernel.untyped_storage().data_ptr()
