"""Keras' torch `sparse_categorical_crossentropy`, on rows with the class
dim last.

For outputs of more than two dims (a language model's (batch, sequence,
vocabulary) logits) Keras moves the class dim to position 1
(`output.movedim(-1, 1)`) because `F.cross_entropy` wants it there: the
log-softmax then reduces over a strided dim and the loss runs as
`nll_loss2d`. On an H100 that cost 54 ms of a 1.1 B keras_hub Llama's step.
torch's own recipes (torchtitan's loss) flatten the logits to (rows,
classes) instead, where the class dim is the contiguous last one.

Here an output whose class dim is its last, of more than two dims, is
viewed as (rows, classes) and the target as (rows,), and the loss is
reshaped back: the same formula as Keras' (`F.cross_entropy` from logits;
from probabilities, Keras' normalisation, clipping and log, then
`F.nll_loss`), per row. Everything else (other class axes, two dims or
fewer, DTensors, shapes Keras refuses) goes to Keras' own, which raises
Keras' own errors. (From probabilities of four dims or more, Keras' own
cannot be differentiated on torch 2.13: `nll_loss2d`'s backward refuses
the strided class dim. On rows it can.)
"""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras


def sparse_categorical_crossentropy(
    original, target, output, from_logits=False, axis=-1
):
    """Replaces Keras' torch `sparse_categorical_crossentropy`: on (rows,
    classes) where the class dim is the last of more than two (see the
    module docstring), else Keras' own."""
    output = _keras.convert_to_tensor(output)
    target = _keras.convert_to_tensor(target, dtype=torch.long)
    if (
        isinstance(output, DTensor)
        or isinstance(target, DTensor)
        or output.dim() <= 2
        or axis % output.dim() != output.dim() - 1
    ):
        return original(target, output, from_logits=from_logits, axis=axis)
    if target.dim() == output.dim() and target.shape[-1] == 1:
        target = target.squeeze(-1)
    if target.shape != output.shape[:-1]:
        return original(target, output, from_logits=from_logits, axis=axis)
    rows = output.reshape(-1, output.shape[-1])
    if from_logits:
        losses = F.cross_entropy(rows, target.reshape(-1), reduction="none")
    else:
        rows = rows / torch.sum(rows, dim=1, keepdim=True)
        epsilon = _keras.epsilon()
        rows = torch.clip(rows, epsilon, 1.0 - epsilon)
        losses = F.nll_loss(
            torch.log(rows), target.reshape(-1), reduction="none"
        )
    return losses.reshape(target.shape)
