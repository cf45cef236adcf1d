"""Keras' torch `einsum`, as one matrix product where the equation is one;
`power` with a Python number as the exponent.

`EinsumDense` (every attention projection of keras_hub's models:
"btd,dnh->btnh", "btnh,nhd->btd") calls `einsum`, and `torch.einsum`
contracts through permuted, unsqueezed operands and a batched `bmm` with
a batch of one, with more permutes in backward: in a 4-block keras_hub
Llama step, 210 permutes, 124 unsqueezes, 68 squeezes and 48 `bmm` where
torch's own `nn.Linear` runs one `mm`.

An equation that contracts the trailing dims of the first operand with the
leading dims of the second, in the same order, keeping the rest in order
("abc,cd->abd", "btnh,nhd->btd", "bqm,muh->bquh"; also with the operands'
roles swapped), is the matrix product of the two operands flattened to
(rows, contracted) and (contracted, columns): it runs as `torch.matmul`
of those views and one reshape of the result, as `nn.Linear` does, and
backward is two matrix products. The same sums of the same products;
only the order in which the hardware adds them may differ, as between any
two GEMM calls.

Under FSDP too: the matrix product saves views of its operands (the
flattened kernel is a view of the gathered one, never a copy), which the
regathering recognises by their storage, as it does `fsdp.einsum_grad`'s
saved operands (a keras_hub Llama FSDP step: 2,956 aten ops instead of
3,388, the same 8 all-gathers). Other equations and operands that are not
both plain tensors of one floating dtype (DTensors, int8) go to the
package's FSDP-aware einsum (`fsdp.einsum_grad`), which hands what it does
not handle to Keras' own.


`power(x, 2)` (keras_hub's RMS norms: 9 in a 4-block Llama step): Keras
turns the Python exponent into a 0-dim tensor, so torch runs a
tensor-to-tensor power, whose backward also computes where the exponent
is 0 (an `eq`, a `where` and a fill per call) and raises `x` to `2 - 1`.
`torch.pow(x, 2)` takes the number as a number, as `x ** 2` in torch's
own recipes: the same dtype (a number never widens a floating tensor,
nor does Keras' 0-dim tensor), the same values (a square is exact in
both) and backward `2 * x * grad`. float64 and other exponents stay
Keras' (Keras 3.16 squares float64 in float32; torch's power by a number
runs other exponents as `sqrt`, `reciprocal` or `x * x * x`, a rounding
away from Keras' numbers).
"""

import functools
from typing import NamedTuple

import keras
import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution._fsdp import einsum_grad


class MatmulPlan(NamedTuple):
    """An einsum of two operands as one matrix product: `swap` says the
    second operand is the left factor; the left factor keeps its first
    `kept_left` dims, and `contracted` dims are summed over."""

    swap: bool
    kept_left: int
    contracted: int


def einsum(original, subscripts, *operands, **kwargs):
    """Replaces Keras' torch `einsum`: a matrix product where the equation
    is one (see the module docstring), else the FSDP-aware einsum, which
    hands what it does not handle to Keras' own."""
    if len(operands) == 2 and not kwargs and isinstance(subscripts, str):
        a, b = operands
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            # As Keras' einsum does first: a variable becomes its value.
            a, b = (
                keras.ops.convert_to_tensor(a),
                keras.ops.convert_to_tensor(b),
            )
            operands = (a, b)
        plan = _plan_for(subscripts, a, b)
        if plan is not None:
            return run(plan, a, b)
    return einsum_grad.einsum(original, subscripts, *operands)


def _plan_for(subscripts, a, b):
    """The matmul plan for plain tensors `a`, `b`, or None."""
    if (
        isinstance(a, DTensor)
        or isinstance(b, DTensor)
        or a.dtype != b.dtype
        or not a.is_floating_point()
    ):
        return None
    # While compiling, the plan is worked out anew (dynamo traces through
    # the cache, and warns that it does).
    plan_for = (
        matmul_plan.__wrapped__
        if torch.compiler.is_compiling()
        else matmul_plan
    )
    return plan_for(subscripts.replace(" ", ""), a.ndim, b.ndim)


@functools.lru_cache(maxsize=512)
def matmul_plan(subscripts, ndim_a, ndim_b):
    """How the einsum `subscripts` of operands with `ndim_a` and `ndim_b`
    dims runs as one matrix product (a `MatmulPlan`), or None when it is
    not one."""
    if "..." in subscripts or subscripts.count("->") != 1:
        return None
    inputs, output = subscripts.split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or len(parts[0]) != ndim_a or len(parts[1]) != ndim_b:
        return None
    if any(len(set(p)) != len(p) for p in (parts[0], parts[1], output)):
        return None
    for swap in (False, True):
        left, right = parts[::-1] if swap else parts
        contracted = _contracted(left, right, output)
        if contracted is not None:
            return MatmulPlan(swap, len(left) - contracted, contracted)
    return None


def _contracted(left, right, output):
    """How many trailing labels of `left` are the leading labels of
    `right` and appear in no other place, with `output` the rest of
    `left` then the rest of `right`; None when that is not the case."""
    shared = [label for label in left if label in right]
    count = len(shared)
    if count == 0 or left[len(left) - count :] != right[:count]:
        return None
    if output != left[: len(left) - count] + right[count:]:
        return None
    return count


def run(plan, a, b):
    """The einsum of `a` and `b` by `plan`: one `torch.matmul`."""
    left, right = (b, a) if plan.swap else (a, b)
    kept_shape = left.shape[: plan.kept_left]
    contracted_shape = left.shape[plan.kept_left :]
    if right.shape[: plan.contracted] != contracted_shape:
        raise ValueError(
            f"einsum operands of shapes {tuple(a.shape)} and "
            f"{tuple(b.shape)}: the contracted dims "
            f"{tuple(contracted_shape)} and "
            f"{tuple(right.shape[: plan.contracted])} differ. Give operands "
            "whose summed-over dims have equal sizes."
        )
    size = contracted_shape.numel()
    columns_shape = right.shape[plan.contracted :]
    matrix = (
        right.reshape(size, columns_shape.numel())
        if columns_shape
        else right.reshape(size)
    )
    product = torch.matmul(left.reshape(*kept_shape, size), matrix)
    return product.reshape(*kept_shape, *columns_shape)


def power(original, x1, x2):
    """Replaces Keras' torch `power`: a floating tensor squared (the Python
    number 2) as `torch.pow(x1, 2)` (see the module docstring); anything
    else to Keras' own."""
    if (
        type(x2) in (int, float)
        and x2 == 2
        and isinstance(x1, torch.Tensor)
        and x1.dtype in _SQUARED_AS_IS
    ):
        return torch.pow(x1, 2)
    return original(x1, x2)


# The dtypes whose square keeps the dtype in Keras 3.15 and 3.16 alike
# (3.16 computes a float64 tensor's power of a Python number in float32).
_SQUARED_AS_IS = (torch.float32, torch.float16, torch.bfloat16)
