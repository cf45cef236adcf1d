"""The one seam between this package and Keras internals (`keras.src`).

The bottom layer: it imports nothing from the package. Every other module
reaches Keras internals only through the names below: the version check,
read-only accessors (private attributes of Keras objects included), the
Keras classes and modules that own patch targets (`_patches.py` lists
them) and the DataAdapter base.

Keras 3.15.x and 3.16 (keras-nightly) are served by one code base: what
differs between them is found by what exists (never by a version string),
in `versions`; `_patches.py` adds the patches only one of them needs.

Its modules, bottom first (every name of both is also a name of this
package: `_keras.TorchAdam`, `_keras.check_environment`):
- `versions`: the supported Keras, and what differs between 3.15 and 3.16
- `owners`: the owners of the attributes the patch table replaces
"""

import contextlib
import time
import types

import keras
from keras.src.backend.common import global_state
from keras.src.backend.common import name_scope
from keras.src.backend.torch import random as torch_random
from keras.src.initializers import constant_initializers
from keras.src.initializers import random_initializers
from keras.src.random import seed_generator
from keras.src.saving import saving_lib
from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters import data_adapter
from keras.src.utils import python_utils
from keras.src.utils import rng_utils

from keras_torch_distribution._keras.owners import *  # noqa: F403
from keras_torch_distribution._keras.versions import *  # noqa: F403
from keras_torch_distribution._keras.versions import BaseTrainer
from keras_torch_distribution._keras.versions import TorchTrainer
from keras_torch_distribution._keras.versions import torch_core

# ---------------------------------------------------------------------------
# Accessors used by the feature modules.
# ---------------------------------------------------------------------------

TorchVariable = torch_core.Variable
torch_device = torch_core.get_device


def default_torch_device():
    """The device Keras' torch backend computes on outside any
    `keras.device` scope ("cuda", "cpu", ...)."""
    return getattr(torch_core, "DEFAULT_DEVICE", None) or str(torch_device())


def set_default_torch_device(name):
    """Make Keras' torch backend compute on `name` outside any
    `keras.device` scope, in every thread and across `clear_session()`:
    the module's DEFAULT_DEVICE, which `get_device()` reads (the global
    attribute "torch_device" that `keras.device` sets is thread-local and
    cleared by `clear_session`, so it serves only where DEFAULT_DEVICE is
    gone)."""
    if hasattr(torch_core, "DEFAULT_DEVICE"):
        torch_core.DEFAULT_DEVICE = name
    else:
        global_state.set_global_attribute("torch_device", name)


def torch_device_scope(name):
    """Keras' `keras.device(name)` scope for the torch backend: tensors
    Keras creates inside it (initializers' draws included) are on `name`."""
    return torch_core.device_scope(name)


to_torch_dtype = torch_core.to_torch_dtype
floatx = keras.config.floatx
epsilon = keras.config.epsilon
result_type = keras.backend.result_type


def convert_to_tensor(x, dtype=None):
    """Keras' torch `convert_to_tensor`, as installed (looked up when
    called, so the package's replacement when it is in place)."""
    return torch_core.convert_to_tensor(x, dtype=dtype)


convert_to_numpy = torch_core.convert_to_numpy
is_torch_dataloader = data_adapters.is_torch_dataloader


def is_data_adapter(x):
    return isinstance(x, data_adapter.DataAdapter)


def is_generator(x):
    return isinstance(x, types.GeneratorType)


def layout_map_layouts(distribution):
    """The TensorLayouts of a ModelParallel's LayoutMap (none for others)."""
    layout_map = getattr(distribution, "_layout_map", None)
    return list(layout_map.values()) if layout_map is not None else []


def layout_map_layout(distribution, path):
    """The TensorLayout a ModelParallel's LayoutMap gives the variable path
    `path` (Keras' lookup: the exact key, else the one key that matches it
    whole as a regular expression); None when none does or the
    distribution has no LayoutMap."""
    layout_map = getattr(distribution, "_layout_map", None)
    return None if layout_map is None else layout_map[path]


def layout_map_keys(distribution):
    """The keys of a ModelParallel's LayoutMap (none for others)."""
    layout_map = getattr(distribution, "_layout_map", None)
    return list(layout_map.keys()) if layout_map is not None else []


def raw_value(variable):
    """A variable's stored tensor (no autocast, no stateless scope); None
    before it is initialized."""
    return getattr(variable, "_value", None)


def layer_kernel(layer):
    """The kernel variable of a Dense / EinsumDense layer (`_kernel`: the
    float kernel, or the quantized one after `quantize`)."""
    return layer._kernel


def einsum_dense_scale_for_quant(layer, inputs_scale):
    """An int8 EinsumDense's inputs scale with its axes aligned to the
    output (Keras' `_adjust_scale_for_quant(scale, "input")`)."""
    return layer._adjust_scale_for_quant(inputs_scale, "input")


def einsum_dense_scale_for_dequant(layer, kernel_scale):
    """An int8 EinsumDense's kernel scale shaped to dequantize its kernel
    (Keras' `_adjust_scale_for_dequant`)."""
    return layer._adjust_scale_for_dequant(kernel_scale)


def einsum_dense_inputs_gradient_equation(layer):
    """The einsum equation of an EinsumDense's inputs' gradient from the
    output's gradient and the kernel (Keras' `_custom_gradient_equation`)."""
    return layer._custom_gradient_equation


def overwritten_with_gradient(variable):
    """True for a variable Keras' optimizers overwrite with its gradient
    (`overwrite_with_gradient`: the float8 layers' scales and amax
    histories, whose "gradient" is their new value), not update from it."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def raw_value_version(variable):
    """The torch version counter of a variable's stored tensor: every
    `assign` (an in-place copy) moves it on."""
    return variable._value._version


def set_raw_value(variable, tensor):
    """Store `tensor` as the variable's value, as Keras' torch backend does."""
    variable._value = tensor


def sublayers(layer, recursive=False):
    """The layers `layer` holds, not itself: its direct ones, or with
    `recursive` every one below it."""
    return list(layer._flatten_layers(include_self=False, recursive=recursive))


ProgbarLogger = keras.callbacks.ProgbarLogger
History = keras.callbacks.History
pythonify_logs = python_utils.pythonify_logs
is_default_callback_method = python_utils.is_default


def progbar_redraws(logger):
    """True when Keras' ProgbarLogger `logger` redraws its bar at its next
    update: it shows a bar per batch (verbose=1) and has none yet, or its
    redraw interval has passed."""
    if getattr(logger, "verbose", 1) != 1:
        return False
    bar = getattr(logger, "progbar", None)
    if bar is None:
        return True
    return time.time() - bar._last_update >= bar.interval


def own_variables(layer):
    """The variables a layer created itself (not its sublayers')."""
    return list(layer._trainable_variables) + list(
        layer._non_trainable_variables
    )


def variable_layout(variable):
    """The layout a variable was created with (None: the distribution's)."""
    return variable._layout


def set_variable_layout(variable, layout):
    variable._layout = layout


def swap_variable_initializer_call(function):
    """Make `function(variable, initializer)` what a torch Variable calls
    to initialise itself from an initializer (`ktd plan`'s unwritten
    variables); returns the function it replaces, to be swapped back."""
    previous = TorchVariable.__dict__["_initialize_with_initializer"]
    TorchVariable._initialize_with_initializer = function
    return previous


def stored_shape(variable):
    return tuple(variable._shape)


def stored_dtype(variable):
    """The variable's own dtype (not the autocast dtype of the moment)."""
    return variable._dtype


def set_stored_shape(variable, shape):
    """Check `shape` as Keras does for an initial value and record it."""
    variable._shape = variable._validate_shape(tuple(shape))


def h5_store_dataset(store, key):
    """The h5py Dataset a Keras H5 weight store's `store[key]` reads (of
    the entry `store.get(path)` opened), checked as Keras checks it
    (`safe_get_h5_dataset`: no shape or decompression bomb)."""
    return saving_lib.safe_get_h5_dataset(store._h5_entry_group, key)


def h5_store_reading(store):
    """True for a Keras H5 weight store opened for reading."""
    return getattr(store, "mode", None) == "r"


def h5_store_on_disk(store):
    """True when a Keras H5 weight store reads files on disk (not inside a
    `.keras` archive or from memory): a file it closes can be opened again."""
    return getattr(store, "archive", None) is None


def backup_position(callback):
    """(epoch, batch) a BackupAndRestore callback is at, for its checkpoint."""
    return callback._current_epoch, callback._last_batch_seen


def optimizer_variables(optimizer):
    """The trainable variables an optimizer was built with."""
    return optimizer._trainable_variables


def adam_slots(optimizer, variables):
    """(momentums, velocities, velocity hats or None) of `variables`, as
    tensors, in the order of `variables` (Keras' Adam and AdamW)."""

    def slots(kind):
        return [kind[optimizer._get_variable_index(v)].value for v in variables]

    hats = slots(optimizer._velocity_hats) if optimizer.amsgrad else None
    return slots(optimizer._momentums), slots(optimizer._velocities), hats


def sgd_momentum(optimizer, variable):
    """The momentum buffer (a tensor) of `variable` in Keras' SGD."""
    return optimizer.momentums[optimizer._get_variable_index(variable)].value


DataAdapter = data_adapter.DataAdapter  # the base class of Keras' data adapters


def backup_skips_batch_saves(callback):
    """True for `BackupAndRestore(save_freq=False)`: Keras takes False for
    the integer 0 and saves after every batch; here it means "no periodic
    saves" (only at a preemption)."""
    return callback.save_freq is False


def epoch_iterator_source(iterator):
    """The iterator of batches a Keras EpochIterator draws from now (None
    before its first, and between epochs when it makes a new one)."""
    return iterator._current_iterator


def epoch_iterator_makes_new_source_each_epoch(iterator):
    """True when the EpochIterator starts each epoch with a new iterator of
    batches (`steps_per_epoch` unset); False when one iterator goes on
    across epochs."""
    return iterator.steps_per_epoch is None


def epoch_iterator_steps_per_execution(iterator):
    return iterator.steps_per_execution


def epoch_iterator_data_adapter(iterator):
    return iterator.data_adapter


def data_adapter_epoch(adapter):
    """The epoch count a Keras data adapter seeds its shuffle with
    (`_epoch`: Keras 3.16's array and PyDataset adapters); None where it
    has none (Keras 3.15 shuffles with torch's global generator)."""
    value = getattr(adapter, "_epoch", None)
    return value if isinstance(value, int) else None


def set_data_adapter_epoch(adapter, epoch):
    adapter._epoch = epoch


def add_epoch_iterator_batches_seen(iterator, count):
    """Count `count` batches taken from the EpochIterator's source outside
    its own loop (it makes a new source once its count reaches the number
    of batches)."""
    iterator._steps_seen += count


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
    unseeded_generator = (
        is_keras_seed_generator(seed) and seed._initial_seed is None
    )
    return (
        seed is not None and not unseeded_generator
    ) or noise_shape is not None


def batch_norm_reduction_axes(layer):
    """The axes a BatchNormalization layer reduces over (all but its axis)."""
    return layer._reduction_axes


def model_step_function(model, kind):
    """`model.train_function`, `test_function` or `predict_function`."""
    return getattr(model, f"{kind}_function")


def set_model_step_function(model, kind, function):
    setattr(model, f"{kind}_function", function)


def uses_keras_train_step(model):
    """True when `model`'s train_step is Keras' torch one (which clears
    the last step's gradients itself, after its forward)."""
    return type(model).train_step is TorchTrainer.train_step


@contextlib.contextmanager
def train_step_calls_backward(model):
    """Within the block, Keras' torch `train_step` takes gradients with
    `loss.backward()`, as 3.15's always does. Keras 3.16's calls
    `torch.autograd.grad` instead when `model.jit_compile` is True and no
    DDP wraps the model (so that dynamo traces the whole step); the
    package's compiled step runs that step eagerly and compiles only the
    forward (`_training.compiled`), and only `backward()` fires the
    gradient hooks that overlap the all-reduce with backward. The block
    hides `jit_compile` (the private `_jit_compile` the property reads);
    3.15's train_step does not read it."""
    saved = model.__dict__.get("_jit_compile", None)
    if saved is not True:
        yield
        return
    model._jit_compile = False
    try:
        yield
    finally:
        model._jit_compile = saved


def metrics_result_of_this_process(model):
    """Keras' `get_metrics_result` of the trainer base: this process's
    metric states only. Keras 3.16's torch trainer all-reduces them over
    the batch axis' process group (or the whole world) first; 3.15's does
    not."""
    return BaseTrainer.get_metrics_result(model)


def current_name_scope():
    """The path of the Keras name scope open now ('' outside any), e.g. a
    layer's path while Keras lays out its output."""
    return name_scope.current_path()


def in_outer_call():
    """True when no Keras layer call is in progress (the next is outermost)."""
    return global_state.get_global_attribute("current_call_ctx") is None


def current_call_context():
    """The Keras `CallContext` of the layer call in progress (None outside
    any): its entry layer and the `training` value it passes down."""
    return global_state.get_global_attribute("current_call_ctx")


def remat_mode(operation):
    """The `RematScope` an operation (a layer) was created in: its `mode`,
    `output_size_threshold` and `layer_names`; None outside any."""
    return operation._remat_mode


@contextlib.contextmanager
def call_context(context):
    """Within the block, `context` is Keras' current layer-call context
    (the one in progress before is put back after)."""
    saved = global_state.get_global_attribute("current_call_ctx")
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", saved)


RECORDABLE_INITIALIZER_CALLS = tuple(
    cls.__call__
    for cls in (
        random_initializers.RandomNormal,
        random_initializers.TruncatedNormal,
        random_initializers.RandomUniform,
        random_initializers.VarianceScaling,
    )
)


@contextlib.contextmanager
def initializers_drawing_from(random_module):
    """Within the block, Keras' random initializers call `random_module`'s
    normal / truncated_normal / uniform instead of keras.random's."""
    saved = random_initializers.random
    random_initializers.random = random_module
    try:
        yield
    finally:
        random_initializers.random = saved


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
