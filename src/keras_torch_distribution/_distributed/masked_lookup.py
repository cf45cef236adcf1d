"""A vocabulary-sharded lookup's other rows zeroed without a host sync.

When an embedding table is sharded on its vocabulary (keras_hub's layout
maps shard `token_embedding` so), torch's DTensor looks each token up on
every rank and zeroes the rows of tokens another rank holds before the
partial sums are added (`MaskPartial`). It zeroes them with
`tensor[mask] = 0.0`: an `index_put_` with a boolean index, which on a GPU
turns the mask into indices with `nonzero()`, a host sync on every
forward. `masked_fill_` of the same mask (broadcast over the embedding
dim for a lookup) writes the same zeros, in place as torch does, without
one.
"""

from __future__ import annotations

try:  # torch's DTensor keeps it in a private module
    from torch.distributed.tensor._ops._mask_buffer import MaskBuffer
except ImportError:  # another torch: its own masking is left alone
    MaskBuffer = None


def apply_mask(original, buffer, tensor):
    """Replaces torch DTensor's `MaskBuffer.apply_mask`: the rows a rank
    does not hold zeroed with `masked_fill_` (no host sync), as torch's
    `tensor[mask] = 0.0` zeroes them."""
    if buffer.refcount == 0 or buffer.data is None:
        return original(buffer, tensor)  # torch's own error
    mask = buffer.data
    if tensor.ndim != mask.ndim:  # a lookup: the rows of (..., dim)
        mask = mask.unsqueeze(-1)
    tensor.masked_fill_(mask, 0.0)
