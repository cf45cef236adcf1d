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
  have none. `index_put_strategy` keeps the sharding of dims that are
  not indexed, and replicates the rest, as 2.13's does.
- Stack: torch<2.13's `stack` strategy normalises a negative dim against
  the inputs' rank instead of the result's (one more), and so labels a
  result sharded on the wrong dim: `torch.stack` of 4-D tensors sharded on
  dim 2 at dim=-2 (keras_hub's rotary embedding of heads-sharded queries)
  came out labelled Shard(3), silently wrong. torch's own strategy is
  given the dim made non-negative (`stack_dim_made_non_negative`; what
  torch>=2.13 does itself).
- Squeeze: torch<2.13 has no strategy for `squeeze.dims` (Keras'
  `squeeze(x, axes)`, BatchNormalization's moments), and its `squeeze`
  runs the local op on the local block, which drops a sharded dim whose
  block has one entry (2 over 2 processes) while the result claims it:
  `squeeze_strategy` squeezes only dims of global size 1, and gathers a
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

The rules: `attention_rules`, `older_torch_rules`; here, their
registration.
"""

import dataclasses

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

from keras_torch_distribution._distributed import attention_rules
from keras_torch_distribution._distributed import older_torch_rules

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

    def clear(self) -> None:
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


def register() -> None:
    """Register the rules with DTensor (once per process until `unregister`)."""
    if registration.active:
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator, handlers = _dispatcher_tables()
    single_dim = propagator.op_single_dim_strategy_funcs
    convolutions = older_torch_rules.CONVOLUTION_RULES
    for op, (rule, static_argnum) in convolutions.items():
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
        propagator.op_strategy_funcs[stack] = (
            older_torch_rules.stack_dim_made_non_negative(torch_own)
        )
    if not hasattr(propagator, "squeeze_op_to_dims_variant"):
        # torch<2.13: no rewrite of squeezes to dims of global size 1.
        for op in older_torch_rules.SQUEEZE_OPS:
            if op not in single_dim:
                _register_strategy(
                    propagator,
                    op,
                    older_torch_rules.squeeze_strategy,
                    RuntimeSchemaInfo(1),
                )
    for op in older_torch_rules.INDEX_PUT_OPS:
        if op not in single_dim:
            _register_strategy(
                propagator,
                op,
                older_torch_rules.index_put_strategy,
                RuntimeSchemaInfo(3, needs_pytree=True),
            )
    for op in attention_rules.attention_ops():
        if op in single_dim:  # torch's own takes precedence over any rule
            continue
        registration.strategies[op] = propagator.op_strategy_funcs.get(op)
        registration.schema_infos[op] = propagator.op_to_schema_info.get(op)
        register_sharding(op)(attention_rules.attention_rule(op))
        attention_rules.cache_by_kwarg_tensors(op)
    propagator.propagate_op_sharding.cache_clear()
    registration.active = True


def unregister() -> None:
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
