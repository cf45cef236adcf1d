"""Count the collectives this rank issues, by kind, for tests and benchmarks.

    with _collective_counts.counting() as counts:
        model.train_function(batch)
    counts  # {"all_gather": 6, "reduce_scatter": 4, "all_reduce": 1}

A dispatch mode sees every collective that goes through the dispatcher:
`torch.distributed`'s (`all_gather_into_tensor`: FSDP2's and this
package's flat gathers; `all_reduce`), and the functional ones DTensor
redistributions issue. (Torch's `CommDebugMode` does the same, but its
module tracker fails on nested Keras layers.) Counts are per call on this
rank; a collective not named here is counted under its own op name.

Counts are those a CUDA mesh issues, on any mesh: a DTensor
redistribution from one sharded dim to another is one `all_to_all` (NCCL;
`_dtensor::shard_dim_alltoall`), which torch runs on a CPU mesh as an
all-gather plus a chunk (gloo has no all-to-all). Within a count, that
CPU fallback is counted as the all_to_all it stands for (its input's
bytes), and its all-gather not at all (`_alltoall_as_on_cuda`). It shows
under "all_to_all" only where issued.

    with _collective_counts.tally() as tally:
        model.train_function(batch)
    tally.counts, tally.bytes  # bytes: the full buffer of each call, summed

A call's bytes are those of its largest tensor argument or result (a list
of tensors counts as their sum): the gathered output of an all-gather, the
input of a reduce-scatter, the tensor of an all-reduce or broadcast.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import placement_types
from torch.utils._python_dispatch import TorchDispatchMode

# kind -> the op names (c10d and functional collectives) counted as it
KINDS = {
    "all_gather": (
        "_allgather_base_",
        "allgather_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "all_gather_into_tensor_out",
    ),
    "reduce_scatter": (
        "_reduce_scatter_base_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    ),
    "all_reduce": (
        "allreduce_",
        "allreduce_coalesced_",
        "all_reduce",
        "all_reduce_coalesced",
    ),
}
# Counted as every other kind, but shown only where issued.
ALL_TO_ALL = (
    "alltoall_base_",
    "alltoall_",
    "all_to_all_single",
    "shard_dim_alltoall",
)
_KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}
_KIND_OF.update({name: "all_to_all" for name in ALL_TO_ALL})


_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
_DTENSOR_COLLECTIVES = ("shard_dim_alltoall",)
_NOT_COUNTED = (
    "wait_tensor",
    "wait",
    "barrier",
    "monitored_barrier",
    "_wrap_tensor_autograd",
)


class _Counter(TorchDispatchMode):
    """Counts the c10d and functional collective ops dispatched; ops on
    DTensors are left to DTensor first (NotImplemented), so that the
    collectives they desugar into are seen, as torch's CommDebugMode does."""

    def __init__(self, counts, sizes=None):
        super().__init__()
        self.counts = counts
        self.sizes = sizes
        self.paused = False  # inside a CPU all-to-all's fallback

    def add(self, kind, nbytes):
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.sizes is not None:
            self.sizes[kind] = self.sizes.get(kind, 0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented
        if func.namespace in _NAMESPACES and not self.paused:
            name = func._overloadpacket._qualified_op_name.split("::")[-1]
            if name not in _NOT_COUNTED and (
                func.namespace != "_dtensor" or name in _DTENSOR_COLLECTIVES
            ):
                result = func(*args, **kwargs)
                self.add(
                    _KIND_OF.get(name, name),
                    max([_nbytes(a) for a in args] + [_nbytes(result)]),
                )
                return result
        return func(*args, **kwargs)


def _nbytes(value):
    """Bytes of a tensor, or of the tensors of a list or tuple; 0 else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(
            _nbytes(v) for v in value if isinstance(v, (torch.Tensor, list))
        )
    return 0


@contextlib.contextmanager
def _alltoall_as_on_cuda(counter):
    """Within the block, a DTensor all-to-all on a CPU mesh (torch's
    all-gather plus chunk, gloo having none) counts on `counter` as the
    one all_to_all a CUDA mesh issues, with its input's bytes, and its
    all-gather not at all. Torch's function is swapped for the block only
    (where this torch has it; without it there is nothing to count)."""
    original = getattr(placement_types, "shard_dim_alltoall", None)
    if original is None:
        yield
        return

    def shard_dim_alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
        if mesh.device_type != "cpu" or counter.paused:
            return original(input, gather_dim, shard_dim, mesh, mesh_dim)
        counter.add("all_to_all", _nbytes(input))
        counter.paused = True
        try:
            return original(input, gather_dim, shard_dim, mesh, mesh_dim)
        finally:
            counter.paused = False

    placement_types.shard_dim_alltoall = shard_dim_alltoall
    try:
        yield
    finally:
        placement_types.shard_dim_alltoall = original


@contextlib.contextmanager
def _counted(counter):
    with _alltoall_as_on_cuda(counter), counter:
        yield


@contextlib.contextmanager
def counting():
    """Within the block, count the collectives issued on this rank; the
    yielded dict counts every kind of KINDS (0 when none), all_to_all
    where issued, and any other collective under its op name."""
    counts = {kind: 0 for kind in KINDS}
    with _counted(_Counter(counts)):
        yield counts


class Tally:
    """Collectives of a block by kind: `counts` (calls) and `bytes` (each
    call's full buffer, summed); every kind of KINDS present (0 when none)."""

    def __init__(self):
        self.counts = {kind: 0 for kind in KINDS}
        self.bytes = {kind: 0 for kind in KINDS}


@contextlib.contextmanager
def tally():
    """Within the block, count the collectives issued on this rank and
    their bytes (see the module docstring); yields a `Tally`."""
    result = Tally()
    with _counted(_Counter(result.counts, result.bytes)):
        yield result
