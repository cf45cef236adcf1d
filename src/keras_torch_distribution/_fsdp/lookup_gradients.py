"""An embedding lookup whose gradient is made in the reduce-scatter's order.

FSDP reduce-scatters a gradient from a flat buffer in rank-major order
(`flat_shards`). A weight sharded on its second dim (keras_hub's maps shard
token embeddings on the hidden dim) has a gradient whose rank-major order
is a transpose of its own: autograd's `embedding` backward makes the dense
(vocabulary, hidden) gradient, and the reduce-scatter copies it into the
transposed buffer: two tensors of the whole matrix alive at once (250 MiB
each for a 32000 x 2048 float32 embedding).

Inside the call of a group that holds such a weight, `lookups(table)`
catches `torch.nn.functional.embedding` (Keras' `ops.take(x, ids, axis=0)`
of a 2-D `x`) of that weight's gathered value and runs `_RankMajorLookup`
instead: the same forward, and a backward that adds the output's gradient
rows straight into the reduce-scatter's buffer (`index_add_`, as autograd's
own embedding backward does) and reduce-scatters it to the weight's shard.
The dense gradient is never made. Any other use of the gathered value keeps
its own gradient path (`groups._GroupGather`); autograd sums both.
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from keras_torch_distribution._fsdp import flat_shards


def eligible(layout, shapes):
    """True when a bucket of `layout` (its whole shapes `shapes`) is one 2-D
    weight sharded on dim 1 without padding: a lookup of it gains from
    `_RankMajorLookup`."""
    if len(layout.pieces) != 1 or layout.any_padding:
        return False
    return layout.pieces[0].dim == 1 and len(shapes[0]) == 2


class Lookup:
    """What a lookup of one gathered weight needs for its gradient."""

    def __init__(self, bucket, shard, factor):
        self.bucket = bucket  # groups._Bucket: layout, group, dtype
        self.shard = shard  # this rank's local shard (autograd leads to it)
        self.factor = factor  # this rank's gradient scale before the sum


class _RankMajorLookup(torch.autograd.Function):
    """`F.embedding(ids, weight)`; backward: the gradient of `shard`,
    reduce-scattered from rank-major rows filled by `index_add_`."""

    @staticmethod
    def forward(ctx, ids, weight, shard, lookup):
        ctx.save_for_backward(ids)
        ctx.lookup = lookup
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        bucket = ctx.lookup.bucket
        layout = bucket.layout
        piece = layout.pieces[0]
        flat = torch.zeros(
            layout.ranks * layout.per_rank,
            dtype=bucket.dtype,
            device=bucket.device,
        )
        # (vocabulary, ranks, chunk): row v of rank r's piece at [v, r].
        rows = flat.view((layout.ranks,) + piece.padded_shape).movedim(0, 1)
        source = grad.reshape(-1, grad.shape[-1]).to(bucket.dtype)
        rows.index_add_(
            0, ids.reshape(-1), source.unflatten(1, (layout.ranks, piece.chunk))
        )
        (shard_grad,) = flat_shards.reduce_scatter_flat(
            layout, flat, bucket.group, ctx.lookup.factor, bucket.shard_shapes
        )
        return None, None, shard_grad, None


class _LookupMode(TorchFunctionMode):
    """Runs `_RankMajorLookup` for an embedding of a registered weight."""

    def __init__(self, table):
        super().__init__()
        self.table = table  # id(gathered value) -> (that value, its Lookup)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) == 2 and torch.is_grad_enabled():
            value, lookup = self.table.get(id(args[1]), (None, None))
            if value is args[1] and _plain(kwargs):
                ids, weight = args
                return _RankMajorLookup.apply(
                    ids, weight.detach(), lookup.shard, lookup
                )
        return func(*args, **kwargs)


def _plain(kwargs):
    """True for an embedding without padding index, norm or frequency
    scaling (what Keras' `take` calls)."""
    return (
        kwargs.get("padding_idx") is None
        and kwargs.get("max_norm") is None
        and not kwargs.get("scale_grad_by_freq", False)
        and not kwargs.get("sparse", False)
    )


def lookups(table):
    """A context in which embeddings of the weights in `table` (id of a
    gathered value -> (that value, its Lookup), filled as the call gathers)
    make their gradients in rank-major order."""
    return _LookupMode(table)
