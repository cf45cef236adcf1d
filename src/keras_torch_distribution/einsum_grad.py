"""Einsum that keeps its operands for backward, not copies of them.

`torch.einsum` contracts through permuted, reshaped operands and `bmm`; when
a permutation cannot be a view, the reshape copies, and autograd saves that
copy for backward. Keras' `EinsumDense` (keras_hub's attention projections:
"btd,dnh->btnh", "btnh,nhd->btd") then keeps a private copy of a gathered
FSDP kernel from forward to backward, out of reach of the regathering in
`fsdp` (which recognises views of gathered weights only): every attention
kernel of the model, gathered whole, alive at once between forward and
backward (measured in `benchmarks/scale.py`: four 16 MiB copies per
decoder block of a 2048-wide Llama).

While variables are sharded on the batch axis (`fsdp.plans_exist()`),
Keras' torch `einsum` of two operands with an explicit output and plain
subscripts runs as `_Einsum`: the same `torch.einsum` forward, with the two
operands themselves saved (so a gathered kernel is a view that the
regathering replaces by a token), and a backward of two einsums,
`grad_a = einsum("out,b->a", grad, b)` and `grad_b = einsum("out,a->b",
grad, a)`. Other calls (one or three operands, ellipses, repeated or
operand-only indices, compiling) go to Keras' own einsum.
"""

import keras
import torch

from keras_torch_distribution import fsdp


def _subscripts(equation):
    """(a, b, out) of an "a,b->out" equation of letters each operand uses
    once, every index of an operand in the other operand or in the output;
    None otherwise."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, out = equation.split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    for part in (a, b, out):
        if not part.isalpha() or len(set(part)) != len(part):
            return None
    if set(out) - set(a) - set(b):
        return None
    if set(a) - set(b) - set(out) or set(b) - set(a) - set(out):
        return None
    return a, b, out


class _Einsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, subscripts, a, b):
        ctx.subscripts = subscripts
        ctx.save_for_backward(a, b)
        sa, sb, out = subscripts
        return torch.einsum(f"{sa},{sb}->{out}", a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        sa, sb, out = ctx.subscripts
        grad_a = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_a = torch.einsum(f"{out},{sb}->{sa}", grad, b)
        if ctx.needs_input_grad[2]:
            grad_b = torch.einsum(f"{out},{sa}->{sb}", grad, a)
        return None, grad_a, grad_b


def einsum(original, subscripts, *operands, **kwargs):
    """Keras' torch `einsum`; see the module docstring."""
    if (
        not fsdp.plans_exist()
        or len(operands) != 2
        or kwargs
        or not isinstance(subscripts, str)
        or not torch.is_grad_enabled()
        or torch.compiler.is_compiling()
    ):
        return original(subscripts, *operands, **kwargs)
    parsed = _subscripts(subscripts)
    # As Keras' einsum does first: a Keras variable becomes its value for
    # use, i.e. a kernel sharded on the batch axis is gathered here.
    a, b = (keras.ops.convert_to_tensor(x) for x in operands)
    if (
        parsed is None
        or not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)
        or not (a.requires_grad or b.requires_grad)
        or a.dtype != b.dtype
        or not a.is_floating_point()
    ):
        return original(subscripts, a, b)
    return _Einsum.apply(parsed, a, b)
