"""Keras' torch `convert_to_tensor`, without a copy from the host for a
Python number.

Keras turns every Python bool, int and float an op meets into a tensor with
`torch.as_tensor(x, dtype=..., device=...)`: on CUDA a copy from pageable
host memory, which waits for every kernel queued before it. Model code
passes such numbers to ops all the time (keras_hub's RMS norm
`ops.power(x, 2)`, its rotary embedding's and causal mask's `ops.cast` of
Python numbers, the large negative of `dot_product_attention`'s mask,
Adam's `iterations + 1`): a keras_hub Llama step made 8 of these host
syncs per decoder block, 135 per step at 16 blocks, each one letting the
GPU run dry while the host caught up.

Here such a number becomes `torch.full((), x, dtype=..., device=...)`: a
fill kernel queued on the device like any other, no host wait. The dtype
rules are Keras' own (a bool is bool, an int int32 or int64 by its range,
a float `floatx()`, or the dtype asked for), and the value is the one
`torch.as_tensor` makes (each dtype's rounding of the Python number, inf
beyond its range).
A tensor in host memory bound for a GPU (each batch `fit` feeds the
model) is copied through pinned memory with `non_blocking=True`, as
torch's `DataLoader(pin_memory=True)` recipes do, instead of Keras'
blocking `x.to(device)`.

A short flat list or tuple of Python numbers (the shape Keras' loss
reduction converts to count a batch's values) becomes one such tensor per
number, stacked: a few kernels instead of a host wait. Everything else
goes to Keras' own conversion.
"""

import math

import torch

from keras_torch_distribution import _keras

_NUMBERS = (bool, int, float)
_INT32 = (-(2**31), 2**31)
# Lists and tuples of up to this many Python numbers are made on the device
# number by number; longer ones are copied from the host, as Keras does.
MAX_LISTED_NUMBERS = 8


def convert_to_tensor(original, x, dtype=None, sparse=None, ragged=None):
    """Replaces Keras' torch `convert_to_tensor` (in every module that
    binds it): a Python number becomes a 0-dim tensor filled on Keras'
    device (no copy from the host); anything else is converted by Keras."""
    if not sparse and not ragged:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu" and not x.requires_grad:
                device = torch.device(_keras.torch_device())
                if device.type == "cuda":
                    return _pinned_copy(x, device, dtype)
        elif isinstance(x, _NUMBERS):
            return _filled(x, _dtype_of(x, dtype))
        elif _short_numbers(x):
            torch_dtype = _keras.to_torch_dtype(
                dtype or _keras.result_type(*(type(n) for n in x))
            )
            return torch.stack([_filled(n, torch_dtype) for n in x])
    return original(x, dtype=dtype, sparse=sparse, ragged=ragged)


def _pinned_copy(x, device, dtype):
    """`x` (a host tensor) on the GPU `device`, in `dtype` when one is
    given, copied without making the host wait: through pinned memory,
    which torch keeps alive until the copy has run."""
    if dtype is not None:
        x = x.to(_keras.to_torch_dtype(dtype))
    source = x if x.is_pinned() else x.pin_memory()
    return source.to(device, non_blocking=True)


def _filled(number, torch_dtype):
    """`number` in a 0-dim tensor of `torch_dtype` on Keras' device."""
    return torch.full(
        (),
        _in_range(number, torch_dtype),
        dtype=torch_dtype,
        device=_keras.torch_device(),
    )


def _short_numbers(x):
    """True for a list or tuple of 1 to MAX_LISTED_NUMBERS Python numbers."""
    return (
        isinstance(x, (list, tuple))
        and 0 < len(x) <= MAX_LISTED_NUMBERS
        and all(isinstance(n, _NUMBERS) for n in x)
    )


def _dtype_of(x, dtype):
    """The torch dtype Keras gives the Python number `x`."""
    if dtype is not None:
        return _keras.to_torch_dtype(dtype)
    if isinstance(x, bool):
        return torch.bool
    if isinstance(x, int):
        return torch.int32 if _INT32[0] <= x < _INT32[1] else torch.int64
    return _keras.to_torch_dtype(_keras.floatx())


def _in_range(x, torch_dtype):
    """`x`, or, for a number beyond a floating dtype's range (which
    `torch.full` refuses), the value Keras' conversion gives it (inf, or
    the largest finite value it rounds to), worked out on the host."""
    if not torch_dtype.is_floating_point or isinstance(x, bool):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return x
    info = torch.finfo(torch_dtype)
    if abs(x) <= info.max:
        return x
    # Round to nearest: past the largest value by half a step at that
    # magnitude is inf, nearer is the largest value.
    half_step = info.eps * info.max / (2 - info.eps) / 2
    largest = info.max if abs(x) < info.max + half_step else math.inf
    return math.copysign(largest, x)
