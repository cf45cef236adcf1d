"""Keras' int8 layers under FSDP: the gathered int8 kernel is not kept
from forward to backward.

Keras' `Dense._int8_call` and `EinsumDense._int8_call` (the call after
`quantize("int8")`, keras.io's QLoRA recipe) compute through
`ops.custom_gradient`, whose backward closure holds the kernel it was
given: under FSDP, the int8 kernel gathered whole for the forward. So
every int8 layer's gathered kernel stayed alive from its forward to its
backward, the whole model's int8 kernels at once on every rank at the
start of backward (measured: 3 of 4 gathered 512 x 512 kernels alive at
the step's peak), where FSDP keeps one group's.

Where the layer's kernel is sharded on the batch axis and a gradient is
being recorded, the call here computes Keras' own formula (the same ops in
the same order: the inputs quantized by the layer's `inputs_quantizer`,
the int8 product, de-scaled; in backward the kernel dequantized and the
inputs' gradient as Keras' `grad_fn` computes it) through a function that
keeps only the kernel's scale: backward gathers the int8 kernel again
(its own all-gather, in int8, on every rank in autograd's order), uses it
and lets it go. Elsewhere Keras' own call runs. LoRA, bias and activation
are Keras' code.

What a rank then holds in a step: its int8 blocks, the group being
gathered in forward (and the last, kept for backward), one layer's int8
kernel regathered in backward and, while its inputs' gradient is
computed, that layer's kernel dequantized (Keras' `grad_fn` does that in
one process too); never every layer's.
"""

import keras
import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._fsdp import gathering


def dense_int8_call(original, layer, inputs, training=None):
    """Keras `Dense._int8_call`: under FSDP while recording gradients, the
    gathered int8 kernel is gathered again in backward instead of kept
    (see the module docstring); else Keras' own."""
    kernel_variable = _keras.layer_kernel(layer)
    if not _regathers(kernel_variable):
        return original(layer, inputs, training=training)
    inputs = keras.ops.convert_to_tensor(inputs)
    x = _Int8Product.apply(
        _DenseInt8(layer),
        kernel_variable,
        inputs,
        keras.ops.convert_to_tensor(kernel_variable),
        keras.ops.convert_to_tensor(layer.kernel_scale),
    )
    if layer.lora_enabled:
        lora_x = keras.ops.matmul(inputs, layer.lora_kernel_a)
        lora_x = keras.ops.matmul(lora_x, layer.lora_kernel_b)
        x = keras.ops.add(x, (layer.lora_alpha / layer.lora_rank) * lora_x)
        x = keras.ops.cast(x, layer.compute_dtype)
    return _bias_and_activation(layer, x)


def einsum_dense_int8_call(original, layer, inputs, training=None):
    """Keras `EinsumDense._int8_call`: as `dense_int8_call`."""
    kernel_variable = _keras.layer_kernel(layer)
    if not _regathers(kernel_variable):
        return original(layer, inputs, training=training)
    inputs = keras.ops.convert_to_tensor(inputs)
    x = _Int8Product.apply(
        _EinsumDenseInt8(layer),
        kernel_variable,
        inputs,
        keras.ops.convert_to_tensor(kernel_variable),
        keras.ops.convert_to_tensor(layer.kernel_scale),
    )
    if layer.lora_enabled:
        lora_x = keras.ops.einsum(layer.equation, inputs, layer.lora_kernel_a)
        lora_x = keras.ops.matmul(lora_x, layer.lora_kernel_b)
        x = keras.ops.add(x, (layer.lora_alpha / layer.lora_rank) * lora_x)
        x = keras.ops.cast(x, dtype=layer.compute_dtype)
    return _bias_and_activation(layer, x)


def _regathers(kernel_variable):
    return torch.is_grad_enabled() and (
        gathering.gather_plan(kernel_variable) is not None
    )


def _bias_and_activation(layer, x):
    if layer.bias is not None:
        x = keras.ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


class _DenseInt8:
    """Keras 3.15's int8 Dense product and its inputs' gradient."""

    def __init__(self, layer):
        self.layer = layer

    def forward(self, inputs, kernel, kernel_scale):
        layer, ops = self.layer, keras.ops
        output_scale = kernel_scale
        if layer.inputs_quantizer:
            inputs, inputs_scale = layer.inputs_quantizer(inputs, axis=-1)
            output_scale = ops.multiply(output_scale, inputs_scale)
        x = ops.matmul(inputs, kernel)
        x = ops.cast(x, layer.compute_dtype)
        return ops.divide(x, output_scale)

    def inputs_gradient(self, upstream, kernel, kernel_scale):
        ops = keras.ops
        float_kernel = ops.divide(
            ops.cast(kernel, dtype=self.layer.compute_dtype), kernel_scale
        )
        return ops.matmul(upstream, ops.transpose(float_kernel))


class _EinsumDenseInt8:
    """Keras 3.15's int8 EinsumDense product and its inputs' gradient."""

    def __init__(self, layer):
        self.layer = layer

    def forward(self, inputs, kernel, kernel_scale):
        layer, ops = self.layer, keras.ops
        if layer.inputs_quantizer:
            inputs, inputs_scale = layer.inputs_quantizer(
                inputs, axis=layer.quantization_axis
            )
            inputs_scale = _keras.einsum_dense_scale_for_quant(
                layer, inputs_scale
            )
            x = ops.einsum(layer.equation, inputs, kernel)
            x = ops.cast(x, layer.compute_dtype)
            return ops.divide(x, ops.multiply(inputs_scale, kernel_scale))
        # Keras' torch path for weight-only quantization: a float einsum
        # with the kernel dequantized.
        float_kernel = ops.divide(
            ops.cast(kernel, dtype=layer.compute_dtype),
            _keras.einsum_dense_scale_for_dequant(layer, kernel_scale),
        )
        return ops.einsum(layer.equation, inputs, float_kernel)

    def inputs_gradient(self, upstream, kernel, kernel_scale):
        layer, ops = self.layer, keras.ops
        float_kernel = ops.divide(
            ops.cast(kernel, dtype=layer.compute_dtype),
            _keras.einsum_dense_scale_for_dequant(layer, kernel_scale),
        )
        return ops.einsum(
            _keras.einsum_dense_inputs_gradient_equation(layer),
            upstream,
            float_kernel,
        )


class _Int8Product(torch.autograd.Function):
    """`product.forward(inputs, kernel, scale)` with the inputs' gradient
    `product.inputs_gradient(upstream, kernel, scale)`, the kernel gathered
    again for it (`kernel_variable`'s FSDP gather) rather than kept."""

    @staticmethod
    def forward(ctx, product, kernel_variable, inputs, kernel, kernel_scale):
        ctx.product = product
        ctx.kernel_variable = kernel_variable
        ctx.save_for_backward(kernel_scale)
        return product.forward(inputs, kernel, kernel_scale)

    @staticmethod
    def backward(ctx, upstream):
        (kernel_scale,) = ctx.saved_tensors
        if not ctx.needs_input_grad[2]:
            return None, None, None, None, None
        variable = ctx.kernel_variable
        kernel = gathering.gather_plan(variable).gather(
            _keras.raw_value(variable)
        )
        grad = ctx.product.inputs_gradient(upstream, kernel, kernel_scale)
        return None, None, grad, None, None
