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
_KIND_OF = {name: kind for kind, names in KINDS.items() for name in names}


_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented
        if func.namespace in _NAMESPACES:
            name = func._overloadpacket._qualified_op_name.split("::")[-1]
            if name not in _NOT_COUNTED:
                kind = _KIND_OF.get(name, name)
                self.counts[kind] = self.counts.get(kind, 0) + 1
                if self.sizes is not None:
                    result = func(*args, **kwargs)
                    self.sizes[kind] = self.sizes.get(kind, 0) + max(
                        [_nbytes(a) for a in args] + [_nbytes(result)]
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
def counting():
    """Within the block, count the collectives issued on this rank; the
    yielded dict counts every kind of KINDS (0 when none), and any other
    collective under its op name."""
    counts = {kind: 0 for kind in KINDS}
    with _Counter(counts):
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
    with _Counter(result.counts, result.bytes):
        yield result
