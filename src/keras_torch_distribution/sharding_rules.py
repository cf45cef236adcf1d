"""DTensor sharding rules that torch 2.13 lacks or gets wrong, for the ops
Keras layers use with sharded weights.

- `aten.convolution` / `aten.convolution_backward`: torch's rule ignores how
  the weight is sharded (the output of an output-channel-sharded kernel comes
  back labelled Replicate while holding only the local channels). These rules
  shard the output on channels for a kernel sharded on output channels, give
  a partial sum for one sharded on input channels, and shard on the batch.
- `aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`:
  no rule in torch; attention sharded on heads (or batch) keeps that
  sharding. Without the forward rule DTensor derived one by tracing the op's
  decomposition, on every new shape, and under torch.compile's fake tensors
  for minutes.

Registered once with torch's public `register_sharding`; they are correct
whatever Keras does, so `uninstall()` leaves them. For convolution this also
takes out torch's own convolution handler (a halo exchange for inputs sharded
on their width, which no Keras layout produces), which would otherwise
bypass sharding rules altogether.
"""

from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor.experimental import register_sharding

import torch
from torch.distributed.tensor import DTensor

aten = torch.ops.aten
_registered = []


def _conv_forward(input, weight, bias, stride, padding, dilation, transposed,
                  output_padding, groups):
    rest = [None] * 6
    with_bias = bias is not None
    options = [([Replicate()], [Replicate(), Replicate(), Replicate() if with_bias else None] + rest)]
    if groups == 1 and not transposed:
        # Output channels: dim 0 of the torch kernel (out, in, *spatial).
        options.append(
            ([Shard(1)], [Replicate(), Shard(0), Shard(0) if with_bias else None] + rest)
        )
        # Batch.
        options.append(
            ([Shard(0)], [Shard(0), Replicate(), Replicate() if with_bias else None] + rest)
        )
        if not with_bias:
            # Input channels: partial sums over the channel shards.
            options.append(([Partial()], [Shard(1), Shard(1), None] + rest))
    return options


def _conv_backward(grad_output, input, weight, bias_sizes, stride, padding,
                   dilation, transposed, output_padding, groups, output_mask):
    rest = [None] * 8
    options = [([Replicate()] * 3, [Replicate()] * 3 + rest)]
    if groups == 1 and not transposed:
        options.append(
            ([Partial(), Shard(0), Shard(0)], [Shard(1), Replicate(), Shard(0)] + rest)
        )
        options.append(
            ([Shard(0), Partial(), Partial()], [Shard(0), Shard(0), Replicate()] + rest)
        )
        options.append(
            ([Shard(1), Shard(1), Replicate()], [Replicate(), Shard(1), Shard(1)] + rest)
        )
    return options


def _attention_forward(query, key, value, dropout_p=0.0, is_causal=False,
                       attn_mask=None, scale=None):
    options = [([Replicate()] * 2, [Replicate()] * 3 + [None, None])]
    if attn_mask is None:
        for dim in (0, 1):  # batch, heads
            options.append(([Shard(dim)] * 2, [Shard(dim)] * 3 + [None, None]))
    return options


def _attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                        is_causal, attn_mask=None, scale=None):
    options = [([Replicate()] * 3, [Replicate()] * 6 + [None, None])]
    if attn_mask is None:
        for dim in (0, 1):  # batch, heads
            options.append(([Shard(dim)] * 3, [Shard(dim)] * 6 + [None, None]))
    return options


def register():
    """Register the rules with DTensor (once per process)."""
    if _registered:
        return
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", None)
    if handlers is None:
        raise RuntimeError(
            f"torch {torch.__version__}: DTensor's op dispatcher has no "
            "_custom_op_handlers; keras_torch_distribution supports "
            "torch>=2.6 as tested with 2.13. Install torch==2.13.0."
        )
    for op in (aten.convolution.default, aten.convolution_backward.default):
        handlers.pop(op, None)
    register_sharding(aten.convolution.default)(_conv_forward)
    register_sharding(aten.convolution_backward.default)(_conv_backward)
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)(
        _attention_forward
    )
    register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)(
        _attention_backward
    )
    _registered.append(True)
