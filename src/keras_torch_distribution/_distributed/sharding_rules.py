"""DTensor sharding rules torch lacks or gets wrong, for the ops Keras
layers use with sharded weights. torch's own rules are used wherever it
has them; this module changes only what is missing or wrong:

- Convolution: torch's single-dim strategies (2.13 and later) are right
  and are used, weights sharded on channels included (gathered for the
  op). What is taken out is torch's convolution handler (a halo exchange
  for inputs sharded on their width, which no Keras layout produces): it
  bypasses sharding propagation with an older rule that labels the output
  of an output-channel-sharded kernel Replicate while it holds only the
  local channels. torch>=2.14's `convolution_backward` strategy is fixed
  for gradients nobody asked for (`_masked_gradients_left_out`). Where
  torch has no single-dim strategy for them (2.11, 2.12), the package
  supplies the same ones (`_convolution_rule`, `_convolution_backward_rule`:
  sharded on the batch, or replicated; a kernel sharded on channels is
  gathered for the op), since the older rule would be used otherwise.
- Index writes: `aten.index_put` / `index_put_` / `_index_put_impl_`
  (Keras' `scatter_update`, `x[index] = value`), where torch has no
  single-dim strategy for them (2.11, 2.12): torch's older rule keeps a
  tensor sharded on the dim it indexes (global indices written into local
  blocks: wrong rows, or an index out of bounds), and the in-place ops
  have none. `_index_put_strategy` keeps the sharding of dims that are
  not indexed, and replicates the rest, as 2.13's does.
- Stack: torch<2.13's `stack` strategy normalises a negative dim against
  the inputs' rank instead of the result's (one more), and so labels a
  result sharded on the wrong dim: `torch.stack` of 4-D tensors sharded on
  dim 2 at dim=-2 (keras_hub's rotary embedding of heads-sharded queries)
  came out labelled Shard(3), silently wrong. torch's own strategy is
  given the dim made non-negative (`_stack_dim_made_non_negative`; what
  torch>=2.13 does itself).
- Squeeze: torch<2.13 has no strategy for `squeeze.dims` (Keras'
  `squeeze(x, axes)`, BatchNormalization's moments), and its `squeeze`
  runs the local op on the local block, which drops a sharded dim whose
  block has one entry (2 over 2 processes) while the result claims it:
  `_squeeze_strategy` squeezes only dims of global size 1, and gathers a
  sharded dim the local op could drop, as torch 2.13 rewrites the op.
- Attention: `aten._scaled_dot_product_flash_attention_for_cpu` (CPU) and,
  where torch has no single-dim strategy for them (2.13), the CUDA
  `_scaled_dot_product_{flash,efficient,cudnn}_attention`, with their
  `_backward`s: attention sharded on heads (or batch) keeps that sharding,
  masks and biases included (torch has no CPU rule: DTensor derived one by
  tracing the op's decomposition, on every new shape, and under
  torch.compile's fake tensors for minutes; its 2.13 cuDNN rule leaves the
  bias out of the sharded strategies, `input_specs != strategies`).

Registered once with torch's public `register_sharding` by `install()`,
and taken out again by `uninstall()`, which puts back what torch had (its
own strategies and handlers).
"""

import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten


def _masked_gradients_left_out(strategy):
    """torch's single-dim strategy of `convolution_backward`, with the
    gradients `output_mask` does not ask for left out (None). torch>=2.14
    places grad_input and grad_bias whatever the mask says (grad_bias
    whenever `bias_sizes` is given: autograd passes [0] for a convolution
    without bias), while the all-Replicate strategy it adds leaves them
    out; on a 2-D mesh the two meet and propagation fails ("strategy
    position 0 mixes None with placements across mesh dims")."""

    def strategy_without_masked_gradients(op, args_schema, kwargs_schema):
        strategies = strategy(op, args_schema, kwargs_schema)
        mask = (
            args_schema[10]
            if len(args_schema) > 10
            else kwargs_schema.get("output_mask")
        )
        if mask is None or all(mask):
            return strategies
        return [
            [
                None if i < len(mask) and not mask[i] else p
                for i, p in enumerate(s)
            ]
            for s in strategies
        ]

    return strategy_without_masked_gradients


# ---------------------------------------------------------------------------
# Attention. Every tensor an attention op takes or returns has a role:
#   HEADS  (batch, heads, ...): query, key, value, out, logsumexp, gradients;
#   MASK   a mask or additive bias broadcast to (batch, heads, q_len, k_len);
#   BOOK   bookkeeping (seeds, offsets, cumulative lengths, empty debug
#          tensors): replicated.
# Each op may run replicated, sharded on the batch (dim 0) or sharded on the
# heads (dim 1), which Keras' attention layers with heads-sharded kernels
# produce. A mask follows on the dim it spans and stays replicated on a dim
# it broadcasts over.
# ---------------------------------------------------------------------------

HEADS, MASK, BOOK = "heads", "mask", "book"

_ARGUMENT_ROLES = {
    "query": HEADS,
    "key": HEADS,
    "value": HEADS,
    "grad_out": HEADS,
    "grad_out_": HEADS,
    "out": HEADS,
    "logsumexp": HEADS,
    "attn_mask": MASK,
    "attn_bias": MASK,
    "cum_seq_q": BOOK,
    "cum_seq_k": BOOK,
    "philox_seed": BOOK,
    "philox_offset": BOOK,
    "rng_state": BOOK,
    "unused": BOOK,
}


def _logsumexp(args):
    # Empty (and so replicated) unless asked for.
    return HEADS if args.get("compute_log_sumexp", True) else BOOK


# Roles of each op's results, in schema order (None: not a tensor, or a
# tensor DTensor hands back as it is, as torch's own rules do), from the
# op's arguments by name. The CUDA ops cannot run on CPU; their roles follow
# their schemas (see `torch.ops.aten.<op>.default._schema`).
_ATTENTION_RESULTS = {
    "_scaled_dot_product_flash_attention_for_cpu": lambda a: [HEADS, HEADS],
    "_scaled_dot_product_flash_attention_for_cpu_backward": lambda a: (
        [HEADS] * 3
    ),
    # output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state,
    # unused, debug_attn_mask
    "_scaled_dot_product_flash_attention": lambda a: [
        HEADS,
        HEADS,
        None,
        None,
        None,
        None,
        BOOK,
        None,
        HEADS if a["return_debug_mask"] else BOOK,
    ],
    "_scaled_dot_product_flash_attention_backward": lambda a: [HEADS] * 3,
    # output, log_sumexp, philox_seed, philox_offset
    "_scaled_dot_product_efficient_attention": lambda a: [
        HEADS,
        _logsumexp(a),
        None,
        None,
    ],
    # grad query, key, value, attn_bias
    "_scaled_dot_product_efficient_attention_backward": lambda a: [
        HEADS,
        HEADS,
        HEADS,
        MASK if a["attn_bias"] is not None else None,
    ],
    # output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
    # philox_offset, debug_attn_mask
    "_scaled_dot_product_cudnn_attention": lambda a: [
        HEADS,
        _logsumexp(a),
        None,
        None,
        None,
        None,
        None,
        None,
        HEADS if a["return_debug_mask"] else None,
    ],
    "_scaled_dot_product_cudnn_attention_backward": lambda a: [HEADS] * 3,
}


def _shape(spec):
    return tuple(spec.tensor_meta.shape)


def _mask_placement(mask, query, dim):
    """Where a mask goes when HEADS tensors are sharded on `dim`: sharded on
    the mask dim that spans `dim` (masks broadcast from the right to 4
    dims), replicated where it broadcasts."""
    shape = _shape(mask)
    mask_dim = len(shape) - 4 + dim
    if (
        mask_dim < 0
        or shape[mask_dim] == 1
        or shape[mask_dim] != _shape(query)[dim]
    ):
        return Replicate()
    return Shard(mask_dim)


def _fixed_mask_placement(mask, op):
    """The placement a kwarg mask must keep, or None when any will do.

    DTensor reshards positional arguments to the strategy it picks but
    leaves kwargs as they are (`redistribute_local_args`), so a strategy
    that needs a kwarg-only `attn_mask` placed otherwise would compute on
    the wrong block of it.
    """
    placements = {
        p for p, size in zip(mask.placements, mask.mesh.shape) if size > 1
    }
    if len(placements) > 1:
        raise ValueError(
            f"{op}: the attention mask is placed {tuple(mask.placements)} on "
            f"mesh axes of sizes {tuple(mask.mesh.shape)}; DTensor cannot "
            "reshard a kwarg, and this rule handles a mask placed the same "
            "way on every mesh axis it spans. Replicate the mask (build it "
            "from plain tensors)."
        )
    return next(iter(placements), None)


def _attention_rule(op):
    schema = op._schema
    names = [argument.name for argument in schema.arguments]
    kwarg_only = {
        argument.name for argument in schema.arguments if argument.kwarg_only
    }
    defaults = {
        argument.name: argument.default_value
        if argument.has_default_value()
        else None
        for argument in schema.arguments
    }
    results = _ATTENTION_RESULTS[schema.name.split("::")[-1]]

    def rule(*args, **kwargs):
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        # DTensor passes tensors to rules as specs carrying a tensor_meta.
        tensors = {n for n in names if hasattr(bound[n], "tensor_meta")}
        query = bound["query"]
        mask_name = next(
            (n for n in ("attn_mask", "attn_bias") if n in tensors), None
        )
        mask = bound[mask_name] if mask_name else None
        fixed = (
            _fixed_mask_placement(mask, op) if mask_name in kwarg_only else None
        )
        # A tensor argument of a role not listed (a newer torch's): only the
        # replicated strategy is known to be right.
        known = all(n in _ARGUMENT_ROLES for n in tensors)
        options = []
        for dim in (None, 0, 1) if known else (None,):

            def place(role):
                if role is None:
                    return None
                if dim is None or role == BOOK:
                    return Replicate()
                if role == MASK:
                    return _mask_placement(mask, query, dim)
                return Shard(dim)

            if fixed is not None and place(MASK) != fixed:
                continue
            outputs = [place(role) for role in results(bound)]
            inputs = [
                place(_ARGUMENT_ROLES.get(n)) if n in tensors else None
                for n in names
            ]
            options.append((outputs, inputs))
        return options

    return rule


def _cache_by_kwarg_tensors(op):
    """Make DTensor's sharding cache tell apart calls whose tensor kwargs
    (`attn_mask`) differ in shape or placement: it keys on positional
    tensors and on the kwargs its schema info lists, and `register_sharding`
    lists only int kwargs, so a rule's answer for one mask would be reused
    for another."""
    tensor_kwargs = [
        a.name
        for a in op._schema.arguments
        if a.kwarg_only and "Tensor" in str(a.type)
    ]
    if not tensor_kwargs:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    info = propagator.op_to_schema_info[op]
    propagator.op_to_schema_info[op] = type(info)(
        info.static_argnum,
        list(info.static_kwargkey or []) + tensor_kwargs,
        info.needs_pytree,
    )


def _attention_ops():
    return [getattr(aten, name).default for name in _ATTENTION_RESULTS]


# ---------------------------------------------------------------------------
# What torch's DTensor lacks or gets wrong before 2.13 (2.11, 2.12), chosen
# in `register` by what torch has: convolution and index writes where it
# has no single-dim strategy for them, squeezes where its propagator does
# not rewrite them; stack's dim is made non-negative wherever stack has a
# whole-op strategy (a no-op where torch normalises it right).
# ---------------------------------------------------------------------------


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
_CONVOLUTION_RULES = {
    aten.convolution.default: (_convolution_rule, 3),
    aten.convolution_backward.default: (_convolution_backward_rule, 3),
}


def _index_put_strategy(op_schema):
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


def _stack_dim_made_non_negative(strategy):
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


def _squeeze_strategy(op_schema):
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


_SQUEEZE_OPS = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


_INDEX_PUT_OPS = (
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
)


def _register_strategy(propagator, op, strategy, schema_info):
    """Put `strategy` in DTensor's table for `op`, keeping torch's own
    strategy and schema info (if any) for `unregister`."""
    registration.strategies[op] = propagator.op_strategy_funcs.get(op)
    registration.schema_infos[op] = propagator.op_to_schema_info.get(op)
    propagator.register_op_strategy(op, strategy, schema_info)


def _views_refuse_later_sharded_dims():
    """Whether torch's DTensor view rule refuses to flatten dims of which a
    later one is sharded ("Attempted to flatten multiple dimensions, with
    dimension 1 being sharded": torch<2.13; 2.13 gives a `_StridedShard`),
    by asking it (no process group)."""
    from torch.distributed.tensor._ops import _view_ops

    propagate = getattr(_view_ops, "propagate_shape_and_sharding", None)
    groups = getattr(_view_ops, "view_groups", None)
    if propagate is None or groups is None:
        # A torch without them propagates views its own, newer way.
        return False
    try:
        propagate(
            [Shard(1)], (2, 2), groups([2, 2], [4]), (2,), strict_view=True
        )
    except RuntimeError:
        return True
    return False


# Read by `einsum_grad` and `tensors`, which work around it.
VIEWS_REFUSE_LATER_SHARDED_DIMS = _views_refuse_later_sharded_dims()


class Registration:
    """What `register` replaced in DTensor's dispatcher, to put it back."""

    def __init__(self):
        self.active = False
        self.strategies = {}  # op -> torch's strategy function, or None
        self.schema_infos = {}  # op -> torch's RuntimeSchemaInfo, or None
        self.single_dim = {}  # op -> torch's single-dim strategy
        self.handlers = {}  # op -> torch's custom op handler, or None

    def clear(self):
        unregister()


registration = Registration()


def _dispatcher_tables():
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", None)
    propagator = DTensor._op_dispatcher.sharding_propagator
    if handlers is None or not hasattr(
        propagator, "op_single_dim_strategy_funcs"
    ):
        raise RuntimeError(
            f"torch {torch.__version__}: DTensor's op dispatcher has no "
            "_custom_op_handlers or single-dim strategies; "
            "keras_torch_distribution supports torch>=2.11,<2.16 (tested on "
            "2.11.0, 2.13.0 and 2.15.0). Install torch==2.15.0."
        )
    return propagator, handlers


def register():
    """Register the rules with DTensor (once per process until `unregister`)."""
    if registration.active:
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator, handlers = _dispatcher_tables()
    single_dim = propagator.op_single_dim_strategy_funcs
    for op, (rule, static_argnum) in _CONVOLUTION_RULES.items():
        registration.handlers[op] = handlers.pop(op, None)
        if op in single_dim:
            continue
        # torch<2.13: its older rule would be used, which labels a conv's
        # output with its input's placements whatever the kernel's.
        registration.strategies[op] = propagator.op_strategy_funcs.get(op)
        registration.schema_infos[op] = propagator.op_to_schema_info.get(op)
        register_sharding(op)(rule)
        propagator.op_to_schema_info[op] = RuntimeSchemaInfo(
            static_argnum, needs_pytree=True
        )
    backward = aten.convolution_backward.default
    if backward in single_dim:
        torch_own = single_dim[
            backward
        ]  # a record of the function and its options
        registration.single_dim[backward] = torch_own
        single_dim[backward] = dataclasses.replace(
            torch_own, func=_masked_gradients_left_out(torch_own.func)
        )
    stack = aten.stack.default
    if stack not in single_dim and stack in propagator.op_strategy_funcs:
        torch_own = propagator.op_strategy_funcs[stack]
        registration.strategies[stack] = torch_own
        propagator.op_strategy_funcs[stack] = _stack_dim_made_non_negative(
            torch_own
        )
    if not hasattr(propagator, "squeeze_op_to_dims_variant"):
        # torch<2.13: no rewrite of squeezes to dims of global size 1.
        for op in _SQUEEZE_OPS:
            if op not in single_dim:
                _register_strategy(
                    propagator, op, _squeeze_strategy, RuntimeSchemaInfo(1)
                )
    for op in _INDEX_PUT_OPS:
        if op not in single_dim:
            _register_strategy(
                propagator,
                op,
                _index_put_strategy,
                RuntimeSchemaInfo(3, needs_pytree=True),
            )
    for op in _attention_ops():
        if op in single_dim:  # torch's own takes precedence over any rule
            continue
        registration.strategies[op] = propagator.op_strategy_funcs.get(op)
        registration.schema_infos[op] = propagator.op_to_schema_info.get(op)
        register_sharding(op)(_attention_rule(op))
        _cache_by_kwarg_tensors(op)
    propagator.propagate_op_sharding.cache_clear()
    registration.active = True


def unregister():
    """Put back DTensor's own strategies and handlers for the ops `register`
    covered, and forget the sharding decisions cached with ours."""
    if not registration.active:
        return
    propagator, handlers = _dispatcher_tables()
    for table, saved in (
        (propagator.op_strategy_funcs, registration.strategies),
        (propagator.op_to_schema_info, registration.schema_infos),
        (propagator.op_single_dim_strategy_funcs, registration.single_dim),
        (handlers, registration.handlers),
    ):
        for op, previous in saved.items():
            if previous is None:
                table.pop(op, None)
            else:
                table[op] = previous
        saved.clear()
    propagator.propagate_op_sharding.cache_clear()
    registration.active = False
