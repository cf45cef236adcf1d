"""Rematerialization (`keras.RematScope`, `keras.remat`) under any
distribution.

Keras' torch `remat(f)` runs `f` under `torch.utils.checkpoint.checkpoint`
(non-reentrant): the forward saves only `f`'s inputs, and backward runs
`f` again to recompute what its ops saved, checking that the recompute
saves as many tensors as the forward did. The recompute runs inside
backward, where no Keras layer call is in progress: without help, each
layer `f` calls would take itself for an outermost call (Keras would open
a new call context, clear its losses and forget the `training` value; the
package's boundary would open its own saved-tensor hooks inside the
checkpoint's, which then counts the wrong number of saved tensors).

The rule: the recompute replays the forward's layer calls in the Keras
call context of the forward they replay, so every layer takes the same
path in both (an inner call: the same `training`, the same FSDP group
gathers, partial sums reduced at the same boundaries). FSDP weights are
gathered again during the recompute, as FSDP2 does under torch's
activation checkpointing: a group's gather is redone (one flat all-gather,
the same on every rank, in autograd's order) and lives until backward of
the recomputed segment is done with it; the forward keeps no gathered
weight for it.

`RematScope(mode="larger_than")` decides, layer call by layer call, on the
size of the layer's output. Under a batch axis each replica computes on its
rows, so Keras would compare the replica's output (a fraction of one
process's) with `output_size_threshold`, and ranks holding different row
counts (an uneven last batch) would decide differently: under FSDP one rank
would then gather a group again in its recompute and the other not, and
the job would hang. The rule here: the size is that of the global batch's
output (a dim 0 of this replica's rows counts as the global rows), so the
layers rematerialized are one process's (and JAX's, whose shapes are
global), the same on every rank.
"""

import math

import keras

from keras_torch_distribution import _keras
from keras_torch_distribution._batch import adapter


def remat(original, f):
    """Keras' torch `backend.core.remat`: `f` rematerialized, its recompute
    run in the Keras call context of its forward."""

    def wrapped(*args, **kwargs):
        context = _keras.current_call_context()

        def replay(*a, **k):
            with _keras.call_context(context):
                return f(*a, **k)

        return original(replay)(*args, **kwargs)

    return wrapped


def rematerialized_call(original, operation, fn, *args, **kwargs):
    """Keras' `Operation.rematerialized_call`: under `RematScope(mode=
    "larger_than")`, `fn` rematerialized when the output the global batch
    would give is larger than the threshold (not this replica's rows)."""
    mode = _keras.remat_mode(operation)
    window = adapter.batch_rows()
    if mode is None or mode.mode != "larger_than" or window is None:
        return original(operation, fn, *args, **kwargs)
    spec = operation.compute_output_spec(*args, **kwargs)
    size = sum(
        _global_size(x, window)
        for x in keras.tree.flatten(spec)
        if isinstance(x, keras.KerasTensor)
    )
    if size > mode.output_size_threshold:
        return keras.remat(fn)
    return fn


def _global_size(spec, window):
    """The number of values of output `spec` for the global batch: a dim 0
    of this replica's rows counts as the global batch's rows."""
    global_rows, _, rows = window
    shape = [d or 1 for d in spec.shape]
    if shape and shape[0] == rows:
        shape[0] = global_rows
    return math.prod(shape)
