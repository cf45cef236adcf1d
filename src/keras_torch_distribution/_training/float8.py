"""Keras' float8 layers: one process's numbers under every distribution,
float8 matrix products where the GPU has them.

Replaces Keras' `Dense._float8_call` and `EinsumDense._float8_call` (the
call of a layer after `quantize("float8")`; Keras 3.16's
`Float8Strategy.call` for those layers) with Keras' own computation
(its code, through `keras.ops` and `keras.quantizers`), but for two
things:

- The matrix product runs as `torch._scaled_mm` on float8 operands
  (`_backend.float8.matmul`: the same quantized values and scales) where
  `_backend.float8.uses_scaled_mm` says so, the operands are plain tensors
  (not DTensors: tensor parallelism keeps Keras' matmul) and their sizes
  fit, and for `EinsumDense` the equation is one matrix product of the
  inputs by the kernel (`_backend.numpy.matmul_plan`). Elsewhere it is
  Keras' fake-quantized float matmul (or einsum).
- The bias. Under a float32 compute dtype Keras rounds the bias to
  bfloat16 in the forward (`cast(cast(bias, "bfloat16"), "float32")`, for
  XLA's bias-add fusion), so backward rounds its gradient to bfloat16:
  one process rounds the sum over the global batch. Each replica would
  round the sum over its own rows, and the replicas' rounded sums add up
  to another number (2e-3 relative on a bias after one step on 2
  replicas; Keras on JAX rounds after GSPMD's sum, as one process). On
  several replicas the bias gradient here stays float32 through backward,
  and `round_after_sum` rounds it once the replicas' gradients are
  combined (`gradients.synchronize` calls it); in one process it is
  rounded in backward, as Keras does.

The scales and amax histories are combined over replicas by
`reductions` (their maximum) and, since each replica backpropagates its
share of the global batch's loss, the output gradient each replica
quantizes is one process's.
"""

import functools
import math

import keras
import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._backend import float8 as backend_float8
from keras_torch_distribution._backend import numpy as backend_numpy
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors

# The attribute of a bias variable whose gradient is rounded to this dtype
# after the replicas' sum (`round_after_sum`).
_ROUNDED_AFTER_SUM = "_ktd_gradient_rounded_to"


def layer_call(original, layer, inputs, training=None):
    """Keras `Dense._float8_call` and `EinsumDense._float8_call`: Keras'
    float8 layer, its matrix product (or einsum) as `torch._scaled_mm`
    where it runs, its bias gradient rounded after the replicas' sum (see
    the module docstring); Keras' own with LoRA."""
    if layer.lora_enabled:
        return original(layer, inputs, training=training)
    equation = layer.equation if isinstance(layer, _keras.EinsumDense) else None
    inputs = keras.ops.convert_to_tensor(inputs)
    return _float8_call(layer, inputs, training, equation)


def strategy_call(original, strategy, layer, inputs, training=None):
    """Keras 3.16's `Float8Strategy.call` (3.16 moved Keras' float8 call,
    unchanged, from the layers to the mode's strategy): `layer_call` for a
    Dense or EinsumDense layer, Keras' own for any other."""
    if not isinstance(layer, (_keras.Dense, _keras.EinsumDense)):
        return original(strategy, layer, inputs, training=training)
    return layer_call(
        functools.partial(original, strategy), layer, inputs, training
    )


def _float8_call(layer, inputs, training, equation):
    kernel = keras.ops.convert_to_tensor(_keras.layer_kernel(layer))
    scales = tuple(
        keras.ops.convert_to_tensor(v)
        for v in (
            layer.inputs_scale,
            layer.kernel_scale,
            layer.outputs_grad_scale,
        )
    )
    histories = tuple(
        keras.ops.convert_to_tensor(v)
        for v in (
            layer.inputs_amax_history,
            layer.kernel_amax_history,
            layer.outputs_grad_amax_history,
        )
    )
    dims = _matmul_dims(inputs, kernel, equation)
    if dims is not None:
        x = backend_float8.matmul(
            inputs, kernel, scales, histories, *dims, training
        )
    else:
        x = _fake_quantized(
            layer, inputs, kernel, scales, histories, training, equation
        )
    if layer.bias is not None:
        bias = keras.ops.convert_to_tensor(layer.bias)
        if layer.dtype_policy.compute_dtype == "float32":
            bias = _rounded_bias(layer.bias, bias)
        x = keras.ops.add(x, bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _matmul_dims(inputs, kernel, equation):
    """(kept, contracted) when the product runs as `torch._scaled_mm`:
    `inputs`' first `kept` dims are rows, the rest contracted with
    `kernel`'s first `contracted` dims; None for Keras' matmul."""
    if (
        isinstance(inputs, DTensor)
        or isinstance(kernel, DTensor)
        or not inputs.is_floating_point()
        or not backend_float8.uses_scaled_mm(inputs.device)
    ):
        return None
    if equation is None:
        kept, contracted = inputs.ndim - 1, 1
    else:
        # While compiling, worked out anew (dynamo traces through the
        # cache, and warns that it does), as `_backend.numpy.einsum` does.
        plan_for = (
            backend_numpy.matmul_plan.__wrapped__
            if torch.compiler.is_compiling()
            else backend_numpy.matmul_plan
        )
        plan = plan_for(equation.replace(" ", ""), inputs.ndim, kernel.ndim)
        if plan is None or plan.swap:
            return None
        kept, contracted = plan.kept_left, plan.contracted
    rows = math.prod(inputs.shape[:kept])
    inner = math.prod(inputs.shape[kept:])
    if inner != math.prod(kernel.shape[:contracted]):
        return None
    columns = math.prod(kernel.shape[contracted:])
    if not backend_float8.fits(inputs.device, rows, inner, columns):
        return None
    return kept, contracted


def _fake_quantized(layer, inputs, kernel, scales, histories, training, eq):
    """Keras' own float8 product (Keras 3.15's `_float8_call` up to the
    bias): quantize-dequantize the inputs and kernel (e4m3), a float matmul
    or einsum, quantize-dequantize the output gradient (e5m2)."""
    compute_dtype = layer.compute_dtype
    e4m3_max = float(torch.finfo(backend_float8.E4M3).max)
    e5m2_max = float(torch.finfo(backend_float8.E5M2).max)

    @keras.ops.custom_gradient
    def quantized_dequantize_inputs(inputs, scale, amax_history):
        if training:
            new_scale = keras.quantizers.compute_float8_scale(
                keras.ops.max(amax_history, axis=0),
                scale,
                keras.ops.cast(e4m3_max, "float32"),
            )
            new_amax_history = keras.quantizers.compute_float8_amax_history(
                inputs, amax_history
            )
        else:
            new_scale = None
            new_amax_history = None
        qdq_inputs = keras.quantizers.quantize_and_dequantize(
            inputs, scale, "float8_e4m3fn", compute_dtype
        )

        def grad(*args, upstream=None, variables=None):
            if upstream is None:
                (upstream,) = args
            return upstream, new_scale, new_amax_history

        return qdq_inputs, grad

    @keras.ops.custom_gradient
    def quantized_dequantize_outputs(outputs, scale, amax_history):
        def grad(*args, upstream=None, variables=None):
            if upstream is None:
                (upstream,) = args
            new_scale = keras.quantizers.compute_float8_scale(
                keras.ops.max(amax_history, axis=0),
                scale,
                keras.ops.cast(e5m2_max, "float32"),
            )
            qdq_upstream = keras.quantizers.quantize_and_dequantize(
                upstream, scale, "float8_e5m2", compute_dtype
            )
            new_amax_history = keras.quantizers.compute_float8_amax_history(
                upstream, amax_history
            )
            return qdq_upstream, new_scale, new_amax_history

        return outputs, grad

    x_qdq = quantized_dequantize_inputs(inputs, scales[0], histories[0])
    k_qdq = quantized_dequantize_inputs(kernel, scales[1], histories[1])
    if eq is None:
        x = keras.ops.matmul(x_qdq, k_qdq)
    else:
        x = keras.ops.einsum(eq, x_qdq, k_qdq)
    return quantized_dequantize_outputs(x, scales[2], histories[2])


class _BfloatRoundedBias(torch.autograd.Function):
    """The bias rounded to bfloat16 and back; its gradient rounded to
    bfloat16 in backward (Keras' casts), or left float32 (`defer`) for
    `round_after_sum`."""

    @staticmethod
    def forward(ctx, bias, defer):
        ctx.defer = defer
        return bias.to(torch.bfloat16).to(bias.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.defer:
            return grad, None
        return grad.to(torch.bfloat16).to(grad.dtype), None


def _rounded_bias(variable, bias):
    """`bias` (the value of `variable`) as Keras' float8 call adds it under
    a float32 compute dtype (see the module docstring)."""
    defer = replicas.current().is_distributed
    if defer:
        setattr(variable, _ROUNDED_AFTER_SUM, torch.bfloat16)
    return _BfloatRoundedBias.apply(bias, defer)


def round_after_sum(grads, variables):
    """Round, in place, the combined gradients of float8 layers' biases
    whose rounding backward left for after the replicas' sum."""
    for grad, variable in zip(grads, variables):
        dtype = getattr(variable, _ROUNDED_AFTER_SUM, None)
        if grad is None or dtype is None:
            continue
        local = tensors.local_part(grad)
        local.copy_(local.to(dtype))
