"""Which Keras this package supports, and what differs between the
versions it serves (3.15.x and 3.16, keras-nightly), found by what exists,
never by a version string: where the torch backend's ops modules live
(the imports just below), the trainer classes, where `convert_to_numpy`
and `convert_to_tensor` are looked up, the weight file stores, and what
Keras 3.16's torch backend distributes by itself. `differences()` says
what was found (for the warning on a newer Keras).
"""

import importlib
import pkgutil

import keras
from keras.src import backend as keras_backend

try:  # Keras 3.15: the torch backend's ops are modules of the backend
    from keras.src.backend.torch import core as torch_core
    from keras.src.backend.torch import nn as torch_nn
    from keras.src.backend.torch import numpy as torch_numpy
except ImportError:
    try:  # Keras 3.16: they moved to backend.torch.ops
        from keras.src.backend.torch.ops import core as torch_core
        from keras.src.backend.torch.ops import nn as torch_nn
        from keras.src.backend.torch.ops import numpy as torch_numpy
    except ImportError as error:
        raise ImportError(
            "keras_torch_distribution cannot find the torch backend's core, "
            "nn and numpy modules in keras "
            f"{keras.__version__} (looked in keras.src.backend.torch, as in "
            "Keras 3.15, and keras.src.backend.torch.ops, as in 3.16: "
            f"{error}). Install a supported Keras: pip install "
            "'keras>=3.15.1,<3.17'."
        ) from error
from keras.src.backend.torch import trainer as torch_trainer
from keras.src.saving import saving_lib
from keras.src.trainers import trainer as base_trainer

__all__ = [
    "SUPPORTED_KERAS",
    "SUPPORTED_KERAS_TEXT",
    "TESTED_KERAS_TEXT",
    "check_environment",
    "newer_keras",
    "differences",
    "TorchTrainer",
    "BaseTrainer",
    "torch_trainer_module",
    "TorchEpochIterator",
    "CONVERT_TO_NUMPY_OWNERS",
    "CONVERT_TO_TENSOR_OWNERS",
    "REMAT_OWNERS",
    "keras_saving_lib_module",
    "H5IOStore",
    "KERAS_FILE_STORES",
    "NATIVE_TORCH_TRAINING",
    "NATIVE_VARIABLE_DISTRIBUTION",
    "Float8Strategy",
    "torch_core",
    "torch_nn",
    "torch_numpy",
]

SUPPORTED_KERAS = ((3, 15, 1), (3, 17, 0))  # [min, max): the ones tested
SUPPORTED_KERAS_TEXT = ">=3.15.1,<3.17"
TESTED_KERAS_TEXT = "3.15.1 and keras-nightly 3.16.0.dev2026102704"


def _parse_version(text):
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_environment():
    """Raise if Keras' backend is not torch or Keras is older than any this
    package supports. A Keras newer than any it knows is not refused here:
    `install()` checks what it needs exists and warns (`newer_keras`)."""
    backend_name = keras.backend.backend()
    if backend_name != "torch":
        raise ImportError(
            "keras_torch_distribution needs the torch backend of Keras, but "
            f"Keras runs the {backend_name!r} backend. Set "
            "KERAS_BACKEND=torch before importing keras (for example "
            "`KERAS_BACKEND=torch python train.py`)."
        )
    found = _parse_version(keras.__version__)
    if found < SUPPORTED_KERAS[0]:
        raise ImportError(
            f"keras_torch_distribution supports keras{SUPPORTED_KERAS_TEXT}, "
            f"but keras {keras.__version__} is installed. Install a supported "
            f"version: pip install 'keras{SUPPORTED_KERAS_TEXT}'."
        )


def newer_keras():
    """True when the installed Keras is newer than any this package was
    tested with (it may still work: `install()` checks its patch targets
    and warns once)."""
    return _parse_version(keras.__version__) >= SUPPORTED_KERAS[1]


def differences():
    """What this package found in the installed Keras where 3.15 and 3.16
    differ, one line each (for the warning on a newer Keras)."""
    return [
        f"torch backend ops in {torch_core.__name__.rsplit('.', 1)[0]}",
        f"torch trainer class {TorchTrainer.__name__}",
        "convert_to_numpy called on "
        + ", ".join(m.__name__ for m in CONVERT_TO_NUMPY_OWNERS),
        "Keras file stores " + ", ".join(c.__name__ for c in KERAS_FILE_STORES),
        "the torch trainer distributes data and wraps DDP itself: "
        + ("yes" if NATIVE_TORCH_TRAINING else "no"),
        "torch Variables distribute themselves: "
        + ("yes" if NATIVE_VARIABLE_DISTRIBUTION else "no"),
    ]


# The torch trainer: `TorchTrainer` (3.15), `Trainer` (3.16); the trainer
# base class: `Trainer` (3.15), `BaseTrainer` (3.16).
TorchTrainer = getattr(torch_trainer, "TorchTrainer", None) or getattr(
    torch_trainer, "Trainer", None
)
if TorchTrainer is None:
    raise ImportError(
        "keras_torch_distribution cannot find Keras' torch trainer class in "
        f"keras {keras.__version__} (expected TorchTrainer, as in Keras "
        "3.15, or Trainer, as in 3.16, in keras.src.backend.torch.trainer). "
        f"Install a supported Keras: pip install 'keras{SUPPORTED_KERAS_TEXT}'."
    )
BaseTrainer = getattr(base_trainer, "BaseTrainer", None) or (
    base_trainer.Trainer
)
torch_trainer_module = torch_trainer
TorchEpochIterator = torch_trainer.TorchEpochIterator

# Where Keras looks `convert_to_numpy` up: `backend.convert_to_numpy`
# (3.15); `backend.ops.convert_to_numpy` and, from `keras.ops` and the
# torch Variable, `backend.ops.core.convert_to_numpy` (3.16).
CONVERT_TO_NUMPY_OWNERS = (
    (keras_backend,)
    if hasattr(keras_backend, "convert_to_numpy")
    else (keras_backend.ops, torch_core)
)


def _torch_backend_modules():
    """`keras.src.backend` (and its `ops` in 3.16) and every module of the
    torch backend package (3.15: `backend.torch.*`; 3.16 adds
    `backend.torch.ops.*`), imported."""
    package = importlib.import_module("keras.src.backend.torch")
    found = [keras_backend, getattr(keras_backend, "ops", None), package]
    prefix = package.__name__ + "."
    for info in pkgutil.walk_packages(package.__path__, prefix):
        if not info.name.endswith("_test"):
            found.append(importlib.import_module(info.name))
    return [module for module in found if module is not None]


# Every module that binds the torch backend's `convert_to_tensor` by name
# (`from ...core import convert_to_tensor`): Keras' ops call it through
# their own module's name, so a replacement must be set in each.
CONVERT_TO_TENSOR_OWNERS = tuple(
    module
    for module in _torch_backend_modules()
    if module.__dict__.get("convert_to_tensor") is torch_core.convert_to_tensor
)

# Every module that binds the torch backend's `remat`: 3.15's
# `backend.torch.core`; 3.16's `backend.torch.ops.core` and the
# `backend.torch.ops` package (a star import), whose `remat` is the one
# `keras.remat` and `RematScope` call (`backend.ops.remat`).
REMAT_OWNERS = tuple(
    module
    for module in _torch_backend_modules()
    if module.__dict__.get("remat") is torch_core.remat
)

# `is_memory_sufficient` and `_load_model_from_fileobj`, which `saving_lib`
# looks up as globals of its own module (when it opens a `.keras` archive's
# weights; when `load_model` loads an archive).
keras_saving_lib_module = saving_lib

# Keras' HDF5 weight store (`.weights.h5`, `.keras`; `ShardedH5IOStore`
# reads through its `__getitem__`).
H5IOStore = saving_lib.H5IOStore

# Keras' weight file stores (`NpzIOStore` is gone in 3.16).
KERAS_FILE_STORES = tuple(
    getattr(saving_lib, name)
    for name in ("H5IOStore", "ShardedH5IOStore", "NpzIOStore")
    if hasattr(saving_lib, name)
)

# Keras 3.16's torch trainer distributes data itself under ModelParallel
# (each batch wrapped as a DTensor of the global batch, by the epoch
# iterator's numpy path and `train/test/predict_on_batch`), wraps the
# model in DistributedDataParallel whenever a process group exists (but
# under ModelParallel), and all-reduces metric states. The package does
# all three itself (`_patches.py` turns the native ones off).
NATIVE_TORCH_TRAINING = hasattr(torch_trainer, "distribute_data_input")

# Keras 3.16's torch train_step takes gradients with torch.autograd.grad
# under jit_compile: `train_step_calls_backward` (harmless on 3.15, whose
# train_step always calls backward).

# Keras 3.16's torch Variable distributes itself when created under a
# distribution (`_initialize_distributed`, called from `_initialize` and
# `_initialize_with_initializer`); the package's born-sharded variables
# replace it (`_patches.py`).
NATIVE_VARIABLE_DISTRIBUTION = hasattr(
    torch_core.Variable, "_initialize_distributed"
)


# Keras' float8 layer call: the layers' own `_float8_call` in 3.15; in
# 3.16 the float8 mode's strategy, `Float8Strategy.call(layer, inputs,
# training)` (keras.src.quantizers.modes.float8), with the same formula.
# None on 3.15.
try:
    from keras.src.quantizers.modes.float8 import Float8Strategy
except ImportError:
    Float8Strategy = None
