"""One flat all-gather, and one flat reduce-scatter, for a group of shards.

FSDP2's copy-in / copy-out: each rank copies its shards of a group's
tensors into one flat buffer (every shard padded on its sharded dim to
ceil(size / ranks), as `torch.chunk` and DTensor's `Shard` cut it), one
`all_gather_single` makes every rank's buffer whole, and each tensor
is copied out of the pieces of all ranks. For gradients the other way: the
whole gradients are copied into one flat buffer in rank-major order
(padded alike), one reduce-scatter sums it, and each rank's
shards are views of its piece. Every rank of the group must pass tensors
of the same shapes in the same order, which the padding guarantees for
uneven dims.

On CUDA the gather's copy-in and collective run on a stream of their own,
so that a prefetched gather overlaps the compute of the current stream;
`FlatGather.take` makes the current stream wait for it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collections.abc import Sequence

# torch 2.13 renamed the flat collectives (the old names warn FutureWarning
# there); torch 2.11 and 2.12 have only the old names.
_all_gather_single = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


@dataclass(frozen=True)
class Piece:
    """One tensor's place in a group's flat buffers."""

    dim: int  # the dim sharded over the ranks
    full_size: int  # that dim's size once gathered
    chunk: int  # each rank's padded size on `dim`: ceil(full_size / ranks)
    padded_shape: tuple[int, ...]  # one rank's padded shard
    offset: int  # start in each rank's flat segment
    numel: int  # elements of `padded_shape`

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (`padded_shape` with `full_size` on
        `dim`)."""
        shape = list(self.padded_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)

    def rows_of(self, rank: int) -> int:
        """How many of `chunk` rows on `dim` rank `rank` really holds."""
        return max(0, min(self.chunk, self.full_size - rank * self.chunk))


class FlatLayout:
    """Where each of a group's tensors lies in its flat buffers.

    `shard_shapes` are the shapes of this rank's local shards, `dims` the
    dim each is sharded on and `full_sizes` that dim's size once gathered
    over `ranks`."""

    ranks: int  # the ranks of the group
    pieces: list[Piece]  # one per tensor, in order
    per_rank: int  # elements of one rank's flat segment
    any_padding: bool  # whether some piece is padded

    def __init__(
        self,
        shard_shapes: Sequence[Sequence[int]],
        dims: Sequence[int],
        full_sizes: Sequence[int],
        ranks: int,
    ) -> None:
        self.ranks = ranks
        self.pieces = []
        offset = 0
        for shape, dim, full in zip(shard_shapes, dims, full_sizes):
            chunk = max(1, math.ceil(full / ranks))
            padded_shape = (
                tuple(shape[:dim]) + (chunk,) + tuple(shape[dim + 1 :])
            )
            numel = math.prod(padded_shape)
            self.pieces.append(
                Piece(dim, full, chunk, padded_shape, offset, numel)
            )
            offset += numel
        self.per_rank = offset  # elements of one rank's flat segment
        self.any_padding = any(
            p.full_size != p.chunk * ranks for p in self.pieces
        )

    def copy_in(
        self, shards: Sequence[torch.Tensor], flat: torch.Tensor
    ) -> None:
        """This rank's `shards` into its segment `flat` (padding left as
        `flat` holds it: zeros when it was made with zeros). Where every
        shard fills its piece (no padding on this rank), one `torch.cat`
        into `flat` (casting, as `copy_` does), as FSDP2's copy-in: one
        kernel for the group instead of one per shard."""
        if all(
            tuple(shard.shape) == piece.padded_shape
            for piece, shard in zip(self.pieces, shards)
        ):
            torch.cat([shard.reshape(-1) for shard in shards], out=flat)
            return
        for piece, shard in zip(self.pieces, shards):
            target = flat[piece.offset : piece.offset + piece.numel].view(
                piece.padded_shape
            )
            target.narrow(piece.dim, 0, shard.shape[piece.dim]).copy_(shard)

    def copy_out(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """The whole tensors (contiguous) from the `ranks * per_rank`
        elements of an all-gather. A tensor sharded on dim 0 without
        padding is a view of `gathered`; the others are copied into one
        buffer made for them all (one allocation per group: under glibc,
        blocks above its mmap threshold are returned to the system when
        freed, where tensors of a few MiB each would stay in the heap and
        be split by the activations allocated after them)."""
        rows = gathered.view(self.ranks, self.per_rank)
        copied = [p for p in self.pieces if not self.is_rank_major(p)]
        slab = torch.empty(
            sum(math.prod(p.gathered_shape) for p in copied),
            dtype=gathered.dtype,
            device=gathered.device,
        )
        outputs, start = [], 0
        for piece in self.pieces:
            pieces = rows[:, piece.offset : piece.offset + piece.numel].view(
                (self.ranks,) + piece.padded_shape
            )
            if self.is_rank_major(piece):
                outputs.append(pieces.reshape(piece.gathered_shape))
                continue
            size = math.prod(piece.gathered_shape)
            whole = slab[start : start + size].view(piece.gathered_shape)
            start += size
            if piece.full_size == piece.chunk * self.ranks:
                whole.unflatten(piece.dim, (self.ranks, piece.chunk)).copy_(
                    pieces.movedim(0, piece.dim)
                )
            else:
                for rank in range(self.ranks):
                    n = piece.rows_of(rank)
                    if n:
                        whole.narrow(piece.dim, rank * piece.chunk, n).copy_(
                            pieces[rank].narrow(piece.dim, 0, n)
                        )
            outputs.append(whole)
        return outputs

    def is_rank_major(self, piece: Piece) -> bool:
        """True when `piece`'s whole tensor is in rank-major order as it is
        (sharded on dim 0, no padding): gathered, a view of the all-gather's
        output; its gradient, the reduce-scatter's input as it is."""
        return piece.dim == 0 and piece.full_size == piece.chunk * self.ranks

    def scatter_input(
        self,
        grads: Sequence[torch.Tensor | None],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The `ranks * per_rank` input of the gradients' reduce-scatter: each
        whole gradient cut into the ranks' padded pieces, in rank-major
        order; a None gradient is zeros."""
        zeros = self.any_padding or any(g is None for g in grads)
        make = torch.zeros if zeros else torch.empty
        flat = make(self.ranks * self.per_rank, dtype=dtype, device=device)
        rows = flat.view(self.ranks, self.per_rank)
        for piece, grad in zip(self.pieces, grads):
            if grad is None:
                continue
            target = rows[:, piece.offset : piece.offset + piece.numel].view(
                (self.ranks,) + piece.padded_shape
            )
            if piece.full_size == piece.chunk * self.ranks:
                target.movedim(0, piece.dim).copy_(
                    grad.unflatten(piece.dim, (self.ranks, piece.chunk))
                )
                continue
            for rank in range(self.ranks):
                n = piece.rows_of(rank)
                if n:
                    target[rank].narrow(piece.dim, 0, n).copy_(
                        grad.narrow(piece.dim, rank * piece.chunk, n)
                    )
        return flat

    def shards_of(
        self, flat: torch.Tensor, shard_shapes: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Views of this rank's shards in its reduce-scattered segment."""
        return [
            flat[p.offset : p.offset + p.numel]
            .view(p.padded_shape)
            .narrow(p.dim, 0, shape[p.dim])
            for p, shape in zip(self.pieces, shard_shapes)
        ]


class FlatGather:
    """One asynchronous flat all-gather of a group's shards over `group`,
    in `dtype` (default: the shards'; the copy-in casts them); `take()`
    waits for it and returns the whole tensors. Collective: start it on
    every rank, in the same order."""

    def __init__(
        self,
        layout: FlatLayout,
        shards: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.layout = layout
        first = shards[0]
        dtype, device = dtype or first.dtype, first.device
        self.dtype = dtype
        self.stream = streams.for_device(device)
        with _on_stream(self.stream):
            make = torch.zeros if layout.any_padding else torch.empty
            self.input = make(layout.per_rank, dtype=dtype, device=device)
            layout.copy_in(shards, self.input)
            self.output = torch.empty(
                layout.ranks * layout.per_rank, dtype=dtype, device=device
            )
            self.work = _all_gather_single(
                self.output, self.input, group=group, async_op=True
            )
        # The collective's work keeps its input alive until it completes.
        self.input = None

    def wait(self) -> None:
        """Complete the collective (the current stream waits for it)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.stream is not None:
                current = torch.cuda.current_stream(self.output.device)
                current.wait_stream(self.stream)
                self.output.record_stream(current)

    def take(self) -> list[torch.Tensor]:
        """The whole tensors; the flat buffers are let go."""
        self.wait()
        outputs = self.layout.copy_out(self.output)
        self.output = None
        return outputs


def reduce_scatter(
    layout: FlatLayout,
    grads: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
    shard_shapes: Sequence[Sequence[int]],
    uniform: bool = True,
) -> list[torch.Tensor]:
    """This rank's shards of the sum over `group` of every rank's `grads`
    (whole gradients in `layout`'s order; None: zeros), each rank's first
    multiplied by `scale`, in one flat reduce-scatter. Collective: call on
    every rank.

    One gradient sharded on dim 0 without padding is already in rank-major
    order: where every rank's `scale` is the same (`uniform`), it is the
    collective's input as it is (no copy of a whole gradient: 250 MiB for a
    32000-word output projection of width 2048), and the sum is scaled
    instead (the same for 1 / replicas of a power of two; otherwise it may
    differ in the last bit). Ranks whose scales differ (the rows of a last,
    uneven batch) scale their own gradient before the sum."""
    if uniform and _in_rank_order(layout, grads, dtype):
        out = torch.empty(layout.per_rank, dtype=dtype, device=device)
        _reduce_scatter(out, grads[0].reshape(-1), group, layout.ranks)
        if scale != 1.0:
            out.mul_(scale)
        return layout.shards_of(out, shard_shapes)
    return reduce_scatter_flat(
        layout,
        layout.scatter_input(grads, dtype, device),
        group,
        scale,
        shard_shapes,
    )


def reduce_scatter_flat(
    layout: FlatLayout,
    flat: torch.Tensor,
    group: dist.ProcessGroup,
    scale: float,
    shard_shapes: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """This rank's shards of the sum over `group` of every rank's `flat`
    (the `ranks * per_rank` rank-major input, scaled here in place by
    `scale`). Collective: call on every rank."""
    if scale != 1.0:
        flat.mul_(scale)
    out = torch.empty(layout.per_rank, dtype=flat.dtype, device=flat.device)
    _reduce_scatter(out, flat, group, layout.ranks)
    return layout.shards_of(out, shard_shapes)


def _reduce_scatter(out, flat, group, ranks):
    """`dist.reduce_scatter_single(out, flat)` (on torch 2.13 and 2.15 the
    name of `reduce_scatter_tensor`, which warns there that it is
    deprecated; `all_gather_single` likewise). On gloo, as the list
    reduce-scatter of `flat`'s rank pieces (views): gloo's tensor
    reduce-scatter copies its whole input first (measured, 2 CPU processes,
    a 134 MB input: 202 MB above the input at its peak and 210 ms, against
    72 MB and 140 ms for the list form; the same sums)."""
    if dist.get_backend(group) == "gloo":
        dist.reduce_scatter(
            out, list(flat.view(ranks, out.numel()).unbind(0)), group=group
        )
    else:
        _reduce_scatter_single(out, flat, group=group)


def _in_rank_order(layout, grads, dtype):
    """True when `grads` is one contiguous gradient whose memory is the
    reduce-scatter's rank-major input."""
    if len(layout.pieces) != 1 or not layout.is_rank_major(layout.pieces[0]):
        return False
    grad = grads[0]
    return grad is not None and grad.dtype == dtype and grad.is_contiguous()


class GatherStreams:
    """The side stream FSDP gathers run on, one per CUDA device, made on
    first use."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.by_device = {}  # CUDA device index -> torch.cuda.Stream

    def for_device(self, device: torch.device) -> torch.cuda.Stream | None:
        """The gather stream of `device`, ordered after the work queued on
        its current stream; None on CPU."""
        if device.type != "cuda":
            return None
        index = (
            device.index
            if device.index is not None
            else torch.cuda.current_device()
        )
        stream = self.by_device.get(index)
        if stream is None:
            stream = self.by_device[index] = torch.cuda.Stream(device=index)
        stream.wait_stream(torch.cuda.current_stream(index))
        return stream


streams = GatherStreams()


def _on_stream(stream):
    return (
        torch.cuda.stream(stream)
        if stream is not None
        else contextlib.nullcontext()
    )
