"""The one seam between this package and Keras internals (`keras.src`).

Every other module of the package reaches Keras internals only through the
functions below. `install()` checks that every patch target exists before
changing anything, keeps the originals, and `uninstall()` puts them back.
"""

import contextlib
import os

import keras
from keras.src import backend as keras_backend
from keras.src.backend.common import global_state
from keras.src.backend.torch import core as torch_core
from keras.src.backend.torch import nn as torch_nn
from keras.src.backend.torch import random as torch_random
from keras.src.distribution import distribution_lib as keras_distribution_lib
from keras.src.initializers import constant_initializers
from keras.src.initializers import random_initializers
from keras.src.layers.normalization import batch_normalization
from keras.src.layers import layer as keras_layer
from keras.src.models import model as keras_model
from keras.src.optimizers import base_optimizer
from keras.src.random import seed_generator
from keras.src.trainers import data_adapters
from keras.src.trainers import epoch_iterator
from keras.src.backend.torch import trainer as torch_trainer
from keras.src.backend.torch.optimizers import torch_adam
from keras.src.trainers.data_adapters import data_adapter
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.utils import rng_utils

SUPPORTED_KERAS = ((3, 15, 1), (3, 16, 0))  # [min, max)
SUPPORTED_KERAS_TEXT = ">=3.15.1,<3.16"


def _parse_version(text):
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_environment():
    """Raise if Keras' backend or version is not one this package supports."""
    backend_name = keras.backend.backend()
    if backend_name != "torch":
        raise ImportError(
            "keras_torch_distribution needs the torch backend of Keras, but "
            f"Keras runs the {backend_name!r} backend. Set "
            "KERAS_BACKEND=torch before importing keras (for example "
            "`KERAS_BACKEND=torch python train.py`)."
        )
    found = _parse_version(keras.__version__)
    low, high = SUPPORTED_KERAS
    if not (low <= found < high):
        raise ImportError(
            f"keras_torch_distribution supports keras{SUPPORTED_KERAS_TEXT}, "
            f"but keras {keras.__version__} is installed. Install a supported "
            f"version: pip install 'keras{SUPPORTED_KERAS_TEXT}'."
        )


# ---------------------------------------------------------------------------
# Accessors used by the feature modules.
# ---------------------------------------------------------------------------

TorchVariable = torch_core.Variable
KerasTensorLayout = keras_distribution_lib.TensorLayout
KerasDeviceMesh = keras_distribution_lib.DeviceMesh
unpack_x_y_sample_weight = data_adapter_utils.unpack_x_y_sample_weight
torch_device = torch_core.get_device
to_torch_dtype = torch_core.to_torch_dtype
convert_to_numpy = torch_core.convert_to_numpy
is_tf_dataset = data_adapters.is_tf_dataset
is_torch_dataloader = data_adapters.is_torch_dataloader


def is_data_adapter(x):
    return isinstance(x, data_adapter.DataAdapter)


def is_generator(x):
    import types

    return isinstance(x, types.GeneratorType)


def layout_map_layouts(distribution):
    """The TensorLayouts of a ModelParallel's LayoutMap (none for others)."""
    layout_map = getattr(distribution, "_layout_map", None)
    return list(layout_map.values()) if layout_map is not None else []


def raw_value(variable):
    """A variable's stored tensor (no autocast, no stateless scope)."""
    return variable._value


def optimizer_variables(optimizer):
    """The trainable variables an optimizer was built with."""
    return optimizer._trainable_variables


def apply_count(optimizer):
    """How many times `apply` ran (micro-steps, under gradient accumulation)."""
    return int(optimizer._iterations)


def gradient_accumulators(optimizer, variables):
    """The gradient accumulator variable of each of `variables`."""
    return [
        optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
        for v in variables
    ]


def adam_slots(optimizer, variables):
    """(momentums, velocities, velocity hats or None) of `variables`, as
    tensors, in the order of `variables` (Keras' Adam and AdamW)."""

    def slots(kind):
        return [kind[optimizer._get_variable_index(v)].value for v in variables]

    hats = slots(optimizer._velocity_hats) if optimizer.amsgrad else None
    return slots(optimizer._momentums), slots(optimizer._velocities), hats


class _WrappedDataAdapter(data_adapter.DataAdapter):
    """A Keras data adapter whose batches pass through `transform`."""

    def __init__(self, inner, transform, num_batches):
        self._inner = inner
        self._transform = transform
        self._num_batches = num_batches

    def get_numpy_iterator(self):
        return self._transform(self._inner.get_numpy_iterator())

    def get_torch_dataloader(self):
        return self._transform(self._inner.get_torch_dataloader())

    @property
    def num_batches(self):
        return self._num_batches

    @property
    def batch_size(self):
        return self._inner.batch_size

    @property
    def has_partial_batch(self):
        return self._inner.has_partial_batch

    @property
    def partial_batch_size(self):
        return self._inner.partial_batch_size

    def on_epoch_begin(self):
        self._inner.on_epoch_begin()

    def on_epoch_end(self):
        self._inner.on_epoch_end()


def wrap_data_adapter(adapter, transform, num_batches):
    return _WrappedDataAdapter(adapter, transform, num_batches)


def set_initial_epoch(model, epoch):
    """Make the next `fit` start at `epoch` (as BackupAndRestore does)."""
    model._initial_epoch = epoch


def layer_seed_states(model):
    """(layer name, [state variables of its SeedGenerators]) for every layer
    of `model`, nested ones included."""
    return [
        (layer.name, [generator.state for generator in layer._seed_generators])
        for layer in model._flatten_layers(include_self=True, recursive=True)
    ]


def current_distribution():
    """The distribution set with `keras.distribution.set_distribution`."""
    return global_state.get_global_attribute("distribution")


@contextlib.contextmanager
def distribution_hidden():
    """Hide the current distribution from Keras code run inside the block."""
    saved = current_distribution()
    global_state.set_global_attribute("distribution", None)
    try:
        yield saved
    finally:
        global_state.set_global_attribute("distribution", saved)


def get_random_seed():
    return rng_utils.get_random_seed()


def set_random_seed(seed):
    rng_utils.set_random_seed(seed)


def keras_generator_for_seed(seed):
    """The torch.Generator Keras' torch backend makes for `seed` (a seed int
    or a SeedGenerator, which this advances exactly as Keras would)."""
    return torch_random.torch_seed_generator(seed)


def is_keras_seed_generator(seed):
    """True for a `keras.random.SeedGenerator` (a layer's running seed)."""
    return isinstance(seed, seed_generator.SeedGenerator)


def dropout_uses_seed(seed, noise_shape):
    """True when Keras' torch `dropout` draws its mask from `seed` (a
    torch.Generator made from it), False when it calls torch's unseeded
    `F.dropout` (torch's global generator): the test Keras makes."""
    unseeded_generator = is_keras_seed_generator(seed) and seed._initial_seed is None
    return (seed is not None and not unseeded_generator) or noise_shape is not None


def batch_norm_reduction_axes(layer):
    """The axes a BatchNormalization layer reduces over (all but its axis)."""
    return layer._reduction_axes


def model_step_function(model, kind):
    """`model.train_function`, `test_function` or `predict_function`."""
    return getattr(model, f"{kind}_function")


def set_model_step_function(model, kind, function):
    setattr(model, f"{kind}_function", function)


def in_outer_call():
    """True when no Keras layer call is in progress (the next is outermost)."""
    return global_state.get_global_attribute("current_call_ctx") is None


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
        return RandomCall("truncated_normal", shape, dtype, seed, (mean, stddev))

    @staticmethod
    def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
        return RandomCall("uniform", shape, dtype, seed, (minval, maxval))


_RECORDABLE_CALLS = tuple(
    cls.__call__
    for cls in (
        random_initializers.RandomNormal,
        random_initializers.TruncatedNormal,
        random_initializers.RandomUniform,
        random_initializers.VarianceScaling,
    )
)


def record_random_initializer(initializer, shape, dtype):
    """The `RandomCall` a built-in random initializer would make for `shape`,
    without drawing anything; None for any other initializer."""
    if type(initializer).__call__ not in _RECORDABLE_CALLS:
        return None
    saved = random_initializers.random
    random_initializers.random = _RandomRecorder
    try:
        call = initializer(shape, dtype=dtype)
    finally:
        random_initializers.random = saved
    return call if isinstance(call, RandomCall) else None


def initializer_kind(initializer):
    """'zeros', 'ones', 'constant', 'identity' or None."""
    kinds = {
        constant_initializers.Zeros: "zeros",
        constant_initializers.Ones: "ones",
        constant_initializers.Constant: "constant",
        constant_initializers.Identity: "identity",
    }
    for cls, kind in kinds.items():
        if type(initializer).__call__ is cls.__call__:
            return kind
    return None


# ---------------------------------------------------------------------------
# The patch table.
# ---------------------------------------------------------------------------


class Patch:
    """Replace `owner.name` with `replacement`; `wrap=True` passes the
    original as the replacement's first argument."""

    def __init__(self, owner, name, replacement, wrap=False):
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.wrap = wrap
        self.original = None

    def describe(self):
        owner = getattr(self.owner, "__qualname__", None) or getattr(
            self.owner, "__name__", repr(self.owner)
        )
        return f"{owner}.{self.name}"


_MISSING = object()
_installed = []


def _patch_table():
    from keras_torch_distribution import boundary
    from keras_torch_distribution import checkpoint
    from keras_torch_distribution import compiled
    from keras_torch_distribution import data
    from keras_torch_distribution import distribution_lib
    from keras_torch_distribution import optimizer_update
    from keras_torch_distribution import random_slices
    from keras_torch_distribution import replica_start
    from keras_torch_distribution import sync_batch_norm
    from keras_torch_distribution import saving
    from keras_torch_distribution import tensors
    from keras_torch_distribution import trainer
    from keras_torch_distribution import variables

    return [
        Patch(keras_backend, "distribution_lib", distribution_lib),
        Patch(keras_distribution_lib, "distribution_lib", distribution_lib),
        Patch(TorchVariable, "_initialize", variables.initialize, wrap=True),
        Patch(
            TorchVariable,
            "_initialize_with_initializer",
            variables.initialize_with_initializer,
            wrap=True,
        ),
        Patch(TorchVariable, "_direct_assign", variables.direct_assign, wrap=True),
        Patch(TorchVariable, "__array__", variables.to_numpy, wrap=True),
        Patch(TorchVariable, "__repr__", variables.describe, wrap=True),
        Patch(TorchVariable, "_maybe_autocast", variables.value_for_use, wrap=True),
        Patch(keras_backend, "convert_to_numpy", tensors.to_numpy, wrap=True),
        Patch(
            torch_nn,
            "_can_use_flash_attention",
            compiled.can_use_flash_attention,
            wrap=True,
        ),
        Patch(keras_layer.Layer, "__call__", boundary.layer_call, wrap=True),
        # A replica's rows (and a sharded activation's columns) of the random
        # draws one process makes for the global batch.
        Patch(torch_random, "dropout", random_slices.dropout, wrap=True),
        Patch(torch_random, "normal", random_slices.normal, wrap=True),
        Patch(torch_random, "uniform", random_slices.uniform, wrap=True),
        Patch(torch_random, "randint", random_slices.randint, wrap=True),
        # Moments over the global batch (all replicas' rows).
        Patch(
            batch_normalization.BatchNormalization,
            "_moments",
            sync_batch_norm.moments,
            wrap=True,
        ),
        Patch(base_optimizer.BaseOptimizer, "apply", trainer.optimizer_apply, wrap=True),
        Patch(
            torch_adam.Adam,
            "_parallel_update_step",
            optimizer_update.adam_update,
            wrap=True,
        ),
        Patch(
            keras_model.Model, "get_metrics_result", trainer.metrics_result, wrap=True
        ),
        Patch(epoch_iterator.data_adapters, "get_data_adapter", data.get_data_adapter, wrap=True),
        Patch(
            torch_trainer.TorchTrainer,
            "make_train_function",
            replica_start.make_train_function,
            wrap=True,
        ),
        Patch(
            torch_trainer.TorchTrainer,
            "make_test_function",
            replica_start.make_test_function,
            wrap=True,
        ),
        Patch(
            torch_trainer.TorchTrainer,
            "make_predict_function",
            replica_start.make_predict_function,
            wrap=True,
        ),
        Patch(keras_model.Model, "fit", trainer.quiet_on_other_ranks, wrap=True),
        Patch(keras_model.Model, "save", saving.save, wrap=True),
        Patch(keras_model.Model, "save_weights", saving.save_weights, wrap=True),
        Patch(keras_model.Model, "evaluate", trainer.quiet_on_other_ranks, wrap=True),
        Patch(keras_model.Model, "predict", trainer.quiet_on_other_ranks, wrap=True),
        Patch(keras.callbacks.BackupAndRestore, "_save_model", checkpoint.backup_save, wrap=True),
        Patch(keras.callbacks.BackupAndRestore, "_load_model", checkpoint.backup_load, wrap=True),
        Patch(
            keras.callbacks.BackupAndRestore,
            "on_train_end",
            checkpoint.backup_train_end,
            wrap=True,
        ),
    ]


def _bind(patch):
    if not patch.wrap:
        return patch.replacement
    original, replacement = patch.original, patch.replacement

    def patched(*args, **kwargs):
        return replacement(original, *args, **kwargs)

    patched.__name__ = getattr(original, "__name__", patch.name)
    patched.__doc__ = getattr(original, "__doc__", None)
    patched.__wrapped__ = original
    return patched


def install():
    """Install the torch distribution backend into Keras. Idempotent."""
    if _installed:
        return
    check_environment()
    table = _patch_table()
    missing = [p.describe() for p in table if not hasattr(p.owner, p.name)]
    if missing:
        raise ImportError(
            "keras_torch_distribution cannot install into keras "
            f"{keras.__version__}: these internals are missing: {missing}. "
            f"Use keras{SUPPORTED_KERAS_TEXT}."
        )
    for patch in table:
        patch.original = patch.owner.__dict__.get(patch.name, _MISSING)
        if patch.original is _MISSING:
            patch.original = getattr(patch.owner, patch.name)
            patch.inherited = True
        else:
            patch.inherited = False
    for patch in table:
        setattr(patch.owner, patch.name, _bind(patch))
        _installed.append(patch)
    from keras_torch_distribution import variables

    variables.enable_implicit_replication()
    from keras_torch_distribution import sharding_rules

    sharding_rules.register()


def uninstall():
    """Put back every original Keras attribute `install()` replaced."""
    from keras_torch_distribution import variables

    if not _installed:
        return
    variables.disable_implicit_replication()
    while _installed:
        patch = _installed.pop()
        if patch.inherited:
            delattr(patch.owner, patch.name)
        else:
            setattr(patch.owner, patch.name, patch.original)


def is_installed():
    return bool(_installed)


def keras_src_modules_outside_seam(package_dir):
    """Files of the package (other than this one) that import `keras.src`."""
    offenders = []
    for name in sorted(os.listdir(package_dir)):
        if not name.endswith(".py") or name == os.path.basename(__file__):
            continue
        with open(os.path.join(package_dir, name), encoding="utf-8") as f:
            text = f.read()
        if "keras.src" in text or "from keras import src" in text:
            offenders.append(name)
    return offenders
