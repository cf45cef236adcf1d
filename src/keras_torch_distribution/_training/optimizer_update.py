"""Keras' torch Adam and SGD updates, in place, on local blocks, without
host syncs, compiled into a few kernels under `jit_compile=True`.

Keras' torch `Adam._parallel_update_step` (AdamW inherits it) applies each
step as `torch._foreach_*` ops over all variables, five of them allocating a
new tensor per variable; on DTensor variables every op also pays DTensor
dispatch. On a 2-process CPU run of a 4 x Dense(1024) MLP that update took
about a quarter of the step. `adam_update` computes exactly Keras' formula,
element for element in the same order (so the numbers are bit for bit
Keras'), one variable at a time while it is in cache, in place but for two
scratch tensors per variable, on each rank's local block: a variable, its
gradient (aligned to the variable's layout before the update) and its
moment slots share one layout, so the update is elementwise on local blocks
and needs no communication.

Under `jit_compile=True` (`compiled_updates`, entered by the compiled
step), each variable's plain (or local) blocks are updated by one
`torch.compile`d kernel, Keras' formula fused into one pass over the
memory (the eager foreach sequence makes about ten). One graph serves
every variable: the blocks are viewed as 1-D with a dynamic size. (One
foreach graph over all variables, as torch's compiled optimizers make,
took 59 s to compile for 40 variables and 229 s for 150 on a CPU.)

Keras' torch `SGD._parallel_update_step` passes the learning rate (a
tensor) as the `alpha` of `torch._foreach_add_`, which reads it on the
host: one GPU sync per step. `sgd_update` multiplies by it instead, with
the same sums.
"""

import contextlib

import keras
import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._training import regions


def _local_blocks(tensors):
    """The local blocks of `tensors` when they are all DTensors of one
    layout, or all plain; None when they mix (then DTensor ops are used)."""
    specs = {
        (t.device_mesh, tuple(t.placements))
        for t in tensors
        if isinstance(t, DTensor)
    }
    if not specs:
        return list(tensors)
    if len(specs) > 1 or not all(isinstance(t, DTensor) for t in tensors):
        return None
    return [t.to_local() for t in tensors]


@torch.no_grad()
def adam_update(original, optimizer, grads, keras_variables, learning_rate):
    """Replaces Keras' torch `Adam._parallel_update_step` with the same
    arithmetic. `original` is unused: kept by the seam to put it back."""
    del original
    values = [v.value for v in keras_variables]
    momentums, velocities, velocity_hats = _keras.adam_slots(
        optimizer, keras_variables
    )
    dtype = values[0].dtype
    # As Keras computes it: a 0-dim tensor in the variables' dtype.
    lr = keras.ops.cast(learning_rate, dtype)
    local_step = keras.ops.cast(optimizer.iterations + 1, dtype)
    beta_1_power = keras.ops.power(
        keras.ops.cast(optimizer.beta_1, dtype), local_step
    )
    beta_2_power = keras.ops.power(
        keras.ops.cast(optimizer.beta_2, dtype), local_step
    )
    alpha = lr * keras.ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    beta_1, beta_2, epsilon = (
        optimizer.beta_1,
        optimizer.beta_2,
        optimizer.epsilon,
    )
    hyper = (alpha, beta_1, beta_2, epsilon)
    every = []
    for index, (value, grad) in enumerate(zip(values, grads)):
        slots = [momentums[index], velocities[index]]
        if velocity_hats is not None:
            slots.append(velocity_hats[index])
        blocks = _local_blocks([value, grad] + slots)
        every.append(blocks if blocks is not None else [value, grad] + slots)
    amsgrad = velocity_hats is not None
    scratches = _Scratches()
    if updates.compiled:
        # Detached aliases of the plain blocks: the same storage, without
        # the gradients and autograd history that torch.compile would trace
        # (a DTensor parameter's local block carries its DTensor gradient).
        for blocks in every:
            if any(isinstance(t, DTensor) for t in blocks):  # mixed layouts
                _update_one(blocks, hyper, amsgrad, scratches)
            elif all(t.is_contiguous() for t in blocks):
                updates.run_adam(
                    [_flat_alias(t) for t in blocks], hyper, amsgrad
                )
            else:
                _update_one(blocks, hyper, amsgrad, scratches)
        return
    if not _use_foreach(values[0]):
        for blocks in every:
            _update_one(blocks, hyper, amsgrad, scratches)
        return
    plain = [blocks for blocks in every if not isinstance(blocks[0], DTensor)]
    for chunk in _chunks(plain):
        _update_together(chunk, hyper, amsgrad)
    for blocks in every:
        if isinstance(blocks[0], DTensor):  # layouts that mix: DTensor ops
            _update_one(blocks, hyper, amsgrad, scratches)


def _use_foreach(value):
    """Foreach chunks on CUDA; on the CPU one variable at a time (measured
    there: a quarter of a step less than Keras' foreach, see the module's
    docstring)."""
    return value.is_cuda


# On CUDA the variables are updated in chunks of up to this many bytes of
# variables: a few `torch._foreach_*` kernels per chunk instead of about ten
# per variable, with the transients (grad * grad, the denominator, the
# update) of one chunk, not of the whole model as in Keras' one foreach over
# all (benchmarks/reports/2026-11-gpu-h100.md: a 1.1 B keras_hub Llama step
# on an H100 took 1.15x plain Keras' with the per-variable update, 1.02x
# with chunks).
FOREACH_CHUNK_BYTES = 64 * 2**20


def _chunks(every):
    """`every` (per variable: value, grad, m, v[, v_hat] plain tensors) in runs
    of consecutive variables of one dtype and device up to FOREACH_CHUNK_BYTES
    (a larger variable is a chunk of its own)."""
    limit = FOREACH_CHUNK_BYTES
    chunk, size = [], 0
    for blocks in every:
        value = blocks[0]
        nbytes = value.numel() * value.element_size()
        if chunk and (
            size + nbytes > limit or not _same_kind(chunk[0][0], value)
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(blocks)
        size += nbytes
    if chunk:
        yield chunk


def _same_kind(a, b):
    return (a.dtype, a.device) == (b.dtype, b.device)


def _update_together(chunk, hyper, amsgrad):
    """Keras' formula over a chunk of variables with foreach ops (Keras'
    own sequence: the same numbers)."""
    alpha, beta_1, beta_2, epsilon = hyper
    values, grads, ms, vs = ([blocks[i] for blocks in chunk] for i in range(4))
    torch._foreach_mul_(ms, beta_1)
    torch._foreach_add_(ms, grads, alpha=1 - beta_1)
    torch._foreach_mul_(vs, beta_2)
    torch._foreach_add_(vs, torch._foreach_mul(grads, grads), alpha=1 - beta_2)
    if amsgrad:
        v_hats = [blocks[4] for blocks in chunk]
        torch._foreach_maximum_(v_hats, vs)
        vs = v_hats
    denominators = torch._foreach_sqrt(vs)
    torch._foreach_add_(denominators, epsilon)
    updates = torch._foreach_mul(ms, alpha)
    torch._foreach_div_(updates, denominators)
    torch._foreach_add_(values, updates, alpha=-1)


def _update_one(blocks, hyper, amsgrad, scratches):
    """Keras' formula on one variable, in place but for two scratches."""
    alpha, beta_1, beta_2, epsilon = hyper
    value, grad, m, v = blocks[:4]
    m.mul_(beta_1)
    m.add_(grad, alpha=1 - beta_1)
    scratch = torch.mul(grad, grad, out=scratches.like(0, grad))
    v.mul_(beta_2)
    v.add_(scratch, alpha=1 - beta_2)
    if amsgrad:
        v_hat = blocks[4]
        torch.maximum(v_hat, v, out=v_hat)
        v = v_hat
    if scratch.dtype == v.dtype:
        denominator = torch.sqrt(v, out=scratch)
    else:
        denominator = torch.sqrt(v)
    denominator.add_(epsilon)
    update = torch.mul(m, alpha, out=scratches.like(1, m))
    update.div_(denominator)
    value.add_(update, alpha=-1)


class _Scratches:
    """The update's two scratch tensors, views of buffers kept for the whole
    update (grown to the largest block): one allocation each per update,
    not one per variable (whose few-MiB blocks glibc would keep in its
    heap, split by the tensors allocated after them)."""

    def __init__(self):
        self.buffers = {}  # (slot, dtype, device) -> flat buffer

    def like(self, slot, tensor):
        """A tensor of `tensor`'s shape, dtype and device in scratch `slot`
        (0 or 1), its contents undefined; None for a DTensor (the op then
        allocates its result)."""
        if isinstance(tensor, DTensor):
            return None
        key = (slot, tensor.dtype, tensor.device)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < tensor.numel():
            buffer = self.buffers[key] = torch.empty(
                tensor.numel(), dtype=tensor.dtype, device=tensor.device
            )
        return buffer[: tensor.numel()].view(tensor.shape)


class CompiledUpdates:
    """Whether the update in progress runs compiled (`compiled_updates`),
    and the compiled update of one variable, made once; eager (after one
    warning) once torch.compile cannot run it."""

    def __init__(self):
        self.clear()

    def run_adam(self, blocks, hyper, amsgrad):
        """Keras' Adam on one variable's (plain, 1-D: `_flat_alias`)
        blocks, compiled: one fused kernel. One graph for every variable:
        the size is dynamic (a graph per variable shape, or
        one foreach graph over all variables, took minutes to compile for
        a 150-variable model)."""
        if self._error is None:
            if self._adam is None:
                self._adam = torch.compile(
                    _update_flat,
                    dynamic=True,
                    options={"fx_graph_cache": False},
                )
            try:
                return self._adam(blocks, hyper, amsgrad)
            except Exception as error:
                if regions.unrecoverable_cause(error) is not None:
                    raise
                # Raised while compiling, before any variable changed.
                self._error = error
                warn_once(
                    "jit-compile-optimizer-fallback",
                    "jit_compile=True: torch.compile could not run the "
                    "optimizer update (%s); it runs eagerly from now on, with "
                    "the same numbers.",
                    regions.why_not_compiled(error),
                )
        return _update_flat(blocks, hyper, amsgrad)

    def clear(self):
        self.compiled = False
        self._adam = None
        self._error = None


def _flat_alias(tensor):
    """A 1-D tensor over `tensor`'s (contiguous) memory that is not a view
    of it: no gradient, no autograd history and no base whose shape
    torch.compile would guard on (a view's base made it compile anew for
    every number of dims)."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(
        tensor.untyped_storage(),
        tensor.storage_offset(),
        (tensor.numel(),),
        (1,),
    )


def _update_flat(blocks, hyper, amsgrad):
    """Keras' formula on one variable's 1-D blocks (value, grad, m, v[,
    v_hat]), in Keras' order (compiled, Inductor fuses it)."""
    alpha, beta_1, beta_2, epsilon = hyper
    value, grad, m, v = blocks[:4]
    m.mul_(beta_1)
    m.add_(grad, alpha=1 - beta_1)
    v.mul_(beta_2)
    v.add_(grad * grad, alpha=1 - beta_2)
    if amsgrad:
        v_hat = blocks[4]
        torch.maximum(v_hat, v, out=v_hat)
        v = v_hat
    value.add_(m * alpha / (torch.sqrt(v) + epsilon), alpha=-1)


updates = CompiledUpdates()


@contextlib.contextmanager
def compiled_updates():
    """Within the block (a step of a model compiled with jit_compile=True),
    optimizer updates run through torch.compile."""
    saved = updates.compiled
    updates.compiled = True
    try:
        yield
    finally:
        updates.compiled = saved


@torch.no_grad()
def sgd_update(original, optimizer, grads, keras_variables, learning_rate):
    """Replaces Keras' torch `SGD._parallel_update_step`: the same update,
    the learning rate multiplied in on the device instead of passed as
    `alpha` (which torch reads on the host)."""
    del original
    variables = [v.value for v in keras_variables]
    lr = keras.ops.convert_to_tensor(learning_rate)
    negative_lr = -lr.to(variables[0].dtype)
    if optimizer.momentum != 0:
        bufs = [
            _keras.sgd_momentum(optimizer, variable)
            for variable in keras_variables
        ]
        for i in range(len(bufs)):
            if bufs[i] is None:
                bufs[i] = torch.clone(grads[i]).detach()
        torch._foreach_mul_(bufs, optimizer.momentum)
        torch._foreach_add_(bufs, torch._foreach_mul(grads, negative_lr))
        if optimizer.nesterov:
            torch._foreach_add_(
                variables, torch._foreach_mul(grads, negative_lr)
            )
            torch._foreach_add_(variables, bufs, alpha=optimizer.momentum)
        else:
            torch._foreach_add_(variables, bufs)
    else:
        torch._foreach_add_(variables, torch._foreach_mul(grads, negative_lr))
