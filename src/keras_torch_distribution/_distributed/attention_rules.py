"""Sharding rules of the attention ops, on the CPU and where torch has
no single-dim strategy for them (2.13), on CUDA.

Every tensor an attention op takes or returns has a role:
  HEADS  (batch, heads, ...): query, key, value, out, logsumexp, gradients;
  MASK   a mask or additive bias broadcast to (batch, heads, q_len, k_len);
  BOOK   bookkeeping (seeds, offsets, cumulative lengths, empty debug
         tensors): replicated.
Each op may run replicated, sharded on the batch (dim 0) or sharded on the
heads (dim 1), which Keras' attention layers with heads-sharded kernels
produce. A mask follows on the dim it spans and stays replicated on a dim
it broadcasts over.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

aten = torch.ops.aten


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


def attention_rule(op):
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


def cache_by_kwarg_tensors(op):
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


def attention_ops():
    return [getattr(aten, name).default for name in _ATTENTION_RESULTS]
