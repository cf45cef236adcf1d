"""What torch's DTensor lacks or gets wrong before 2.13 (2.11, 2.12), chosen
in `register` by what torch has: convolution and index writes where it
has no single-dim strategy for them, squeezes where its propagator does
not rewrite them; stack's dim is made non-negative wherever stack has a
whole-op strategy (a no-op where torch normalises it right).

Each rule is described in `sharding_rules`.
"""

import dataclasses

import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

aten = torch.ops.aten


def _convolution_rule(input, weight, bias, *args):
    """torch 2.13's `convolution` strategies: sharded on the batch with the
    kernel and bias replicated, or all replicated. A kernel sharded on its
    channels is gathered for the op (as on torch 2.13)."""
    rest = [None] * len(args)
    bias_placement = None if bias is None else Replicate()
    return [
        ([Replicate()], [Replicate(), Replicate(), bias_placement, *rest]),
        ([Shard(0)], [Shard(0), Replicate(), bias_placement, *rest]),
    ]


def _convolution_backward_rule(grad_output, input, weight, bias_sizes, *args):
    """torch 2.13's `convolution_backward` strategies (gradients of the
    input, kernel and bias from the output's gradient, the input and the
    kernel): sharded on the batch, the kernel's and bias' gradients then
    partial sums; or all replicated. Gradients `output_mask` does not ask
    for are left out (None)."""
    mask = args[-1]
    rest = [None] * len(args)

    def outputs(grad_input, grad_weight, grad_bias):
        if bias_sizes is None:
            grad_bias = None
        return [
            p if want else None
            for p, want in zip((grad_input, grad_weight, grad_bias), mask)
        ]

    return [
        (
            outputs(Replicate(), Replicate(), Replicate()),
            [Replicate(), Replicate(), Replicate(), None, *rest],
        ),
        (
            outputs(Shard(0), Partial(), Partial()),
            [Shard(0), Shard(0), Replicate(), None, *rest],
        ),
    ]


# op -> (its rule, the first argument DTensor's sharding cache must key on).
# A convolution's result shape depends on its stride, padding, ...;
# `register_sharding` would key on its int arguments only (`groups`).
CONVOLUTION_RULES = {
    aten.convolution.default: (_convolution_rule, 3),
    aten.convolution_backward.default: (_convolution_backward_rule, 3),
}


def index_put_strategy(op_schema):
    """`index_put(self, indices, values, accumulate)` and its in-place
    forms, as torch 2.13's single-dim strategy places them: the index
    tensors replicated; `self` (and the result) keeps a Shard of a dim it is
    not indexed on, `values` sharded on the matching dim (replicated where
    it broadcasts); anything else replicated. An in-place write into a
    tensor sharded on an indexed dim cannot keep its placement: refused."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._op_schema import TupleStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    self_strategy, indices, values = op_schema.args_schema[:3]
    mesh = self_strategy.mesh
    self_spec = self_strategy.strategies[0].output_spec
    self_shape = tuple(self_spec.tensor_meta.shape)
    values_spec = (
        values.strategies[0].output_spec
        if isinstance(values, OpStrategy)
        else None
    )
    values_shape = (
        tuple(values_spec.tensor_meta.shape) if values_spec is not None else ()
    )
    # DTensor wraps a list of index specs as a TupleStrategy, but leaves a
    # list whose first entry is None (`x[:, i]`) a list of specs.
    entries = (
        indices.children
        if isinstance(indices, TupleStrategy)
        else list(indices)
    )
    index_strategies = []
    indexed = []  # the dims of self the index tensors index
    index_ndims = []  # the dims each index tensor adds to the result
    known = True  # whether every index is understood (else: replicate all)
    dim = 0
    for entry in entries:
        if entry is None:
            dim += 1
            continue
        if isinstance(entry, DTensorSpec):
            entry = OpStrategy([OpSpec(entry)])
        index_strategies.append(entry)
        meta = entry.strategies[0].output_spec.tensor_meta
        if meta.dtype in (torch.bool, torch.uint8):
            # A mask indexes as many dims as it has, and adds one (its
            # true entries) to the result.
            known = known and len(meta.shape) > 0
            indexed.extend(range(dim, dim + len(meta.shape)))
            dim += len(meta.shape)
            index_ndims.append(1)
        else:
            indexed.append(dim)
            dim += 1
            index_ndims.append(len(meta.shape))
    non_indexed = [d for d in range(len(self_shape)) if d not in indexed]
    broadcast_ndim = max(index_ndims, default=0)
    contiguous = not indexed or indexed[-1] - indexed[0] + 1 == len(indexed)

    def values_dim(self_dim):
        """The dim of `values` written along `self_dim` (not indexed), or
        None where values broadcast along it."""
        if contiguous and indexed:
            dim = (
                self_dim
                if self_dim < indexed[0]
                else self_dim - len(indexed) + broadcast_ndim
            )
        else:  # the indexed dims go first
            dim = broadcast_ndim + non_indexed.index(self_dim)
        dim -= broadcast_ndim + len(non_indexed) - len(values_shape)
        return dim if dim >= 0 and values_shape[dim] != 1 else None

    kept_self, kept_values = [], []
    for placement in self_spec.placements:
        if (
            isinstance(placement, Shard)
            and placement.dim in non_indexed
            and known
        ):
            dim = values_dim(placement.dim)
            kept_self.append(placement)
            kept_values.append(Replicate() if dim is None else Shard(dim))
        else:
            kept_self.append(Replicate())
            kept_values.append(Replicate())
    replicated = [Replicate()] * mesh.ndim
    candidates = [(kept_self, kept_values)]
    if kept_self != replicated or kept_values != replicated:
        candidates.append((replicated, replicated))
    if op_schema.is_inplace_op():
        candidates = [
            c for c in candidates if tuple(c[0]) == tuple(self_spec.placements)
        ]
        if not candidates:
            raise RuntimeError(
                f"{op_schema.op}: writes in place into a tensor placed "
                f"{tuple(self_spec.placements)}, sharded on a dim it indexes "
                f"(indexed dims {indexed}); an in-place write cannot change "
                "its placement. Replicate the tensor first, or use the "
                "out-of-place `index_put`."
            )

    strategy = OpStrategy([])
    for self_placements, values_placements in candidates:
        out = DTensorSpec(
            mesh, tuple(self_placements), tensor_meta=self_spec.tensor_meta
        )
        input_specs = [out]
        costs = [generate_redistribute_costs(self_strategy, out)]
        for index in index_strategies:
            spec = DTensorSpec(
                mesh,
                tuple(replicated),
                tensor_meta=index.strategies[0].output_spec.tensor_meta,
            )
            input_specs.append(spec)
            costs.append(generate_redistribute_costs(index, spec))
        if values_spec is not None:
            spec = DTensorSpec(
                mesh,
                tuple(values_placements),
                tensor_meta=values_spec.tensor_meta,
            )
            input_specs.append(spec)
            costs.append(generate_redistribute_costs(values, spec))
        strategy.strategies.append(
            OpSpec(
                output_specs=out,
                input_specs=input_specs,
                redistribute_cost=costs,
            )
        )
    return strategy


def stack_dim_made_non_negative(strategy):
    """torch's `stack` strategy, given a negative dim made non-negative
    against the result's rank (see the module docstring)."""

    def stack_strategy(op_schema):
        tensors, *rest = op_schema.args_schema
        dim = rest[0] if rest else op_schema.kwargs_schema.get("dim", 0)
        if isinstance(dim, int) and dim < 0:
            dim += tensors.children[0].ndim + 1
            if rest:
                args, kwargs = (
                    (tensors, dim, *rest[1:]),
                    op_schema.kwargs_schema,
                )
            else:
                args, kwargs = (
                    (tensors,),
                    {**op_schema.kwargs_schema, "dim": dim},
                )
            op_schema = dataclasses.replace(
                op_schema, args_schema=args, kwargs_schema=kwargs
            )
        return strategy(op_schema)

    return stack_strategy


def squeeze_strategy(op_schema):
    """`squeeze`, `squeeze.dim`, `squeeze.dims`: drops the given dims (all,
    without any) of global size 1; the result keeps the input's placements,
    renumbered. The local op drops the local block's dims of size 1 among
    them, so a dim among them sharded where a process's block could have
    one entry is gathered first (replicated on those mesh axes)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    input_strategy, *rest = op_schema.args_schema
    spec = input_strategy.strategies[0].output_spec
    shape = tuple(spec.tensor_meta.shape)
    ndim = len(shape)
    if not rest:
        dims = set(range(ndim))
    else:
        given = rest[0] if isinstance(rest[0], (list, tuple)) else [rest[0]]
        dims = {d % ndim for d in given} if ndim else set()
    removed = sorted(d for d in dims if shape[d] == 1)
    mesh_sizes = spec.mesh.shape

    def could_be_one(dim):
        """Whether a process's block of `dim`, sharded as `spec` says, can
        have at most one entry (torch's chunks: the last ones shorter)."""
        parts = 1
        for p, size in zip(spec.placements, mesh_sizes):
            if p.is_shard() and getattr(p, "dim", None) == dim:
                parts *= size
        chunk = -(-shape[dim] // parts)
        return any(
            min(chunk, shape[dim] - i * chunk) <= 1 for i in range(parts)
        )

    inputs, outputs = [], []
    for p in spec.placements:
        dim = getattr(p, "dim", None) if p.is_shard() else None
        if dim is not None and (
            not isinstance(p, Shard)
            or dim in removed
            or (dim in dims and could_be_one(dim))
        ):
            p = Replicate()
            dim = None
        inputs.append(p)
        outputs.append(
            p if dim is None else Shard(dim - sum(r < dim for r in removed))
        )
    input_spec = DTensorSpec(
        spec.mesh, tuple(inputs), tensor_meta=spec.tensor_meta
    )
    return OpStrategy(
        [
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, tuple(outputs)),
                input_specs=(input_spec,),
                redistribute_cost=[
                    generate_redistribute_costs(input_strategy, input_spec)
                ],
            )
        ]
    )


SQUEEZE_OPS = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


INDEX_PUT_OPS = (
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
)
