"""einsum_grad: Keras' einsum under FSDP saves its operands, not copies,
and gives torch.einsum's gradients (issue 18: the attention kernels of
keras_hub's Llama were kept whole from forward to backward)."""

import itertools

import pytest
import torch

from keras_torch_distribution._fsdp import einsum_grad
from keras_torch_distribution._fsdp import gathering

# keras_hub Llama's attention projections and two more shapes of EinsumDense.
EQUATIONS = {
    "btd,dnh->btnh": ((2, 5, 8), (8, 3, 4)),
    "btnh,nhd->btd": ((2, 5, 3, 4), (3, 4, 8)),
    "bqnh,bknh->bnqk": ((2, 5, 3, 4), (2, 6, 3, 4)),
    "ab,bc->ac": ((4, 6), (6, 3)),
}


@pytest.fixture
def fsdp_on(monkeypatch):
    monkeypatch.setattr(gathering.state, "plans_exist", True)


@pytest.mark.parametrize("equation", sorted(EQUATIONS))
def test_gradients_are_torch_einsums(fsdp_on, equation):
    shapes = EQUATIONS[equation]
    generator = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(s, generator=generator, requires_grad=True) for s in shapes
    )
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
    """ "btnh,nhd->btd": torch.einsum saves a copy of the kernel; ours the
    kernel (a view of its storage, which fsdp's regathering recognises)."""
    x = torch.randn(1, 8, 4, 16, requires_grad=True)
    kernel = torch.randn(4, 16, 64, requires_grad=True)

    def saved_kernel_storages(function):
        seen = []

        def pack(t):
            seen.append(
                t.untyped_storage().data_ptr()
                == kernel.untyped_storage().data_ptr()
            )
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            function("btnh,nhd->btd", x, kernel)
        return seen

    assert not any(saved_kernel_storages(torch.einsum))  # a copy
    ours = saved_kernel_storages(
        lambda *a: einsum_grad.einsum(torch.einsum, *a)
    )
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
    monkeypatch.setattr(gathering.state, "plans_exist", False)
    calls = []
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(3, 4)
    einsum_grad.einsum(
        lambda *args: calls.append(args) or torch.einsum(*args),
        "ab,bc->ac",
        a,
        b,
    )
    assert len(calls) == 1


def test_keras_einsum_dense_kernel_is_saved_itself(fsdp_on):
    """EinsumDense passes its kernel as a Keras variable: converted first
    (gathered, under FSDP), then saved for backward as a view of its own
    storage (which the regathering recognises), never as a copy. The
    equation is a matrix product, so it runs as the fast einsum's one
    matmul (`_backend.numpy`), under FSDP too."""
    import keras

    layer = keras.layers.EinsumDense("btnh,nhd->btd", output_shape=(None, 64))
    # An activation: its gradient needs the kernel.
    x = torch.randn(1, 8, 4, 16, requires_grad=True)
    layer.build(x.shape)
    kernel = layer.kernel.value
    out = layer(x)
    saved = _saved_tensors(out.grad_fn)
    storage = kernel.untyped_storage().data_ptr()
    kernel_sized = [t for t in saved if t.numel() == kernel.numel()]
    assert kernel_sized, [tuple(t.shape) for t in saved]
    assert all(
        t.untyped_storage().data_ptr() == storage for t in kernel_sized
    ), [tuple(t.shape) for t in kernel_sized]


def _saved_tensors(node):
    """The tensors the autograd graph below `node` saved for backward."""
    found, seen, todo = [], set(), [node]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                if isinstance(value, torch.Tensor):
                    found.append(value)
        found += list(getattr(node, "saved_tensors", ()))
        todo += [next_node for next_node, _ in node.next_functions]
    return found


# Equations keras_hub and Keras layers use, with operand shapes.
REORDERED = {
    "bquh,uhm->bqm": ((2, 5, 4, 3), (4, 3, 6)),  # Llama's attention output
    "btkgh,bskh->bkgts": ((2, 5, 1, 4, 3), (2, 6, 1, 3)),  # Gemma's logits
    "bkgts,bskh->btkgh": ((2, 1, 4, 5, 6), (2, 6, 1, 3)),  # Gemma's values
    "bqm,muh->bquh": ((2, 5, 6), (6, 4, 3)),
    "ab,bc": ((3, 4), (4, 5)),  # implicit output
    "...uh,uhm": ((2, 5, 4, 3), (4, 3, 6)),
    "b...h,bh->...b": ((2, 3, 4, 5), (2, 5)),
    "ebc,ecd->ebd": ((3, 2, 4), (3, 4, 5)),  # MoE experts
}


@pytest.mark.parametrize("equation", sorted(REORDERED))
def test_sharded_dims_first_is_the_same_equation(equation):
    """Every choice of one sharded dim per operand gives an equation with
    the same numbers (after its permutation) and its sharded labels first
    in torch's label order and in the output; of two sharded labels of one
    kind (both operands', kept or contracted), one is replicated first."""
    shapes = REORDERED[equation]
    generator = torch.Generator().manual_seed(0)
    operands = [torch.randn(s, generator=generator) for s in shapes]
    want = torch.einsum(equation, *operands)
    choices = [[set()] + [{d} for d in range(len(s))] for s in shapes]
    changed = replicated = 0
    for sharded in itertools.product(*choices):
        got, permutation, replicate = einsum_grad.sharded_dims_first(
            equation, [len(s) for s in shapes], list(sharded)
        )
        changed += got != equation
        replicated += any(replicate)
        assert all(r <= s for r, s in zip(replicate, sharded)), (
            sharded,
            replicate,
        )
        result = torch.einsum(got, *operands)
        if permutation is not None:
            result = result.permute(permutation)
        # The same sums, maybe in another order.
        torch.testing.assert_close(
            result,
            want,
            rtol=1e-5,
            atol=1e-5,
            msg=str((equation, sharded, got)),
        )
        inputs, _, output = got.partition("->")
        kept = [s - r for s, r in zip(sharded, replicate)]
        sharded_labels = [
            {einsum_grad._dim_labels(part, len(shape))[d] for d in dims}
            - {None}
            for part, shape, dims in zip(inputs.split(","), shapes, kept)
        ]
        every = set().union(*sharded_labels)
        if not every:  # nothing, or only dims under an ellipsis
            assert (got, permutation) == (equation, None)
            continue
        labels = set(inputs) - {",", "."}
        # The sharded labels are the first in torch's order (upper case
        # first), and come first in the output.
        assert every == set(sorted(labels)[: len(every)]), got
        assert output.startswith("".join(c for c in output if c in every)), got
        if len(shapes) == 2 and "." not in got:
            a, b = (set(p) for p in inputs.split(","))
            out = set(output)
            for kind in (
                a & b & out,
                (a & out) - b,
                (b & out) - a,
                (a & b) - out,
            ):
                assert len(kind & every) <= 1, (got, kind, every)
    assert changed, equation
    if equation in ("bquh,uhm->bqm", "btkgh,bskh->bkgts"):
        assert replicated, equation  # e.g. one operand's "u", the other's "h"


def test_sharded_dims_first_leaves_what_it_does_not_understand():
    for equation, ndims in [
        ("ab,bc->ac", [2, 3]),
        ("ab,bc,cd->ad", [2, 2]),
        ("aé,éb->ab", [2, 2]),
    ]:
        got = einsum_grad.sharded_dims_first(equation, ndims, [{0}, {1}])
        assert got == (equation, None, [set(), set()]), got
