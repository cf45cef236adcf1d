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
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _env
from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._fsdp import flat_shards
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._fsdp import lookup_gradients


class GroupsState:
    """What grouping keeps between calls."""

    def __init__(self):
        self.clear()

    def clear(self):
        # layer -> (policy, key of its variables' stored values, _GroupSpec
        # or None): a layer's group, rebuilt when a stored value changes.
        self.specs = weakref.WeakKeyDictionary()
        # outermost layer -> [weakref to each group layer, in the order of
        # its last forward's gathers]: what the next forward prefetches.
        self.orders = weakref.WeakKeyDictionary()
        # The _ForwardOrder of the outermost call in progress.
        self.forward = None
        # Layers that gathered twice in one forward: split (see the module
        # docstring), layer -> True.
        self.repeated = weakref.WeakKeyDictionary()


state = GroupsState()


class _Bucket:
    """A group's variables of one batch-axis process group and dtype: one
    flat all-gather, one flat reduce-scatter."""

    def __init__(self, members):
        self.variables = [v for v, _ in members]
        self.plans = [p for _, p in members]
        first = self.plans[0]
        self.group = first.group
        self.ranks = first.replicas
        stored = self.stored()
        self.dtype = stored[0].dtype
        self.device = stored[0].device
        self.shard_shapes = [tuple(s._local_tensor.shape) for s in stored]
        self.layout = flat_shards.FlatLayout(
            self.shard_shapes,
            [p.dim for p in self.plans],
            [p.shape[p.dim] for p in self.plans],
            self.ranks,
        )
        # A lookup of its one weight (a plain tensor once gathered) makes
        # its gradient rank-major itself.
        self.lookup_eligible = first.plain and lookup_gradients.eligible(
            self.layout, [p.shape for p in self.plans]
        )
        # member -> the dtype it was read in (_MIXED: several), for the
        # dtype of the next gathers (see the module docstring).
        self.reads = {}

    def stored(self):
        return [_keras.raw_value(v) for v in self.variables]

    def note_read(self, member, dtype):
        seen = self.reads.get(member, dtype)
        self.reads[member] = dtype if seen == dtype else _MIXED

    def gather_dtype(self):
        """The dtype every member read was in, else the stored dtype."""
        dtypes = set(self.reads.values())
        if len(dtypes) == 1:
            (dtype,) = dtypes
            if dtype is not _MIXED and dtype.is_floating_point:
                return dtype
        return self.dtype

    def start_gather(self, stored=None, dtype=None):
        """Start the flat all-gather of `stored` (default: the variables'
        values now) in `dtype` (default: `gather_dtype()`). Collective:
        call on every rank."""
        stored = self.stored() if stored is None else stored
        return flat_shards.FlatGather(
            self.layout,
            [s._local_tensor.detach() for s in stored],
            self.group,
            dtype or self.gather_dtype(),
        )


_MIXED = "mixed"  # a member read in several dtypes


class _GroupSpec:
    """A group's buckets, and where each variable is in them; `split`: one
    bucket per variable, each gathered on its own first read."""

    def __init__(self, members, split=False):
        self.split = split
        by_kind = {}
        for variable, plan in members:
            value = _keras.raw_value(variable)
            kind = (id(plan.mesh), plan.axis, value.dtype, value.device)
            if split:
                kind = id(variable)
            by_kind.setdefault(kind, []).append((variable, plan))
        self.buckets = [_Bucket(m) for m in by_kind.values()]
        self.has_lookups = any(b.lookup_eligible for b in self.buckets)
        self.index = {}  # id(variable) -> (bucket index, member index)
        for b, bucket in enumerate(self.buckets):
            for m, variable in enumerate(bucket.variables):
                self.index[id(variable)] = (b, m)

    def start_gathers(self):
        """Collective: call on every rank."""
        return [bucket.start_gather() for bucket in self.buckets]


def spec_for(layer, policy):
    """The _GroupSpec of `layer` under `policy`, None when it holds no
    variable that can travel in a flat gather."""
    candidates = (
        layer.weights if policy == "block" else _keras.own_variables(layer)
    )
    split = layer in state.repeated
    key = (split,) + tuple(id(_keras.raw_value(v)) for v in candidates)
    cached = state.specs.get(layer)
    if cached is not None and cached[0] == policy and cached[1] == key:
        return cached[2]
    members, seen = [], set()
    for variable in candidates:
        plan = gathering.gather_plan(variable)
        value = _keras.raw_value(variable)
        if (
            plan is None
            or not plan.groupable
            or id(variable) in seen
            or not isinstance(value, DTensor)
            or tuple(value.placements) != plan.stored
            or not value.is_floating_point()
        ):
            continue
        seen.add(id(variable))
        members.append((variable, plan))
    spec = _GroupSpec(members, split) if members else None
    state.specs[layer] = (policy, key, spec)
    return spec


class _GroupGather(torch.autograd.Function):
    """Stored values (DTensors) in, whole local tensors out (the gather
    `flat` already started); backward reduce-scatters the gradients in one
    flat buffer, and hands each its variable's own layout (`_laid_out_as`)."""

    @staticmethod
    def forward(ctx, source, flat, factor, *stored):
        ctx.source = source
        ctx.factor = factor
        ctx.set_materialize_grads(False)
        return tuple(flat.take())

    @staticmethod
    def backward(ctx, *grads):
        source = ctx.source
        source.release()
        bucket = source.bucket
        # Reduced in the stored dtype (the flat input's copy-in casts a
        # gradient of a lower-precision gather).
        whole = [None if g is None else tensors.full_value(g) for g in grads]
        shard_grads = flat_shards.reduce_scatter(
            bucket.layout,
            whole,
            bucket.group,
            ctx.factor,
            bucket.dtype,
            bucket.device,
            bucket.shard_shapes,
        )
        needs = ctx.needs_input_grad[3:]
        return (None, None, None) + tuple(
            _laid_out_as(g, stored) if need else None
            for g, stored, need in zip(shard_grads, source.stored, needs)
        )


def _laid_out_as(grad, stored):
    """This rank's shard of a gradient, as a DTensor with the global shape
    and strides of `stored`, the variable's value. Autograd keeps a
    gradient whose strides are its variable's, and copies any other into a
    new tensor of the variable's strides: `to_local`'s backward derives
    strides from the local block, which for a dim sharded unevenly (7 over
    2) never match, and torch<2.13 makes that new tensor replicated (an
    all-gather of every such gradient, each step)."""
    return DTensor.from_local(
        grad,
        stored.device_mesh,
        stored.placements,
        run_check=False,
        shape=stored.shape,
        stride=stored.stride(),
    )


class _BucketSource:
    """One call's bucket as the regatherer sees it: gathered again (once)
    for backward, let go when its gradients are reduce-scattered."""

    def __init__(self, bucket, stored, dtype):
        self.bucket = bucket
        self.stored = stored
        self.dtype = dtype  # the forward's gather dtype, regathered alike
        self.flat = None  # the regather in flight
        self.tensors = None  # the regathered whole local tensors
        self.casts = {}  # (member, dtype) -> a regathered tensor cast
        self.released = False  # its gradients are reduce-scattered

    def in_flight(self):
        return self.flat is not None or self.tensors is not None

    def prefetchable(self):
        return not self.released and not self.in_flight()

    def start_regather(self):
        """Collective: call on every rank."""
        if not self.in_flight():
            self.flat = self.bucket.start_gather(self.stored, self.dtype)

    def regathered(self, key):
        member, dtype = key
        if self.tensors is None:
            self.start_regather()
            self.tensors, self.flat = self.flat.take(), None
        tensor = self.tensors[member]
        if dtype is None or dtype == tensor.dtype:
            return tensor
        cast = self.casts.get(key)
        if cast is None:
            cast = self.casts[key] = tensor.to(dtype)
        return cast

    def release(self):
        if self.flat is not None:
            self.flat.wait()
        self.flat = self.tensors = None
        self.casts = {}
        self.released = True


class _GroupCall:
    """One call of a group's layer: its variables' gathered values, from
    one flat gather per bucket made on the first read."""

    def __init__(self, layer, spec):
        self.layer = layer
        self.spec = spec
        self.values = {}  # (bucket, member) -> gathered value
        # bucket index -> its _BucketSource, for the regatherer
        self.sources = {}
        self.casts = {}  # ((bucket, member), dtype) -> the value cast
        self.keep = False  # keep the gathered weights for backward
        # id(gathered value) -> (that value, lookup_gradients.Lookup), for
        # the values an embedding lookup may read (see lookup_gradients).
        self.lookups = {}

    def value_for(self, variable, dtype):
        """`variable`'s gathered value in `dtype` (Keras' autocast), or
        None when it is not in this group. Collective on the first read:
        call on every rank."""
        where = self.spec.index.get(id(variable))
        if where is None:
            return None
        if self.spec.split:
            if where not in self.values:
                if not self.values and state.forward is not None:
                    state.forward.note(self.layer)
                bucket = self.spec.buckets[where[0]]
                self._take(
                    where[0],
                    bucket,
                    bucket.start_gather(),
                    gathering.state.regatherer,
                )
        elif not self.values:  # a group not split gathers every bucket at once
            self._gather()
        bucket = self.spec.buckets[where[0]]
        bucket.note_read(where[1], dtype)
        value = self.values[where]
        if value.dtype == dtype:
            return value
        if value.dtype != bucket.dtype:
            # Gathered in a lower precision than this read asks: the exact
            # value comes from the per-variable gather (and the bucket is
            # gathered in the stored dtype from the next call on).
            return None
        cast = self.casts.get((where, dtype))
        if cast is None:
            cast = self.casts[(where, dtype)] = value.to(dtype)
            if id(value) in self.lookups:
                self.lookups[id(cast)] = (cast, self.lookups[id(value)][1])
            regatherer = gathering.state.regatherer
            if regatherer is not None and not self.keep and cast.requires_grad:
                regatherer.register(
                    cast, self.sources[where[0]], (where[1], dtype)
                )
        return cast

    def _gather(self):
        forward = state.forward
        flats = (
            forward.take(self.layer, self.spec) if forward is not None else None
        )
        if flats is None:
            flats = self.spec.start_gathers()
        if forward is not None:
            self.keep = forward.is_last(self.layer)
        regatherer = None if self.keep else gathering.state.regatherer
        for b, (bucket, flat) in enumerate(zip(self.spec.buckets, flats)):
            self._take(b, bucket, flat, regatherer)
        if forward is not None:
            # After this group's copy-out, so that its flat buffer is gone
            # before the next group's is made.
            forward.advance(self.layer)

    def _take(self, b, bucket, flat, regatherer):
        """Bucket `b`'s gathered values from its gather `flat` in flight,
        differentiable (its gradients reduce-scattered in one flat buffer),
        registered with `regatherer` (None: kept for backward)."""
        stored = bucket.stored()
        source = _BucketSource(bucket, stored, flat.dtype)
        self.sources[b] = source
        if torch.is_grad_enabled() and any(s.requires_grad for s in stored):
            factor = replicas.batch_scale() / bucket.ranks
            outputs = _GroupGather.apply(source, flat, factor, *stored)
            if bucket.lookup_eligible:
                self.lookups[id(outputs[0])] = (
                    outputs[0],
                    lookup_gradients.Lookup(
                        bucket, stored[0].to_local(), factor
                    ),
                )
        else:
            outputs = flat.take()
        for m, (local, plan) in enumerate(zip(outputs, bucket.plans)):
            value = local if plan.plain else plan.as_model_dtensor(local)
            self.values[(b, m)] = value
            if regatherer is not None and local.requires_grad:
                regatherer.register(value, source, (m, None))


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
