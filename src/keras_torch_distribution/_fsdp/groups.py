"""FSDP by group: one flat all-gather per group of variables, prefetched.

A group is the unit FSDP2 wraps with `fully_shard`: its variables sharded
on the batch axis (see `_fsdp.gathering`) travel together. Under
KTD_FSDP_GROUP=block (the default) a group is an outermost layer below the
models that holds FSDP variables: each decoder block of a keras_hub backbone
(whose layers the backbone, a functional model, calls), the token embedding,
each Dense of a Sequential, each top-level layer of a subclassed model.
KTD_FSDP_GROUP=layer makes each layer's own variables a group (q, k, v and
the output projection of an attention layer apart).

Per call of a group, on the first read of one of its variables:
  forward   one flat all-gather (`flat_shards.FlatGather`) of the group's
            shards; each variable's value is copied out of it. The gathers
            of the next KTD_FSDP_PREFETCH groups (default 1 on CUDA, 0 on
            CPU: see `gathering.prefetch_depth`) of the order
            recorded in the last forward are started before this group
            computes, and waited for just before they are used.
  backward  the regatherer (`gathering._Regatherer`) gathers the group again,
            once, when autograd first unpacks a saved weight of it, and
            starts the regather of the group backward needs next. The last
            group of the forward keeps its gathered weights for backward
            (which starts with it), as FSDP2 keeps its root's.
  gradients one flat reduce-scatter of the group's gradients (each rank's
            first multiplied by its replica's share of the batch), when
            autograd has all of them (`_GroupGather.backward`), which also
            lets go of the group's regathered weights.
A layer that gathers twice in one forward (keras_hub's token embedding:
the lookup first, the output projection with `reverse_embeddings` last)
is split from then on: each of its variables is a bucket of its own,
gathered on its first read in a call, so that each call gathers (and
reduce-scatters) only what it uses, not the whole layer twice (for a
Llama of vocabulary 32000 and width 2048, 250 MiB a matrix). Its calls
have their places in the forward order, but it is never prefetched nor
kept for backward; the group before it is then not the last either (the
last block's weights are not held through the output projection).
A group of one 2-D weight sharded on its dim 1 (keras_hub's token
embeddings) makes the gradient of an embedding lookup of it in the
reduce-scatter's rank-major order itself (`lookup_gradients`).
Mixed precision, as FSDP2's MixedPrecisionPolicy(param_dtype=compute,
reduce_dtype=float32): a bucket is gathered in the dtype its variables
were read in (Keras' autocast: bfloat16 under mixed_bfloat16), learned
from the call before (the first call gathers the stored dtype; the values,
pure copies, are the same), and its gradients are reduce-scattered in the
stored dtype (float32). A read in a wider dtype than the bucket was
gathered in takes the per-variable gather (exact) and the bucket goes back
to the stored dtype.
Variables that cannot travel flat (a dim sharded on the batch axis and on
another axis) and variables read outside a group keep the per-variable
DTensor gather of `_fsdp.gathering`. Under torch.compile no group is formed: the
compiled forward has the per-variable gathers as functional collectives.
"""

import contextlib
import weakref

import keras
import torch

from keras_torch_distribution import _env
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._fsdp import lookup_gradients
from keras_torch_distribution._fsdp.group_calls import _GroupCall
from keras_torch_distribution._fsdp.group_specs import spec_for
from keras_torch_distribution._fsdp.group_specs import state


class _ForwardOrder:
    """The groups one outermost call gathers, in order, against the order
    of the last one: while they match, the next groups' gathers are
    started ahead (at most `prefetch` in flight)."""

    def __init__(self, recorded, prefetch, policy):
        self.recorded = recorded or []
        self.prefetch = prefetch
        self.policy = policy
        self.seen = []
        self.matching = bool(recorded)
        self.pending = {}  # position -> (spec, flats) in flight

    def take(self, layer, spec):
        """The gathers started ahead for this group's call, or None."""
        position = len(self.seen)
        if self.matching and (
            position >= len(self.recorded)
            or self.recorded[position]() is not layer
        ):
            self.matching = False  # the order changed: no more prefetch
            self.drain()
        entry = self.pending.pop(position, None)
        if entry is None:
            return None
        if entry[0] is not spec:
            for flat in entry[1]:
                flat.wait()
            return None
        return entry[1]

    def note(self, layer):
        """Note a call of a split layer (which is not prefetched) in the
        order. Not a collective."""
        position = len(self.seen)
        if self.matching and (
            position >= len(self.recorded)
            or self.recorded[position]() is not layer
        ):
            self.matching = False
            self.drain()
        self.seen.append(weakref.ref(layer))

    def has_seen(self, layer):
        """True when `layer` gathered as a group earlier in this call."""
        return any(ref() is layer for ref in self.seen)

    def is_last(self, layer):
        """True when `layer`, gathering now, is the last group of the
        recorded order (its gathered weights are kept for backward)."""
        position = len(self.seen)
        return (
            self.matching
            and position == len(self.recorded) - 1
            and self.recorded[position]() is layer
        )

    def advance(self, layer):
        """Note `layer`'s gather; start the next groups' gathers.
        Collective: call on every rank."""
        position = len(self.seen)
        self.seen.append(weakref.ref(layer))
        if not self.matching:
            return
        last = min(position + self.prefetch, len(self.recorded) - 1)
        for ahead in range(position + 1, last + 1):
            if ahead in self.pending:
                continue
            upcoming = self.recorded[ahead]()
            spec = None if upcoming is None else spec_for(upcoming, self.policy)
            if spec is None:
                self.matching = False
                self.drain()
                return
            if spec.split:
                continue  # gathered on its own reads, in its call
            self.pending[ahead] = (spec, spec.start_gathers())

    def drain(self):
        """Complete the gathers started ahead and never used."""
        for _, flats in self.pending.values():
            for flat in flats:
                flat.wait()
        self.pending.clear()


@contextlib.contextmanager
def forward_scope(root):
    """Within the block (the outermost call of `root`), group gathers are
    ordered and prefetched as in `root`'s last forward, and this forward's
    order is recorded for the next."""
    if state.forward is not None or torch.compiler.is_compiling():
        yield
        return
    order = _ForwardOrder(
        state.orders.get(root), gathering.prefetch_depth(), _env.fsdp_group()
    )
    state.forward = order
    try:
        yield
    finally:
        state.forward = None
        order.drain()
        if order.seen:
            state.orders[root] = order.seen


@contextlib.contextmanager
def group_scope(layer):
    """Within the block (a call of `layer`), when `layer` is a group (see
    the module docstring), its variables are read from its flat gather."""
    if torch.compiler.is_compiling():
        yield
        return
    policy = (
        state.forward.policy if state.forward is not None else _env.fsdp_group()
    )
    if policy == "block" and (
        gathering.state.groups or isinstance(layer, keras.Model)
    ):
        yield
        return
    if state.forward is not None and state.forward.has_seen(layer):
        state.repeated[layer] = True  # gathers twice per forward: split
    spec = spec_for(layer, policy)
    if spec is None:
        yield
        return
    call = _GroupCall(layer, spec)
    gathering.state.groups.append(call)
    lookups = (
        lookup_gradients.lookups(call.lookups) if spec.has_lookups else None
    )
    try:
        with lookups or contextlib.nullcontext():
            yield
    finally:
        gathering.state.groups.pop()
