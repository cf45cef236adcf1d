"""Copies of a variable are equal before a model's first step.

Copies are made equal as variables are created (`copies`: when the
outermost layer call that built them returns). Before the first train,
test or predict step of each model under a distribution, what is left is
made equal too, as DistributedDataParallel broadcasts parameters and
buffers from rank 0 when it wraps a module: variables created outside any
layer call (`keras.Variable` in user code, SeedGenerators made in layer
constructors) and variables created before the distribution was set.
Variables filled with a constant are left out. Flat broadcasts per process
group and dtype, in buckets (see `benchmarks/one_device_numbers.py`).
Variables created after the first step outside layer calls, and training
loops that call the model and `optimizer.apply` themselves, are not
covered.

Replaces, through the seam, Keras' `make_train_function` /
`make_test_function` / `make_predict_function` with one factory,
`make_step_function`: it wraps the step function `compiled` makes, once,
in the one wrapper every step kind gets under a distribution (copies
made equal first; a train step of Keras' own `train_step` lets go of the
last step's gradients before its forward, not after it, and shares the
loss (`reductions.sharing_the_loss`); for predict, the
predictions of every replica gathered by `trainer`).
"""

import weakref

import keras
import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._log import logger
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._training import compiled
from keras_torch_distribution._training import reductions
from keras_torch_distribution._training import trainer
from keras_torch_distribution._variables import copies


class EqualizedModels:
    """The models whose copies were made equal across replicas (once per
    model, before its first step)."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.models = weakref.WeakSet()


equalized = EqualizedModels()


def make_step_function(kind, original, model, force=False):
    """Keras `TorchTrainer.make_train_function` / `make_test_function` /
    `make_predict_function` (`kind`: "train", "test" or "predict"):
    the step function `compiled.make_step_function` makes, wrapped once
    under a distribution. On several processes its first call runs
    `equalize(model)`; a predict step returns the predictions of every
    replica in input order (`trainer.gather_predictions`). Collective per
    step: call on every rank."""
    result = compiled.make_step_function(kind, original, model, force)
    function = _keras.model_step_function(model, kind)
    if (
        function is None
        or getattr(function, "_ktd_distributed_step", False)
        or _keras.current_distribution() is None
    ):
        return result
    model_ref = weakref.ref(model)
    gathers = kind == "predict"
    clears_gradients = kind == "train" and _keras.uses_keras_train_step(model)
    shares_loss = clears_gradients

    def distributed_step(data):
        owner = model_ref()
        if (
            owner is not None
            and owner not in equalized.models
            and runtime.is_multi_process()
        ):
            equalize(owner)
        if isinstance(data, list) and len(data) > 1:
            # steps_per_execution > 1 (Keras 3.16 allows it on torch): one
            # step per batch, so that the compiled step sees one batch and
            # each batch's predictions of every replica come in input order.
            results = [one_step(owner, [batch]) for batch in data]
            if not gathers:
                return results[-1]
            return keras.tree.map_structure(
                lambda *rows: torch.cat(rows, dim=0), *results
            )
        return one_step(owner, data)

    def one_step(owner, data):
        if clears_gradients and owner is not None:
            # Keras' train_step sets the last step's gradients to None after
            # its forward; before it, they are not alive beside the forward's
            # gathered weights and activations (a gradient's worth less at
            # the peak; on JAX no gradient outlives its step either).
            owner.zero_grad(set_to_none=True)
        if shares_loss and owner is not None:
            # The loss scaled to this replica's share of the global batch's
            # before backward, the gradients summed (`reductions`).
            with reductions.sharing_the_loss(owner):
                outputs = function(data)
        else:
            outputs = function(data)
        return trainer.gather_predictions(outputs) if gathers else outputs

    distributed_step.__dict__.update(function.__dict__)  # the _ktd_* marks
    distributed_step._ktd_distributed_step = True
    _keras.set_model_step_function(model, kind, distributed_step)
    return distributed_step if result is function else result


def equalize(model):
    """Make every copy of `model`'s variables equal to the first copy (see
    the module docstring), but for those equal already (`copies`).
    Collective: call on every rank."""
    count = copies.make_equal(
        [v for v in model.variables if not copies.are_equal(v)]
    )
    equalized.models.add(model)
    logger.debug(
        "Made %d variable blocks of model %r equal across replicas.",
        count,
        model.name,
    )
