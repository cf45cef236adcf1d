"""Born-sharded Keras variables on the torch backend.

A variable whose layout shards at least one dim holds a `torch.nn.Parameter`
wrapping a DTensor on its layout's mesh; each rank allocates and initializes
only its own block (see `sharded_init`). A variable whose layout shards
nothing (every variable under DataParallel, replicated ones under
ModelParallel, scalars) stays a plain tensor: plain tensors meet DTensors as
replicated values (torch's implicit replication), and the trainer turns
their gradients back into plain tensors.

Only float and complex variables that are trainable require grad.
"""

import keras
import torch
from torch._guards import CompileContext
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import stored_values
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._variables import copies
from keras_torch_distribution._variables import lora_layouts
from keras_torch_distribution._variables import sharded_init


class VariablesState:
    """Process-wide facts about this process's variables."""

    def __init__(self):
        # True once any variable of this process holds a DTensor: until
        # then gradient sync takes the plain data-parallel paths.
        self.sharded_exist = False
        # The entered `implicit_replication` context while installed.
        self.implicit_replication = None
        # True while a constant initializer fills a plain variable.
        self.initializing_constant = False

    def clear(self):
        self.sharded_exist = False
        self.initializing_constant = False
        disable_implicit_replication()


state = VariablesState()


def has_sharded_variables():
    """True once any variable of this process holds a DTensor."""
    return state.sharded_exist


def is_sharded(variable):
    """True where the variable holds a DTensor (its layout shards it)."""
    return isinstance(_keras.raw_value(variable), DTensor)


def enable_implicit_replication():
    """Let plain tensors meet DTensors as replicated values, process-wide
    while the package is installed, as a plain array meets a sharded one
    anywhere in Keras on JAX: in fit's steps, in direct model calls, in
    custom training loops and in keras_hub's generate alike."""
    if state.implicit_replication is None:
        context = implicit_replication()
        context.__enter__()
        state.implicit_replication = context


def disable_implicit_replication():
    if state.implicit_replication is not None:
        context, state.implicit_replication = state.implicit_replication, None
        context.__exit__(None, None, None)


def sharded_layout(variable):
    """The TorchLayout of a variable whose layout shards it, else None.

    Resolves the layout from the current distribution the first time, as
    Keras does on JAX. Collective the first time a mesh is seen.
    """
    cached = getattr(variable, "_ktd_layout", False)
    if cached is not False:
        return cached
    layout = _keras.variable_layout(variable)
    if layout is None:
        distribution = _keras.current_distribution()
        if distribution is not None:
            layout = lora_layouts.derived_layout(
                distribution, variable
            ) or distribution.get_variable_layout(variable)
            _keras.set_variable_layout(variable, layout)
    torch_layout = None
    if isinstance(layout, layouts.TorchLayout):
        torch_layout = layout
    elif layout is not None:
        layouts.check_rank(
            layout, variable.shape, f"variable {variable.path!r}"
        )
        if any(axis is not None for axis in layout.axes):
            torch_layout = layout.backend_layout
    if torch_layout is not None:
        torch_layout = layouts.for_variable(
            torch_layout,
            variable.shape,
            f"variable {variable.path!r}",
            path=variable.path,
        )
        if not torch_layout.is_sharded:
            torch_layout = None
    distribution = _keras.current_distribution()
    variable._ktd_layout = torch_layout
    variable._ktd_distributed = distribution is not None
    variable._ktd_gather = None
    variable._ktd_compute = None
    if torch_layout is not None and distribution is not None:
        batch_axis = distribution.batch_dim_name
        variable._ktd_gather = gathering.plan_for(
            torch_layout, variable.shape, batch_axis
        )
        if variable._ktd_gather is None:
            compute = layouts.compute_layout(torch_layout, batch_axis)
            if compute is not torch_layout:
                variable._ktd_compute = compute
    return torch_layout


def value_for_use(original, variable, value):
    """Keras `Variable._maybe_autocast`, which every read of a variable's
    value goes through: inside a layer call, a variable sharded on the batch
    axis is gathered along it for use (see `_fsdp.gathering`), after Keras'
    autocast (so mixed precision gathers in the compute dtype); a variable
    whose mesh has a batch axis it is replicated on is used on the mesh of
    the other axes (`layouts.compute_layout`: no collective of a layer
    crosses the batch axis). Outside layer calls, and while Keras traces
    shapes on the meta device, the stored value. Under mixed precision the
    gather carries the compute dtype and the gradient is reduced in the
    stored one (see `_fsdp.gathering`)."""
    raw, value = value, original(variable, value)
    plan = variable.__dict__.get("_ktd_gather")
    compute = variable.__dict__.get("_ktd_compute")
    if (
        (plan is None and compute is None)
        or not isinstance(value, DTensor)
        or _keras.in_outer_call()
        or str(_keras.torch_device()) == "meta"
    ):
        return value
    if plan is None:
        stored = variable.__dict__.get("_ktd_layout")
        if tuple(value.placements) != tuple(stored.placements):
            return value
        return tensors.for_compute(value, compute)
    if tuple(value.placements) != plan.stored:
        return value
    return gathering.gather_for_use(value, plan, variable, raw)


def warn_if_created_outside(variables, distribution):
    """Warn (once per variable) about variables created with no distribution
    set that the current distribution would shard: they stay whole on every
    rank. Variables created in a stateless scope (not yet initialized) and
    variables given an explicit layout are not concerned."""
    if distribution is None:
        return
    for variable in variables:
        if (
            getattr(variable, "_ktd_distributed", True)
            or _keras.variable_layout(variable) is not None
        ):
            continue
        layout = distribution.get_variable_layout(variable)
        if layout is not None and any(axis is not None for axis in layout.axes):
            warn_once(
                ("created-outside", id(variable)),
                "Variable %r was created with no distribution set, so it is "
                "whole on every rank, but the current distribution would shard "
                "it with axes %s. Create the model after "
                "keras.distribution.set_distribution(...) or inside "
                "distribution.scope().",
                variable.path,
                tuple(layout.axes),
            )


def _requires_grad(variable, tensor):
    return bool(variable.trainable) and (
        tensor.is_floating_point() or tensor.is_complex()
    )


def _set_value(variable, tensor):
    if isinstance(tensor, DTensor):
        state.sharded_exist = True
    _keras.set_raw_value(
        variable,
        torch.nn.Parameter(
            tensor, requires_grad=_requires_grad(variable, tensor)
        ),
    )


def not_natively_distributed(original, variable, initializer):
    """Keras 3.16 torch `Variable._initialize_distributed`: None (Keras then
    initialises the variable as it would with no distribution). Keras 3.16
    distributes a variable's full initial value itself; this package's
    `initialize` / `initialize_with_initializer` create a sharded variable
    shard by shard instead, and keep whole what they keep whole."""
    del original, variable, initializer


def initialize(original, variable, value):
    """Keras `Variable._initialize(value)`: shard a full initial value. Its
    copies on other processes are made equal to the first (`copies`)."""
    if isinstance(value, torch.nn.Parameter):
        _keras.set_raw_value(variable, value)
        return
    _keras.set_stored_shape(variable, value.shape)
    torch_layout = sharded_layout(variable)
    dtype = _keras.to_torch_dtype(_keras.stored_dtype(variable))
    if torch_layout is None:
        tensor = tensors.full_value(tensors.as_torch(value, dtype))
        _set_value(variable, tensor.detach())
    else:
        # Sliced where the value is (numpy: host memory): only this rank's
        # block goes to the device.
        _set_value(
            variable,
            tensors.to_layout(tensors.where_it_is(value, dtype), torch_layout),
        )
    copies.created(variable, constant=state.initializing_constant)


def initialize_with_initializer(original, variable, initializer):
    """Keras `Variable._initialize_with_initializer`: born sharded. Copies
    of a randomly initialized variable are made equal to the first
    (`copies`); constant ones (zeros, ones) are equal anyway."""
    constant = isinstance(initializer, _CONSTANT_INITIALIZERS)
    torch_layout = sharded_layout(variable)
    if torch_layout is None:
        state.initializing_constant = constant
        try:
            return original(variable, initializer)
        finally:
            state.initializing_constant = False
    shape = _keras.stored_shape(variable)
    box = layouts.local_box(shape, torch_layout.mesh, torch_layout.placements)
    block = sharded_init.init_block(
        initializer, shape, _keras.stored_dtype(variable), box, variable.path
    )
    _set_value(variable, tensors.from_local_block(block, torch_layout, shape))
    copies.created(variable, constant=constant)


_CONSTANT_INITIALIZERS = (
    keras.initializers.Zeros,
    keras.initializers.Ones,
    keras.initializers.Constant,
)


def convert_for_assign(original, variable, value, dtype=None):
    """Keras `Variable._convert_to_tensor`, which `assign` (and so
    `set_weights` and weight loading) calls on the new value first: for a
    sharded variable, a value that is not a tensor (a numpy array, a list)
    becomes a CPU tensor (Keras' own conversion, in a CPU device scope), so
    that `direct_assign` slices it on the host and no device holds the
    whole value. Tensors and variables are converted as Keras does.

    A value of a weights file read when used (`stored_values`: a
    `StoredValue` of a `.weights.h5` file, a `TensorFileValue` of a
    safetensors file) stays unread for a sharded variable of its shape:
    `direct_assign` reads only this rank's block. For any other variable
    it is read whole, as Keras reads it."""
    sharded = is_sharded(variable)
    if stored_values.is_stored_value(value):
        if sharded and tuple(value.shape) == tuple(variable.shape):
            return value
        value = value.whole()
    if sharded and not isinstance(value, (torch.Tensor, keras.Variable)):
        with _keras.torch_device_scope("cpu"):
            return original(variable, value, dtype=dtype)
    return original(variable, value, dtype=dtype)


def direct_assign(original, variable, value):
    """Keras `Variable._direct_assign`: reshard the new value into place.
    A value of a weights file (see `convert_for_assign`) is read block by
    block: only this rank's block, straight into its local tensor where
    the dtypes agree (a CPU tensor), else through one block on the host."""
    current = _keras.raw_value(variable)
    if isinstance(current, DTensor):
        torch_layout = sharded_layout(variable)
        if stored_values.is_stored_value(value):
            _assign_stored(current, value, torch_layout)
            return
        new = tensors.to_layout(value, torch_layout)
        with torch.no_grad():
            current.to_local().copy_(new.to_local())
        return
    original(variable, tensors.full_value(value))


def _assign_stored(current, value, torch_layout):
    """Read this rank's block of a weights file's `value` into the local
    tensor of the DTensor `current` (not a collective)."""
    local = current.to_local()
    box = layouts.local_box(
        tuple(current.shape), torch_layout.mesh, torch_layout.placements
    )
    with torch.no_grad():
        if local.device.type == "cpu" and local.dtype == _torch_dtype(value):
            value.read_block(box, into=local)
        else:
            local.copy_(value.read_block(box).reshape(local.shape))


def _torch_dtype(value):
    return _keras.to_torch_dtype(str(value.dtype))


def to_numpy(original, variable, dtype=None, copy=None):
    """Keras `Variable.__array__`: the global value, on every rank,
    assembled in host memory (no device holds the whole variable: Keras'
    `.keras` and `.weights.h5` saves read variables this way).

    Accepts numpy 2's `copy` keyword (`np.array(variable)` passes it); the
    result is always a new array, so `copy=False` cannot be honoured and
    raises, as numpy asks. Collective for sharded variables: call on every
    rank.
    """
    if copy is False:
        raise ValueError(
            f"np.asarray(variable {variable.path!r}, copy=False): a Keras "
            "variable on the torch backend cannot be viewed as a numpy array "
            "without a copy. Use np.asarray(variable) (copy=None)."
        )
    stored = _keras.raw_value(variable)
    if not isinstance(stored, DTensor):
        return original(variable, dtype)
    full = tensors.host_value(stored.detach())  # assembled on the host
    value = _keras.convert_to_numpy(full)
    return value.astype(dtype) if dtype else value


def describe(original, variable):
    """Keras `Variable.__repr__`, which never runs a collective, and while
    torch compiles a frame never reads the value: dynamo on torch
    2.11/2.12 calls `repr` of every variable it builds a guard on, and
    Keras' repr copies the value to the host (on a GPU, a sync per
    variable; pytorch#184796 stops the calls in 2.13)."""
    value = _keras.raw_value(variable)
    if not isinstance(value, DTensor):
        if CompileContext.try_get() is None:
            return original(variable)
        return (
            f"<Variable path={variable.path}, shape={variable.shape}, "
            f"dtype={variable.dtype}>"
        )
    axes = tuple(layouts.resolved_layout(variable).axes)
    return (
        f"<Variable path={variable.path}, shape={variable.shape}, "
        f"dtype={variable.dtype}, layout={axes}, "
        f"local_shape={tuple(value.to_local().shape)}>"
    )


def local_bytes(variable):
    """Bytes this rank holds for a variable."""
    value = _keras.raw_value(variable)
    local = tensors.local_part(value)
    return local.numel() * local.element_size()
