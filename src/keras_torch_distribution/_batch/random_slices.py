"""A replica's rows of the random numbers one process draws ("stream and
slice").

Each data-parallel replica computes on its rows of the global batch. A
random draw shaped like that batch (a dropout mask, GaussianNoise's
`keras.random.normal(ops.shape(x), seed=self.seed_generator)`) is the
replica's rows of the draw one process makes for the global batch, so the
numbers are those of one process, bit for bit (on the CPU). As JAX draws one
mask for one global array.

Which draws, replacing Keras' torch backend functions through the seam:
- `dropout`: unseeded (`Dropout()`: torch's global generator, drawn as
  `F.dropout` draws) and seeded (`Dropout(seed=...)`, a `noise_shape`);
  an activation sharded on model axes (a DTensor) gets its block: its
  replica's rows and its own columns.
- `normal`, `uniform`, `randint` (and `truncated_normal`, which draws
  through `normal`) with a `SeedGenerator` or no seed (Keras' global
  SeedGenerator); int seeds (initializers) are left alone.

Where the global batch comes from: `adapter.batch_rows()`, (global rows, first
row, rows) of the batch fit / evaluate / predict fed this replica. A draw is
sliced when its dim 0 is that many rows; any other draw (and every draw of a
direct model call, whose rows are the whole batch) is the one-process draw.

Streams: on the CPU a draw is made row-chunk by row-chunk (at most
`sharded_init.CHUNK_DRAWS` numbers at a time, chunks that leave the stream
unchanged) and only this replica's block is kept. A seeded draw uses a
fresh torch.Generator (Keras makes one per call), so a replica stops after
its rows; the unseeded draw goes on to the end of the global stream so that
torch's global generator ends where one process's does. On other devices the
global draw is made at once and this replica's block copied out of it (a
copy: a dropout mask is kept for backward, a view would keep the whole
draw). Draws run eagerly, outside
torch.compile (a torch.Generator cannot be traced, and compiled random ops
draw another stream).
"""

import math

import keras
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_torch_distribution import _keras
from keras_torch_distribution._batch import adapter
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._variables import sharded_init


def _batch_window(rows):
    """(global rows, first row) when a tensor of `rows` rows is this
    replica's part of a bigger global batch; None otherwise."""
    window = adapter.batch_rows()
    if window is None:
        return None
    global_rows, first, count = window
    if rows != count or global_rows == count:
        return None
    return global_rows, first


def _is_symbolic(tensor=None):
    device = str(_keras.torch_device())
    return device == "meta" or (
        tensor is not None and tensor.device.type == "meta"
    )


def draws_at_once(device):
    """True where a draw is made whole and sliced (CUDA and other
    accelerators: their streams cannot be cut into chunks), False on the
    CPU (drawn chunk by chunk)."""
    return device.type != "cpu"


def _rows_of(draw, shape, box, dtype, device, to_end):
    """Block `box` of `draw(shape, out)` (one process's draw of `shape`),
    drawn row-chunk by row-chunk on the CPU; `to_end` draws the whole
    stream (a shared generator must end where one process's would)."""
    shape = tuple(int(n) for n in shape)
    if draws_at_once(device):
        whole = draw(shape, torch.empty(shape, dtype=dtype, device=device))
        # A copy, not a view: a dropout mask is saved for backward, and a
        # view would keep the whole draw (replicas x this block) alive.
        return whole[layouts.box_slices(box)].clone(
            memory_format=torch.contiguous_format
        )
    (low, high), inner = box[0], (slice(None),) + layouts.box_slices(box[1:])
    per_row = math.prod(shape[1:])
    groups = sharded_init.row_groups(
        shape[0], per_row, sharded_init.CHUNK_DRAWS
    )
    if len(groups) == 1 and all(
        lo == 0 and hi == n for (lo, hi), n in zip(box, shape)
    ):
        return draw(shape, torch.empty(shape, dtype=dtype))
    block = torch.empty(tuple(hi - lo for lo, hi in box), dtype=dtype)
    largest = max(stop - start for start, stop in groups) * per_row
    buffer = torch.empty(largest, dtype=dtype)  # reused by every chunk
    for start, stop in groups:
        if start >= high and not to_end:
            break
        chunk_shape = (stop - start,) + shape[1:]
        chunk = draw(
            chunk_shape, buffer[: math.prod(chunk_shape)].view(chunk_shape)
        )
        lo, hi = max(start, low), min(stop, high)
        if lo < hi:
            block[lo - low : hi - low] = chunk[lo - start : hi - start][inner]
    return block


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------


def dropout(original, inputs, rate, noise_shape=None, seed=None):
    """Keras' torch `dropout`, with this replica's block of one process's
    mask (see the module docstring)."""
    if (
        rate in (0.0, 1.0)
        or not isinstance(inputs, torch.Tensor)
        or inputs.ndim == 0
        # Neither fed rows nor a sharded activation (one process, direct
        # calls): Keras' draw, and no graph break under torch.compile.
        or (adapter.batch_rows() is None and not isinstance(inputs, DTensor))
    ):
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    mask = _dropout_mask(inputs, rate, noise_shape, seed)
    if mask is None:
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    if mask.dtype == torch.bool:  # Keras' seeded formula
        keep = 1.0 - rate
        return torch.where(
            mask, inputs / keep, torch.zeros_like(inputs, dtype=inputs.dtype)
        )
    return inputs * mask  # F.dropout's: input * (bernoulli(1 - p) / (1 - p))


@torch._dynamo.disable(
    reason="keras_torch_distribution: random draws run eagerly"
)
def _dropout_mask(inputs, rate, noise_shape, seed):
    """This replica's block of the mask one process would draw: a bool mask
    (seeded) or F.dropout's scaled noise (unseeded), a DTensor laid out as
    `inputs` when it is one; None when Keras' own draw is the right one."""
    if _is_symbolic(inputs):
        return None
    sharded = isinstance(inputs, DTensor)
    shape = tuple(int(n) for n in inputs.shape)  # a DTensor's global shape
    seeded = _keras.dropout_uses_seed(seed, noise_shape)
    if seeded and noise_shape is not None:
        noise = tuple(
            shape[i] if n is None else int(n) for i, n in enumerate(noise_shape)
        )
        batch_rows = noise_shape[0] is None
    else:
        noise, batch_rows = shape, True
    window = _batch_window(shape[0]) if batch_rows else None
    if window is None and not sharded:
        return None
    # The mask's placements: the input's, but whole where the mask is
    # broadcast (a noise_shape of 1) or the input holds partial sums.
    placements = None
    box = tuple((0, n) for n in noise)
    if sharded:
        placements = tuple(
            p
            if isinstance(p, Shard) and noise[p.dim] == shape[p.dim]
            else Replicate()
            for p in inputs.placements
        )
        box = layouts.local_box(noise, inputs.device_mesh, placements)
    global_noise = noise
    if window is not None:
        global_rows, first = window
        global_noise = (global_rows,) + noise[1:]
        box = ((first + box[0][0], first + box[0][1]),) + tuple(box[1:])
    keep = 1.0 - rate
    device = tensors.local_part(inputs).device
    if seeded:
        generator = _keras.keras_generator_for_seed(seed)
        # Keras draws `bernoulli(full(shape, keep))` into float32 and makes
        # it bool; the same decisions come from a bool `out` and one `keep`
        # expanded (no buffer): 1 byte per value drawn instead of 8.
        probability = torch.full((), keep, device=device)

        def draw(shape_, out):
            return out.bernoulli_(
                probability.expand(shape_), generator=generator
            )

        block = _rows_of(draw, global_noise, box, torch.bool, device, False)
    else:

        def draw(shape_, out):
            return out.bernoulli_(keep)

        block = _rows_of(draw, global_noise, box, inputs.dtype, device, True)
        block.div_(keep)
    block = block.to(device)
    if not sharded:
        return block
    return DTensor.from_local(
        block,
        inputs.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(noise),
        stride=layouts.contiguous_stride(noise),
    )


# ---------------------------------------------------------------------------
# keras.random draws with a SeedGenerator
# ---------------------------------------------------------------------------


def normal(original, shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
    """Keras' torch `normal`; this replica's rows of a batch-shaped draw."""
    if adapter.batch_rows() is None:
        return original(shape, mean=mean, stddev=stddev, dtype=dtype, seed=seed)
    block = _seeded_rows(
        shape,
        dtype or keras.config.floatx(),
        seed,
        lambda shape_, out, g: torch.normal(
            mean, stddev, size=shape_, generator=g, out=out
        ),
    )
    if block is None:
        return original(shape, mean=mean, stddev=stddev, dtype=dtype, seed=seed)
    return block


def uniform(original, shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    """Keras' torch `uniform`; this replica's rows of a batch-shaped draw."""
    if adapter.batch_rows() is None:
        return original(
            shape, minval=minval, maxval=maxval, dtype=dtype, seed=seed
        )
    block = _seeded_rows(
        shape,
        dtype or keras.config.floatx(),
        seed,
        lambda shape_, out, g: torch.rand(size=shape_, generator=g, out=out),
    )
    if block is None:
        return original(
            shape, minval=minval, maxval=maxval, dtype=dtype, seed=seed
        )
    return (maxval - minval) * block + minval  # Keras' arithmetic


def randint(original, shape, minval, maxval, dtype="int32", seed=None):
    """Keras' torch `randint`; this replica's rows of a batch-shaped draw."""
    if adapter.batch_rows() is None:
        return original(shape, minval, maxval, dtype=dtype, seed=seed)
    block = _seeded_rows(
        shape,
        dtype,
        seed,
        lambda shape_, out, g: torch.randint(
            minval, maxval, size=shape_, generator=g, out=out
        ),
    )
    if block is None:
        return original(shape, minval, maxval, dtype=dtype, seed=seed)
    return block


@torch._dynamo.disable(
    reason="keras_torch_distribution: random draws run eagerly"
)
def _seeded_rows(shape, dtype, seed, draw):
    """This replica's rows of `draw` for the global batch, from the
    generator Keras makes for `seed`; None when the draw is not one of a
    batch (Keras' own draw is then the right one)."""
    if (
        not (seed is None or _keras.is_keras_seed_generator(seed))
        or _is_symbolic()
    ):
        return None
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:
        return None
    if not shape:
        return None
    window = _batch_window(shape[0])
    if window is None:
        return None
    global_rows, first = window
    generator = _keras.keras_generator_for_seed(seed)
    box = ((first, first + shape[0]),) + tuple((0, n) for n in shape[1:])
    return _rows_of(
        lambda shape_, out: draw(shape_, out, generator),
        (global_rows,) + shape[1:],
        box,
        _keras.to_torch_dtype(dtype),
        torch.device(_keras.torch_device()),
        False,
    ).to(_keras.torch_device())
