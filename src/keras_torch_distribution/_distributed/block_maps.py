"""Which block of a tensor a block of its transpose or reshape needs.

A value read when used can carry the transposes and reshapes code applied
to it (keras_hub's converters of Hugging Face checkpoints transpose and
reshape each tensor before `assign`); to read only a block of the result,
the block is mapped back through them to a box of the stored tensor.

A box is a tuple of (start, stop) per dim. Through a transpose the map is
exact (the dims permuted). Through a reshape it is exact where the block's
elements are exactly a box of the input in the same order (a sharded
heads dim of a (hidden, heads, head_dim) kernel reshaped from
(hidden, heads * head_dim), say); otherwise the block is widened, dims
innermost first, to the smallest such box that holds it (a sharded
head_dim takes every head), and the block is cut out after the reshape.
"""

import math


def extents(box):
    return tuple(hi - lo for lo, hi in box)


def is_empty(box):
    return any(hi <= lo for lo, hi in box)


def full_box(shape):
    return tuple((0, n) for n in shape)


def transpose_box(box, axes):
    """The box of the input whose transpose by `axes` is `box` (exact)."""
    source = [None] * len(axes)
    for out_dim, in_dim in enumerate(axes):
        source[in_dim] = box[out_dim]
    return tuple(source)


def reshape_box(box, in_shape, out_shape):
    """(in_box, out_box): the box of the input (of `in_shape`) that a
    reshape to `out_shape` turns exactly into `out_box`, the smallest box
    holding `box` for which one exists (`box` itself where it can be).
    `box` must not be empty."""
    in_box, out_box = [], []
    for in_dims, out_dims in _groups(in_shape, out_shape):
        sizes_in = [in_shape[d] for d in in_dims]
        sizes_out = [out_shape[d] for d in out_dims]
        wanted = [box[d] for d in out_dims]
        for widened in _widenings(wanted, sizes_out):
            found = _same_elements(widened, sizes_out, sizes_in)
            if found is not None:
                in_box += found
                out_box += widened
                break
    return tuple(in_box), tuple(out_box)


def _groups(in_shape, out_shape):
    """Consecutive dims of the two shapes paired into groups of equal
    products (a reshape moves elements only within a group); dims of size
    1 may stand alone on either side."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        in_dims, out_dims = [], []
        product_in = product_out = 1
        if i < len(in_shape):
            in_dims.append(i)
            product_in = in_shape[i]
            i += 1
        if j < len(out_shape):
            out_dims.append(j)
            product_out = out_shape[j]
            j += 1
        while product_in != product_out:
            if product_in < product_out:
                in_dims.append(i)
                product_in *= in_shape[i]
                i += 1
            else:
                out_dims.append(j)
                product_out *= out_shape[j]
                j += 1
        groups.append((in_dims, out_dims))
    return groups


def _widenings(box, sizes):
    """`box`, then `box` with its last 1, 2, ... dims taken whole, up to
    the whole group."""
    yield list(box)
    for first_whole in range(len(box) - 1, -1, -1):
        widened = list(box[:first_whole]) + [
            (0, n) for n in sizes[first_whole:]
        ]
        if widened != list(box):
            yield widened


def _same_elements(box, sizes, other_sizes):
    """The box of a group's dims shaped `other_sizes` holding exactly the
    elements `box` holds in the dims shaped `sizes` (the same positions in
    row-major order), or None where no box does."""
    if not other_sizes:  # dims of size 1 only
        return []
    if not sizes:
        return [(0, 1)] * len(other_sizes)
    first = _flat(tuple(lo for lo, _ in box), sizes)
    last = _flat(tuple(hi - 1 for _, hi in box), sizes)
    lows = _unflat(first, other_sizes)
    highs = _unflat(last, other_sizes)
    if any(lo > hi for lo, hi in zip(lows, highs)):
        return None
    other = [(lo, hi + 1) for lo, hi in zip(lows, highs)]
    if _runs(other, other_sizes) != _runs(box, sizes):
        return None
    return other


def _flat(index, sizes):
    flat = 0
    for i, n in zip(index, sizes):
        flat = flat * n + i
    return flat


def _unflat(flat, sizes):
    index = []
    for n in reversed(sizes):
        index.append(flat % n)
        flat //= n
    return index[::-1]


def _runs(box, sizes):
    """A box in canonical form, which two shapings of the same elements
    share: adjacent dims merged wherever the inner one is whole or the
    outer one holds one index (both leave the box a box of the merged
    dim)."""
    merged = []
    for n, (lo, hi) in zip(sizes, box):
        if merged:
            size, low, high = merged[-1]
            if hi - lo == n:  # this dim whole
                merged[-1] = (size * n, low * n, high * n)
                continue
            if high - low == 1:  # the outer dim holds one index
                merged[-1] = (size * n, low * n + lo, low * n + hi)
                continue
        merged.append((n, lo, hi))
    return merged


def resolve_shape(shape, size):
    """numpy's reshape target: an int or a sequence, one dim may be -1."""
    if isinstance(shape, int) or not hasattr(shape, "__len__"):
        shape = (shape,)
    shape = [int(n) for n in shape]
    unknown = [i for i, n in enumerate(shape) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in shape):
        raise ValueError(f"cannot reshape an array to {tuple(shape)}")
    if unknown:
        known = math.prod(n for n in shape if n != -1)
        if known == 0 or size % known:
            raise ValueError(
                f"cannot reshape array of size {size} into shape {tuple(shape)}"
            )
        shape[unknown[0]] = size // known
    if math.prod(shape) != size:
        raise ValueError(
            f"cannot reshape array of size {size} into shape {tuple(shape)}"
        )
    return tuple(shape)


def resolve_axes(axes, ndim):
    """numpy's transpose axes: None reverses; negative dims count from the
    end; they must be a permutation."""
    if axes is None or (isinstance(axes, (tuple, list)) and not axes):
        if axes is not None and ndim:
            raise ValueError("axes don't match array")
        return tuple(range(ndim))[::-1]
    if isinstance(axes, int):
        axes = (axes,)
    axes = tuple(int(a) + ndim if int(a) < 0 else int(a) for a in axes)
    if sorted(axes) != list(range(ndim)):
        raise ValueError("axes don't match array")
    return axes
