"""Keras' float8 matrix product as `torch._scaled_mm`, with Keras' own
delayed scales.

Keras' float8 `Dense` / `EinsumDense` (`layer.quantize("float8")`)
quantize their inputs and kernel to float8 e4m3 and the output gradient
to e5m2, each with a scale from the past maxima of |x| (delayed scaling:
an amax history per tensor; a step uses the scale the last one computed
from the history's maximum), and dequantize them again around a float
matmul. XLA rewrites that pattern into a float8 GEMM; on torch it stays a
float matmul with quantize / dequantize kernels around it, which can only
cost more than the matmul alone.

`matmul` computes Keras' formula with float8 operands instead:

- forward `y = x @ k` as `torch._scaled_mm(x_q, k_q, scale_x, scale_k)`,
  with `x_q`, `k_q` Keras' quantized values exactly (the same division by
  the scale, clip and cast as `keras.quantizers.quantize_and_dequantize`);
- backward `dx = g_q @ k_q^T` and `dk = x_q^T @ g_q` likewise, with `g_q`
  the output gradient quantized to e5m2 by Keras' output-gradient scale
  (straight through the quantization to x and k, as Keras' custom
  gradients are);
- the new scales and amax histories are those variables' "gradients", as
  Keras computes them (`keras.quantizers.compute_float8_scale`,
  `compute_float8_amax_history`, called here).

The products are sums of the same float8 products; what differs from
Keras' dequantized float matmul is where the scales multiply (once, after
the sum) and how the GEMM accumulates: float rounding, not float8
rounding. Backward keeps the float8 operands (a quarter of float32's
bytes), not dequantized copies.

Where `torch._scaled_mm` runs: `uses_scaled_mm(device)` (KTD_FLOAT8_MATMUL:
by default CUDA devices of compute capability 8.9 or more; "1" wherever a
probe call succeeds, the CPU of torch 2.13 included; "0" nowhere). The
caller (`_training.float8`) also requires plain tensors (no DTensor:
torch 2.11 has no sharding rule for it) and, on CUDA, dims that are
multiples of 16 (`fits`).
"""

import keras
import torch

from keras_torch_distribution import _env

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def quantize(x, scale, dtype):
    """`x` in float8 `dtype` as Keras quantizes it: divided by `scale` (in
    x's dtype), clipped to the float8 range, cast."""
    limit = float(torch.finfo(dtype).max)
    scaled = torch.divide(x, scale.to(x.dtype))
    return torch.clip(scaled, -limit, limit).to(dtype)


def new_scale(history, scale, dtype):
    """Keras' next scale for a tensor quantized to `dtype`: from the
    maximum of its amax `history` (`scale` kept where that is 0 or not
    finite)."""
    return keras.quantizers.compute_float8_scale(
        torch.amax(history, dim=0),
        scale,
        torch.tensor(
            float(torch.finfo(dtype).max),
            dtype=torch.float32,
            device=history.device,
        ),
    )


def new_history(x, history):
    """Keras' next amax history: max |x| rolled into `history`."""
    return keras.quantizers.compute_float8_amax_history(x, history)


def _scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """`a @ b` of float8 matrices times `scale_a * scale_b`, in
    `out_dtype`: `a` row-major, `b` column-major, as cuBLAS takes them."""
    if not a.is_contiguous():
        a = a.contiguous()
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return torch._scaled_mm(
        a,
        b,
        scale_a=scale_a.to(torch.float32),
        scale_b=scale_b.to(torch.float32),
        out_dtype=out_dtype,
    )


class _Float8Matmul(torch.autograd.Function):
    """Keras' float8 matmul of `x` (rows, contracted) by `kernel`
    (contracted, columns), both possibly with more dims folded into those
    two; the scale and history inputs get their new values as gradients."""

    @staticmethod
    def forward(
        ctx,
        x,
        kernel,
        x_scale,
        x_history,
        k_scale,
        k_history,
        g_scale,
        g_history,
        kept,
        contracted,
        training,
    ):
        rows_shape = x.shape[:kept]
        columns_shape = kernel.shape[contracted:]
        x2d = x.reshape(rows_shape.numel(), -1)
        k2d = kernel.reshape(x2d.shape[1], -1)
        x_q = quantize(x2d, x_scale, E4M3)
        k_q = quantize(k2d, k_scale, E4M3)
        y = _scaled_mm(x_q, k_q, x_scale, k_scale, x.dtype)
        ctx.save_for_backward(x_q, k_q, x_scale, k_scale, g_scale, g_history)
        ctx.shapes = (x.shape, kernel.shape, x.dtype, kernel.dtype)
        ctx.new = (
            (
                new_scale(x_history, x_scale, E4M3),
                new_history(x, x_history),
                new_scale(k_history, k_scale, E4M3),
                new_history(kernel, k_history),
            )
            if training
            else (None,) * 4
        )
        return y.reshape(tuple(rows_shape) + tuple(columns_shape))

    @staticmethod
    def backward(ctx, upstream):
        x_q, k_q, x_scale, k_scale, g_scale, g_history = ctx.saved_tensors
        x_shape, k_shape, x_dtype, k_dtype = ctx.shapes
        g2d = upstream.reshape(x_q.shape[0], k_q.shape[1])
        g_q = quantize(g2d, g_scale, E5M2)
        dx = dk = None
        if ctx.needs_input_grad[0]:
            dx = _scaled_mm(g_q, k_q.t(), g_scale, k_scale, x_dtype)
            dx = dx.reshape(x_shape)
        if ctx.needs_input_grad[1]:
            dk = _scaled_mm(x_q.t(), g_q, x_scale, g_scale, k_dtype)
            dk = dk.reshape(k_shape)
        new_g_scale = new_scale(g_history, g_scale, E5M2)
        new_g_history = new_history(upstream, g_history)
        new = ctx.new
        ctx.new = None
        return (
            dx,
            dk,
            *new,
            new_g_scale,
            new_g_history,
            None,
            None,
            None,
        )


def matmul(x, kernel, scales, histories, kept, contracted, training):
    """Keras' float8 product of `x` and `kernel` as `torch._scaled_mm` (see
    the module docstring): `x`'s first `kept` dims are rows, the rest
    contracted with `kernel`'s first `contracted` dims. `scales` and
    `histories`: the (inputs, kernel, output gradient) scale and amax
    history tensors, whose gradients are their new values (inputs' and
    kernel's only when `training`)."""
    return _Float8Matmul.apply(
        x,
        kernel,
        scales[0],
        histories[0],
        scales[1],
        histories[1],
        scales[2],
        histories[2],
        kept,
        contracted,
        bool(training),
    )


def fits(device, rows, contracted, columns):
    """Whether `_scaled_mm` takes these sizes on `device` (cuBLAS wants
    every dim of the three products a multiple of 16)."""
    if device.type != "cuda":
        return True
    return rows % 16 == 0 and contracted % 16 == 0 and columns % 16 == 0


class Probes:
    """Whether float8 layers use `torch._scaled_mm`, by (KTD_FLOAT8_MATMUL,
    device): decided once (a probe call where it may), read after."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.decided = {}  # (choice, torch.device) -> bool


probes = Probes()


def uses_scaled_mm(device):
    """Whether float8 layers on `device` compute with `torch._scaled_mm`
    (KTD_FLOAT8_MATMUL; see the module docstring)."""
    key = (_env.float8_matmul(), device)
    decided = probes.decided.get(key)
    if decided is None:
        decided = probes.decided[key] = _decide(*key)
    return decided


@torch._dynamo.disable(reason="keras_torch_distribution: decided once")
def _decide(choice, device):
    if choice == "0":
        return False
    if choice == "auto" and (
        device.type != "cuda"
        or torch.cuda.get_device_capability(device) < (8, 9)
    ):
        return False
    return _probe(device)


def _probe(device):
    """One small `_scaled_mm` on `device`: True if torch runs it there."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    a = torch.ones((16, 16), device=device).to(E4M3)
    one = torch.ones((), device=device)
    try:
        _scaled_mm(a, a.t(), one, one, torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True
