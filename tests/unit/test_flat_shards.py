"""flat_shards' copy-in / copy-out, checked by simulating the ranks: each
rank's flat segment is built from its `torch.chunk` shards, the segments
are concatenated (what all_gather_into_tensor returns) or summed (what
reduce_scatter_tensor reduces), with no process group."""

import pytest
import torch

from keras_torch_distribution._fsdp import flat_shards

# (whole shape, sharded dim): even and uneven dims, a rank holding nothing.
CASES = [
    ((8, 6), 0),
    ((5, 3), 0),
    ((4, 7), 1),
    ((2, 3, 5), 2),
    ((3,), 0),
    ((1, 4), 0),
]


@pytest.mark.parametrize("ranks", [2, 4])
def test_gather_and_reduce_scatter_round_trip(ranks):
    generator = torch.Generator().manual_seed(0)
    wholes = [torch.randn(shape, generator=generator) for shape, _ in CASES]
    dims = [dim for _, dim in CASES]
    shards = [
        [list(torch.chunk(w, ranks, dim=d)) for w, d in zip(wholes, dims)]
        for _ in range(1)
    ][0]

    def shard_of(tensor_index, rank):
        pieces = shards[tensor_index]
        if rank < len(pieces):
            return pieces[rank]
        shape = list(wholes[tensor_index].shape)
        shape[dims[tensor_index]] = 0
        return torch.empty(shape)

    layouts = []
    segments = []
    for rank in range(ranks):
        mine = [shard_of(i, rank) for i in range(len(CASES))]
        layout = flat_shards.FlatLayout(
            [tuple(s.shape) for s in mine],
            dims,
            [w.shape[d] for w, d in zip(wholes, dims)],
            ranks,
        )
        flat = torch.zeros(layout.per_rank)
        layout.copy_in(mine, flat)
        layouts.append(layout)
        segments.append(flat)
    # Every rank lays its segment out alike (the padding makes them equal).
    assert len({layout.per_rank for layout in layouts}) == 1
    gathered = torch.cat(segments)
    for out, whole in zip(layouts[0].copy_out(gathered), wholes):
        torch.testing.assert_close(out, whole, rtol=0, atol=0)
        assert out.is_contiguous()

    grads = [
        [torch.randn(w.shape, generator=generator) for w in wholes]
        for _ in range(ranks)
    ]
    inputs = [
        layouts[r].scatter_input(grads[r], torch.float32, "cpu")
        for r in range(ranks)
    ]
    total = torch.stack(inputs).sum(0)
    summed = [sum(g[i] for g in grads) for i in range(len(wholes))]
    per_rank = layouts[0].per_rank
    for rank in range(ranks):
        mine = [shard_of(i, rank) for i in range(len(CASES))]
        segment = total[rank * per_rank : (rank + 1) * per_rank]
        got = layouts[rank].shards_of(segment, [tuple(s.shape) for s in mine])
        for i, shard in enumerate(got):
            chunks = torch.chunk(summed[i], ranks, dim=dims[i])
            if rank < len(chunks):
                torch.testing.assert_close(shard, chunks[rank])
            else:
                assert shard.numel() == 0


def test_missing_gradients_are_zeros():
    layout = flat_shards.FlatLayout([(2, 3)], [0], [4], 2)
    flat = layout.scatter_input([None], torch.float32, "cpu")
    assert flat.shape == (12,) and not flat.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_in_without_padding_is_one_cat(monkeypatch, dtype):
    """Shards that fill their pieces go in with one `torch.cat` (casting to
    the buffer's dtype, as `copy_` does), the same bytes as shard by shard;
    a rank with a padded piece copies shard by shard."""
    generator = torch.Generator().manual_seed(1)
    # A non-contiguous shard among them (a transposed view).
    mine = [
        torch.randn(4, 6, generator=generator),
        torch.randn(3, 6, generator=generator).t(),
        torch.randn(5, generator=generator),
    ]
    layout = flat_shards.FlatLayout(
        [tuple(s.shape) for s in mine], [0, 1, 0], [8, 6, 10], 2
    )
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(
        torch, "cat", lambda *a, **k: cats.append(1) or real_cat(*a, **k)
    )
    flat = torch.zeros(layout.per_rank, dtype=dtype)
    layout.copy_in(mine, flat)
    assert cats == [1]
    want = real_cat([s.reshape(-1) for s in mine]).to(dtype)
    torch.testing.assert_close(flat, want, rtol=0, atol=0)

    padded = flat_shards.FlatLayout([(3, 6)], [0], [7], 2)  # 4 rows a piece
    flat = torch.zeros(padded.per_rank, dtype=dtype)
    padded.copy_in([mine[0][:3]], flat)
    assert cats == [1]
    torch.testing.assert_close(
        flat[:18], mine[0][:3].reshape(-1).to(dtype), rtol=0, atol=0
    )
    assert not flat[18:].any()
