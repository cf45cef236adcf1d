"""FSDP's gathered weights, measured in a training step.

`tracking(groups)` watches a step (real or on fake tensors, `_fake_step`)
at the level of torch's dispatcher and follows the storages that hold
gathered weights:

- every all-gather over one of `groups` (the batch axis' process groups:
  FSDP's flat group gathers, `_fsdp.groups`, and its per-variable DTensor
  gathers, `_fsdp.gathering`, in forward, prefetched, and again for
  backward) makes its output's storage a gathered one;
- a copy of a gathered storage (`copy_`, a dtype cast, `clone`, `cat`:
  the flat gather's copy-out, mixed precision's casts, DTensor's
  reordering of a gather on a dim other than 0) is gathered too;
- a storage is held while any tensor on it lives (views included, and
  the base a view was made from: a weakref finalizer on each; torch keeps
  a tensor's Python object while autograd holds the tensor, so a saved
  weight counts until backward lets it go).

`Gathered.peak_bytes` is the most bytes of gathered storages held at once
during the block (the group in use, the groups prefetched with it, a
flat buffer and its copies while they coexist), `largest_bytes` the
largest single all-gather. Both are this rank's; they count bytes, not
allocator blocks (no rounding, no fragmentation, no caching).
"""

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_ALL_GATHERS = {
    "_allgather_base_",
    "allgather_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_out",
}
_aten = torch.ops.aten
# Ops whose output is a copy of their tensor inputs' values.
_COPIES = {
    _aten.copy_.default,
    _aten._to_copy.default,
    _aten.clone.default,
    _aten.cat.default,
    _aten.stack.default,
}


def _storage(tensor):
    """(key, bytes) of a tensor's storage; key is the storage's identity
    (fake tensors have no data pointer)."""
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group_name(args, func_name):
    """The name of the process group a collective's arguments name."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return dist.ProcessGroup.unbox(arg).group_name
    if func_name.startswith("all_gather_into_tensor"):
        # functional collectives: (input, group_size, group_name)
        return next(a for a in reversed(args) if isinstance(a, str))
    return None


class Gathered(TorchDispatchMode):
    """See the module docstring."""

    def __init__(self, group_names):
        super().__init__()
        self.group_names = set(group_names)
        self.live = {}  # storage key -> [bytes, tensors alive on it]
        self.watched = {}  # id(tensor) -> weakref to it
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor for t in types):
            return NotImplemented
        result = func(*args, **kwargs)
        name = func._overloadpacket._qualified_op_name.split("::")[-1]
        if name in _ALL_GATHERS and _group_name(args, name) in self.group_names:
            output = args[0] if name.endswith("_") else result
            for tensor in _tensors(output):
                nbytes = _storage(tensor)[1]
                self.largest_bytes = max(self.largest_bytes, nbytes)
                self._hold(tensor)
        elif func in _COPIES and any(
            _storage(t)[0] in self.live
            for t in _tensors(args[1:] if func is _aten.copy_.default else args)
        ):
            for tensor in _tensors(result):
                self._hold(tensor)
        else:
            for tensor in _tensors(result):
                if _storage(tensor)[0] in self.live:
                    self._watch(tensor, _storage(tensor)[0])
        return result

    def _hold(self, tensor):
        key, nbytes = _storage(tensor)
        if key not in self.live:
            self.live[key] = [nbytes, 0]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._watch(tensor, key)
        # A copy into a view of a buffer made before (the flat gather's
        # copy-out): the buffer itself holds the storage too.
        if tensor._base is not None:
            self._watch(tensor._base, key)

    def _watch(self, tensor, key):
        seen = self.watched.get(id(tensor))
        if seen is not None and seen() is tensor:
            return
        self.watched[id(tensor)] = weakref.ref(tensor)
        self.live[key][1] += 1
        weakref.finalize(tensor, self._released, key, id(tensor))

    def _released(self, key, tensor_id):
        self.watched.pop(tensor_id, None)
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self.live[key]


def batch_group_names(variables):
    """The names of the process groups FSDP gathers `variables` over (the
    batch axis of each one's mesh)."""
    names = set()
    for variable in variables:
        plan = getattr(variable, "_ktd_gather", None)
        if plan is not None:
            names.add(plan.group.group_name)
    return names


@contextlib.contextmanager
def tracking(group_names):
    """Within the block, measure the gathered weights (see the module
    docstring); yields the `Gathered`."""
    with Gathered(group_names) as gathered:
        yield gathered
