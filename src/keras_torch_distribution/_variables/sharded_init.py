"""Initialize only this rank's block of a variable ("stream and slice").

For Keras' random initializers, the generator Keras would create for the
initializer's seed draws the variable's whole random stream in row-aligned
chunks; each rank keeps the rows and columns of its block and drops the
rest. The result is bit for bit the value a one-process Keras run gives,
whatever the mesh, at a peak of the local block plus one chunk
(`CHUNK_DRAWS` random numbers, 4 MiB in float32).

Constant initializers and Identity build the block directly. Any other
initializer (Orthogonal, user-defined ones) is computed in full on every rank,
on the host (a `keras.device("cpu")` scope: no GPU ever holds the whole
variable), and sliced there: a transient cost of one whole variable in host
memory, with a warning naming it. Like the random blocks above, its random
draws are then the CPU's.
"""

import math

import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._log import warn_once

CHUNK_DRAWS = 1 << 20
# CPU `normal_` draws in blocks of 16 values (with a redrawn tail); chunks are
# multiples of it so that a chunked stream equals the one-call stream.
_NORMAL_BLOCK = 16


class RandomCall:
    """What a Keras random initializer asked for, recorded instead of drawn."""

    def __init__(self, kind, shape, dtype, seed, params):
        self.kind = kind
        self.shape = tuple(shape)
        self.dtype = dtype
        self.seed = seed
        self.params = params


class _RandomRecorder:
    @staticmethod
    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        return RandomCall("normal", shape, dtype, seed, (mean, stddev))

    @staticmethod
    def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        return RandomCall(
            "truncated_normal", shape, dtype, seed, (mean, stddev)
        )

    @staticmethod
    def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
        return RandomCall("uniform", shape, dtype, seed, (minval, maxval))


def record_random_initializer(initializer, shape, dtype):
    """The `RandomCall` a built-in random initializer would make for `shape`,
    without drawing anything; None for any other initializer."""
    if type(initializer).__call__ not in _keras.RECORDABLE_INITIALIZER_CALLS:
        return None
    with _keras.initializers_drawing_from(_RandomRecorder):
        call = initializer(shape, dtype=dtype)
    return call if isinstance(call, RandomCall) else None


def init_block(initializer, shape, dtype, box, path):
    """This rank's block `box` of `initializer(shape, dtype)`, as a tensor."""
    torch_dtype = _keras.to_torch_dtype(dtype)
    device = _keras.torch_device()
    local_shape = tuple(hi - lo for lo, hi in box)
    kind = _keras.initializer_kind(initializer)
    if kind in ("zeros", "ones", "constant"):
        value = initializer(local_shape, dtype=dtype)
        return torch.as_tensor(value, dtype=torch_dtype).to(device)
    if kind == "identity" and len(shape) == 2:
        rows = torch.arange(box[0][0], box[0][1]).unsqueeze(1)
        cols = torch.arange(box[1][0], box[1][1]).unsqueeze(0)
        eye = (rows == cols).to(torch_dtype) * initializer.gain
        return eye.to(device)
    call = record_random_initializer(initializer, shape, dtype)
    if call is not None:
        return _stream_block(call, shape, torch_dtype, box).to(device)
    nbytes = (
        math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    )
    warn_once(
        ("full-init", path),
        "Variable %r (shape %s, %s bytes) uses %s, which cannot be initialized "
        "shard by shard: every rank computes it whole once in host memory, "
        "then keeps its shard.",
        path,
        tuple(shape),
        f"{nbytes:,}",
        type(initializer).__name__,
    )
    with _keras.torch_device_scope("cpu"):
        full = torch.as_tensor(initializer(shape, dtype=dtype))
        block = full[layouts.box_slices(box)].to(torch_dtype).clone()
    del full
    return block.to(device)


def row_groups(rows, draws_per_row, max_draws):
    """Split `rows` into consecutive groups whose draw counts are multiples of
    the normal block, except the last, which holds the stream's tail (and at
    least one block, when the stream has one)."""
    step = _NORMAL_BLOCK // math.gcd(draws_per_row, _NORMAL_BLOCK)
    per_group = max(step, (max_draws // max(draws_per_row, 1)) // step * step)
    groups = []
    start = 0
    while start < rows:
        stop = min(start + per_group, rows)
        groups.append([start, stop])
        start = stop
    if len(groups) > 1:
        tail_draws = (groups[-1][1] - groups[-1][0]) * draws_per_row
        if tail_draws < _NORMAL_BLOCK or tail_draws % _NORMAL_BLOCK:
            last = groups.pop()
            groups[-1][1] = last[1]
    return groups


def _stream_block(call, shape, torch_dtype, box, max_draws=None):
    """Draw `call`'s stream for rows up to the block's end; keep the block."""
    max_draws = max_draws or CHUNK_DRAWS
    generator = _keras.keras_generator_for_seed(call.seed)
    if generator.device.type != "cpu":
        # Blocks are drawn on the CPU: its stream can be cut into chunks.
        seed = generator.initial_seed()
        generator = torch.Generator()
        generator.manual_seed(seed)
    draws_per_value = 4 if call.kind == "truncated_normal" else 1
    shape = tuple(int(n) for n in shape)
    if len(shape) == 0:
        raise ValueError("scalar variables are never sharded")
    row_shape = shape[1:]
    draws_per_row = math.prod(row_shape) * draws_per_value
    (row_lo, row_hi), inner = box[0], layouts.box_slices(box[1:])
    local_shape = tuple(hi - lo for lo, hi in box)
    block = torch.empty(local_shape, dtype=torch_dtype)
    groups = row_groups(shape[0], draws_per_row, max_draws)
    largest = max(stop - start for start, stop in groups) * draws_per_row
    buffer = torch.empty(largest, dtype=torch_dtype)  # reused by every chunk
    for start, stop in groups:
        if start >= row_hi:
            break
        chunk = _draw(
            call, (stop - start,) + row_shape, torch_dtype, generator, buffer
        )
        lo, hi = max(start, row_lo), min(stop, row_hi)
        if lo < hi:
            # Copy out and drop the chunk: at most one chunk is alive.
            block[lo - row_lo : hi - row_lo] = chunk[lo - start : hi - start][
                (slice(None),) + inner
            ]
        del chunk
    return block


def _draw(call, shape, torch_dtype, generator, buffer):
    """The next values of the stream, computed as Keras' torch backend does,
    drawn into (the front of) `buffer`."""
    if call.kind == "truncated_normal":
        shape = shape + (4,)
    out = buffer[: math.prod(shape)].view(shape)
    if call.kind == "normal":
        mean, stddev = call.params
        return torch.normal(
            mean, stddev, size=shape, generator=generator, out=out
        )
    if call.kind == "uniform":
        minval, maxval = call.params
        values = torch.rand(size=shape, generator=generator, out=out)
        return values.mul_(maxval - minval).add_(minval)
    if call.kind == "truncated_normal":
        mean, stddev = call.params
        x = torch.normal(0.0, 1.0, size=shape, generator=generator, out=out)
        valid = (x > -2) & (x < 2)
        indexes = valid.max(-1, keepdim=True)[1]
        values = x.gather(-1, indexes).squeeze(-1)
        return values.mul_(stddev).add_(mean)
    raise ValueError(f"unknown random call {call.kind!r}")
