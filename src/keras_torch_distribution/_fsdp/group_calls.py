"""A group's call: its buckets gathered (or taken from the gathers started
ahead), each variable's value copied out, regathered for backward, and the
gradients reduce-scattered in one flat buffer (see `groups`).
"""

import torch
from torch.distributed.tensor import DTensor

from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._fsdp import flat_shards
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._fsdp import lookup_gradients
from keras_torch_distribution._fsdp.group_specs import state


class _GroupGather(torch.autograd.Function):
    """Stored values (DTensors) in, whole local tensors out (the gather
    `flat` already started); backward reduce-scatters the gradients in one
    flat buffer, and hands each its variable's own layout (`_laid_out_as`)."""

    @staticmethod
    def forward(ctx, source, flat, factor, uniform, *stored):
        ctx.source = source
        ctx.factor = factor
        ctx.uniform = uniform
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
            ctx.uniform,
        )
        needs = ctx.needs_input_grad[4:]
        return (None, None, None, None) + tuple(
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
            factor = replicas.gradient_factor(bucket.ranks)
            # The same on every rank unless the batch is split unevenly (a
            # last partial batch), where each rank has its own.
            uniform = replicas.uniform_gradient_factor()
            outputs = _GroupGather.apply(source, flat, factor, uniform, *stored)
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
