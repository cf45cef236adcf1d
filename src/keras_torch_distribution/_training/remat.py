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
"""

from keras_torch_distribution import _keras


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
