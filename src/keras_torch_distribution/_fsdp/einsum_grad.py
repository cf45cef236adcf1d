"""Einsum that keeps its operands for backward, not copies of them.

`torch.einsum` contracts through permuted, reshaped operands and `bmm`; when
a permutation cannot be a view, the reshape copies, and autograd saves that
copy for backward. Keras' `EinsumDense` (keras_hub's attention projections:
"btd,dnh->btnh", "btnh,nhd->btd") then keeps a private copy of a gathered
FSDP kernel from forward to backward, out of reach of the regathering in
`_fsdp.gathering` (which recognises views of gathered weights only): every
attention kernel of the model, gathered whole, alive at once between forward and
backward (measured in `benchmarks/scale.py`: four 16 MiB copies per decoder
block of a 2048-wide Llama).

While variables are sharded on the batch axis (`gathering.plans_exist()`),
Keras' torch `einsum` of two operands with an explicit output and plain
subscripts that is not one matrix product (those run as one matmul,
`_backend.numpy`, which saves views too) runs as `_Einsum`: the same
`torch.einsum` forward, with the two operands themselves saved (so a
gathered kernel is a view that the regathering replaces by a token), and
a backward of two einsums,
`grad_a = einsum("out,b->a", grad, b)` and `grad_b = einsum("out,a->b",
grad, a)`. Other calls (one or three operands, ellipses, repeated or
operand-only indices, compiling) go to Keras' own einsum.

Where torch's DTensor cannot flatten dims of which a later one is sharded
(torch<2.13 refuses: "Attempted to flatten multiple dimensions, with
dimension 1 being sharded"; 2.13 gives a `_StridedShard`), the equation is
rewritten first (`sharded_dims_first`): `torch.einsum` flattens the dims
of each kind (batch, kept, contracted) into one, in the output's order or
its labels', and a sharded dim first among them flattens into a sharded
dim. So the output lists its sharded labels first (the result is permuted
back), the labels are renamed so that the sharded ones come first, and of
two sharded labels of one kind the second is replicated first. The same
sums: keras_hub's attention output "bquh,uhm->bqm", heads ("u") sharded,
runs as "BEAC,ACD->BED". A gradient can arrive sharded where the forward's
output was not (Qwen's attention runs replicated, its output kernel is
sharded on the heads), so there every einsum of the kind `_Einsum` handles
runs as `_Einsum` when it meets a DTensor (not only under FSDP), its
backward einsums rewritten the same way.

A dim sharded unevenly (60 experts on a model axis of 8) cannot be
flattened with others at all, in any torch: where `torch.einsum` would
flatten one, it is replicated first (`_evenly_flattened`, forward and
backward).
"""

import string

import keras
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_torch_distribution._distributed import sharding_rules
from keras_torch_distribution._fsdp import gathering

# torch.einsum's label order: upper case first.
_LABELS = string.ascii_uppercase + string.ascii_lowercase
# Whether sharded dims are put first (torch<2.13; see the module docstring).
_REORDER_SHARDED_DIMS = sharding_rules.VIEWS_REFUSE_LATER_SHARDED_DIMS


def _dim_labels(part, ndim):
    """The label of each dim of an operand with subscripts `part` (None for
    dims under an ellipsis), or None when `part` does not fit `ndim`."""
    if "..." in part:
        before, after = part.split("...", 1)
        if "." in after or len(before) + len(after) > ndim:
            return None
        return (
            list(before)
            + [None] * (ndim - len(before) - len(after))
            + list(after)
        )
    return list(part) if len(part) == ndim else None


def sharded_dims_first(subscripts, ndims, sharded_dims):
    """How to run `subscripts` on operands of `ndims` dims sharded on
    `sharded_dims` (a set of dims for each) so that torch<2.13's DTensor
    can flatten the dims `torch.einsum` flattens together: (an equation
    computing the same, the permutation that puts its result's dims back in
    `subscripts`' order or None, the dims of each operand to replicate
    first). `(subscripts, None, no dims)` where nothing is sharded, or for
    an equation this does not understand (torch.einsum judges it).

    `torch.einsum` lays out each operand's dims in the order of the output
    (the dims it keeps), then of their labels (the dims it contracts), and
    for two operands flattens each kind of dim into one for `bmm`: the
    batch dims (in both operands and the output), the dims of one operand
    kept, and the dims contracted. A sharded dim flattens into a sharded
    dim when it comes first among its kind. So the output lists the
    sharded labels first, and the labels are renamed so that the sharded
    ones come first in torch's label order (upper case first). Where two
    labels of one kind are sharded, the first keeps its sharding and the
    other is replicated first (torch 2.13 gathers too).
    """
    unchanged = (subscripts, None, [set() for _ in ndims])
    equation = subscripts.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    parts = inputs.split(",")
    labels = {c for c in inputs if c.isalpha()}
    if len(parts) != len(ndims) or not labels <= set(_LABELS):
        return unchanged
    dim_labels = [_dim_labels(part, ndim) for part, ndim in zip(parts, ndims)]
    if None in dim_labels:
        return unchanged
    ellipsis_ndim = max(d.count(None) for d in dim_labels)
    # The sharded labels of each operand, and the dims they label.
    sharded = [
        {d: labels_[d] for d in dims if labels_[d] is not None}
        for labels_, dims in zip(dim_labels, sharded_dims)
    ]
    if not any(sharded):
        return unchanged
    if not arrow:
        # The implicit output: the labels used once, in label order, after
        # the ellipsis' dims; made explicit before the order changes.
        once = sorted(
            (c for c in labels if inputs.count(c) == 1), key=_LABELS.index
        )
        output = ("..." if "..." in inputs else "") + "".join(once)
    before, ellipsis, after = output.partition("...")
    if not set(before + after) <= labels or "." in after:
        return unchanged
    replicate = [set() for _ in ndims]
    if len(parts) == 2:
        a, b = (set(p) - {"."} for p in parts)
        out = set(output) - {"."}
        kinds = [  # each in the order torch lays them out
            [c for c in output if c in a & b],
            [c for c in output if c in a - b],
            [c for c in output if c in b - a],
            sorted((a & b) - out, key=_LABELS.index),
        ]
        for kind in kinds:
            labelled = [
                c for c in kind if any(c in s.values() for s in sharded)
            ]
            for operand, dims in enumerate(sharded):
                for d, c in list(dims.items()):
                    if c in labelled[1:]:
                        replicate[operand].add(d)
                        del dims[d]
    first = set().union(*(s.values() for s in sharded))
    if not first:
        return subscripts, None, replicate
    # Output dims as tokens (an ellipsis is its dims), sharded ones first.
    tokens = (
        list(before)
        + [("...", i) for i in range(ellipsis_ndim if ellipsis else 0)]
        + list(after)
    )
    reordered = [t for t in tokens if t in first] + [
        t for t in tokens if t not in first
    ]
    new_output = "".join(
        t for t in reordered if isinstance(t, str) and t in first
    )
    new_output += before.translate({ord(c): None for c in first}) + ellipsis
    new_output += after.translate({ord(c): None for c in first})
    order = sorted(labels, key=lambda c: (c not in first, _LABELS.index(c)))
    rename = str.maketrans(dict(zip(order, _LABELS)))
    permutation = [reordered.index(t) for t in tokens]
    if permutation == list(range(len(tokens))):
        permutation = None
    return (
        f"{inputs.translate(rename)}->{new_output.translate(rename)}",
        permutation,
        replicate,
    )


def _sharded_dims(operand):
    if not isinstance(operand, DTensor):
        return set()
    return {p.dim for p in operand.placements if isinstance(p, Shard)}


def _replicated_on(operand, dims):
    """`operand` (a DTensor) replicated where it is sharded on `dims`.
    Collective: call on every rank."""
    if not dims:
        return operand
    placements = [
        Replicate() if isinstance(p, Shard) and p.dim in dims else p
        for p in operand.placements
    ]
    return operand.redistribute(operand.device_mesh, placements)


def _evenly_flattened(subscripts, operands):
    """`operands` with each dim that is sharded unevenly (its size not a
    multiple of the mesh axes sharding it) replicated first where
    `torch.einsum` flattens it with other dims of its kind (batch, kept,
    contracted), which torch's DTensor refuses ("Cannot flatten unevenly
    sharded tensor": keras_hub's Qwen MoE, 60 experts on a model axis of 8,
    its expert gradient sharded on the experts). A dim alone of its kind is
    not flattened and stays sharded. Operands of an equation `_subscripts`
    does not parse are returned as they are. Collective: call on every
    rank."""
    parsed = _subscripts(subscripts) if len(operands) == 2 else None
    if parsed is None:
        return operands
    a, b, out = (set(part) for part in parsed)
    kinds = (a & b & out, a - b, b - a, (a & b) - out)
    result = []
    for operand, part in zip(operands, parsed[:2]):
        if isinstance(operand, DTensor) and operand.ndim == len(part):
            flattened = {
                d
                for d in _uneven_dims(operand)
                if len(set(part) & next(k for k in kinds if part[d] in k)) > 1
            }
            operand = _replicated_on(operand, flattened)
        result.append(operand)
    return tuple(result)


def _uneven_dims(operand):
    """The dims of DTensor `operand` whose size is not a multiple of the
    number of shards the mesh cuts them into."""
    shards = {}
    for axis, placement in enumerate(operand.placements):
        if isinstance(placement, Shard):
            dim = placement.dim % operand.ndim
            shards[dim] = shards.get(dim, 1) * operand.device_mesh.size(axis)
    return {d for d, n in shards.items() if operand.shape[d] % n}


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
            grad_a = _contract(f"{out},{sb}->{sa}", grad, b)
        if ctx.needs_input_grad[2]:
            grad_b = _contract(f"{out},{sa}->{sb}", grad, a)
        return None, grad_a, grad_b


def _contract(equation, x, y):
    """torch.einsum of two tensors, with their sharded dims put first where
    torch's DTensor needs it (`sharded_dims_first`): a gradient can arrive
    sharded where the forward's output was not, and sharded unevenly on a
    dim that torch.einsum flattens (`_evenly_flattened`)."""
    x, y = _evenly_flattened(equation, (x, y))
    if not _REORDER_SHARDED_DIMS:
        return torch.einsum(equation, x, y)
    equation, permutation, replicate = sharded_dims_first(
        equation, [x.ndim, y.ndim], [_sharded_dims(x), _sharded_dims(y)]
    )
    x, y = (_replicated_on(t, dims) for t, dims in zip((x, y), replicate))
    result = torch.einsum(equation, x, y)
    return result if permutation is None else result.permute(permutation)


def einsum(original, subscripts, *operands, **kwargs):
    """Keras' torch `einsum`; see the module docstring."""
    if isinstance(subscripts, str):
        operands = _evenly_flattened(subscripts, operands)
    if not _REORDER_SHARDED_DIMS or not isinstance(subscripts, str):
        return _einsum(original, subscripts, *operands, **kwargs)
    # As Keras' einsum does first: a variable becomes its value.
    operands = tuple(keras.ops.convert_to_tensor(x) for x in operands)
    subscripts, permutation, replicate = sharded_dims_first(
        subscripts,
        [getattr(x, "ndim", 0) for x in operands],
        [_sharded_dims(x) for x in operands],
    )
    operands = tuple(
        _replicated_on(x, dims) for x, dims in zip(operands, replicate)
    )
    result = _einsum(original, subscripts, *operands, **kwargs)
    return result if permutation is None else result.permute(permutation)


def _einsum(original, subscripts, *operands, **kwargs):
    dtensors = _REORDER_SHARDED_DIMS and any(
        isinstance(x, DTensor) for x in operands
    )
    if (
        not (gathering.plans_exist() or dtensors)
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
