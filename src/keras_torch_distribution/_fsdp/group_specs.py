"""Which variables make a layer's group, and its buckets: one per
batch-axis process group and dtype, each one flat all-gather and one flat
reduce-scatter (see `groups`); and what grouping keeps between calls.
"""

import weakref

from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras
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
