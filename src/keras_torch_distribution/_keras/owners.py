"""The owners of the attributes the patch table (`_patches.py`) replaces:
Keras' classes and modules, by the names the table uses."""

import keras
from keras.src import backend as keras_backend
from keras.src.backend.common import variables as common_variables
from keras.src.backend.torch import random as torch_random
from keras.src.backend.torch.optimizers import torch_adam
from keras.src.backend.torch.optimizers import torch_sgd
from keras.src.callbacks import callback_list
from keras.src.distribution import distribution_lib as keras_distribution_lib
from keras.src.layers import layer as keras_layer
from keras.src.layers.normalization import batch_normalization
from keras.src.models import model as keras_model
from keras.src.ops import operation as keras_operation
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer
from keras.src.trainers import epoch_iterator
from keras.src.utils import file_utils

from keras_torch_distribution._keras.versions import torch_core
from keras_torch_distribution._keras.versions import torch_nn
from keras_torch_distribution._keras.versions import torch_numpy

__all__ = [
    "keras_backend_module",
    "common_variable_module",
    "keras_distribution_module",
    "torch_nn_module",
    "torch_core_module",
    "torch_numpy_module",
    "Distribution",
    "DeviceMesh",
    "torch_random_module",
    "BatchNormalization",
    "Dense",
    "EinsumDense",
    "Layer",
    "Operation",
    "Model",
    "BaseOptimizer",
    "LossScaleOptimizer",
    "TorchAdam",
    "TorchSGD",
    "epoch_iterator_data_adapters",
    "BackupAndRestore",
    "EpochIterator",
    "CallbackList",
    "keras_file_utils_module",
    "KERAS_HUB_SAFETENSORS_MODULE",
    "keras_hub_safetensor_loader",
    "keras_hub_safetensors_paths",
]

keras_backend_module = keras_backend
common_variable_module = common_variables
keras_distribution_module = keras_distribution_lib
torch_nn_module = torch_nn
torch_core_module = torch_core
torch_numpy_module = torch_numpy
Distribution = keras_distribution_lib.Distribution
DeviceMesh = keras_distribution_lib.DeviceMesh
torch_random_module = torch_random
BatchNormalization = batch_normalization.BatchNormalization
Dense = keras.layers.Dense
EinsumDense = keras.layers.EinsumDense
Layer = keras_layer.Layer
Operation = keras_operation.Operation
Model = keras_model.Model
BaseOptimizer = base_optimizer.BaseOptimizer
LossScaleOptimizer = loss_scale_optimizer.LossScaleOptimizer
TorchAdam = torch_adam.Adam
TorchSGD = torch_sgd.SGD
epoch_iterator_data_adapters = epoch_iterator.data_adapters
BackupAndRestore = keras.callbacks.BackupAndRestore
EpochIterator = epoch_iterator.EpochIterator
CallbackList = callback_list.CallbackList
# `makedirs`, which Keras' callbacks and saving look up as an attribute of
# this module (`file_utils.makedirs(...)`) when they call it.
keras_file_utils_module = file_utils

# keras_hub's module whose `SafetensorLoader` ports a Hugging Face
# checkpoint's tensors into the variables keras_hub builds (keras_hub, a
# library on Keras, is never imported by this package): its rows of the
# patch table are applied once keras_hub imports it (`_patches.after_import`).
KERAS_HUB_SAFETENSORS_MODULE = (
    "keras_hub.src.utils.transformers.safetensor_utils"
)


def keras_hub_safetensor_loader(module):
    """keras_hub's `SafetensorLoader`, of its imported module
    `KERAS_HUB_SAFETENSORS_MODULE`."""
    return module.SafetensorLoader


def keras_hub_safetensors_paths(module):
    """The owner of the `get_file` keras_hub's `SafetensorLoader` calls for
    a safetensors file's local path just before opening it: the imported
    module `KERAS_HUB_SAFETENSORS_MODULE` itself (it calls `get_file(...)`
    as a name of that module)."""
    return module
