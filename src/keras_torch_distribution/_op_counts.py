"""Counting what a block of torch code dispatches: aten ops, the ones that
are not views (about the kernels a GPU would run), and the ones that would
make the host wait for a GPU, each with the line that issued it.

Imports only torch and the standard library, so that a benchmark can load
this file by its path and count plain Keras without this package being
installed (`testing` re-exports it).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

# Ops that make the host wait for the device when their operand lives on a
# GPU: a value read on the host (`float(t)`, `if t:`, `t.item()`, a
# data-dependent shape), and host data made a tensor (`lift_fresh`: on CUDA
# a copy from pageable host memory). On the CPU they cost nothing, which is
# why a CPU run counts them instead of timing them.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "nonzero",
        "equal",
        "_assert_async",
        "lift_fresh",
    }
)
# Host reads that dispatch no aten op on the CPU (`np.array(t)`,
# `t.tolist()`): counted by wrapping these `torch.Tensor` methods.
HOST_READS = ("numpy", "tolist")
# Ops that only make views (no kernel on a GPU).
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "reshape",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "slice",
        "select",
        "alias",
        "as_strided",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "unflatten",
        "view_as_real",
        "view_as_complex",
        "movedim",
        "diagonal",
        "narrow",
    }
)


@dataclasses.dataclass
class OpCounts:
    """What `count_ops()` saw: aten op name -> times dispatched, and the
    host reads (`HOST_READS`) by method name."""

    ops: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )
    host_reads: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )
    # (op or host read, "file:line" of the innermost frame outside torch's
    # dispatch machinery) -> times: where each sync was issued.
    sync_sources: collections.Counter = dataclasses.field(
        default_factory=collections.Counter
    )

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        """Ops that are not views: about the kernels a GPU would run."""
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)

    @property
    def syncs(self) -> dict[str, int]:
        """The ops and host reads that would make the host wait for a GPU,
        by name (empty when there were none)."""
        found = {op: n for op, n in self.ops.items() if op in SYNC_OPS}
        found.update(self.host_reads)
        return found


@contextlib.contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count the aten ops dispatched in the block (a `TorchDispatchMode`)
    and the tensors read on the host; yields the `OpCounts`, filled when
    the block ends."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = OpCounts()

    class _Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts.ops[func._opname] += 1
            if func._opname in SYNC_OPS:
                counts.sync_sources[(func._opname, _issuer())] += 1
            return func(*args, **(kwargs or {}))

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    own = {name for name in HOST_READS if name in vars(torch.Tensor)}

    def counted(name):
        method = saved[name]

        def read(tensor, *args, **kwargs):
            counts.host_reads[name] += 1
            counts.sync_sources[(name, _issuer())] += 1
            return method(tensor, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _Counting():
            yield counts
    finally:
        for name, method in saved.items():
            if name in own:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)


# Frames of torch's dispatch machinery and of the counting itself, skipped
# when naming where a sync was issued.
_MACHINERY = (
    os.path.join("torch", "utils", "_python_dispatch.py"),
    os.path.join("torch", "_ops.py"),
    os.path.join("torch", "_tensor.py"),
    os.path.join("torch", "_compile.py"),
    os.path.join("torch", "_dynamo", "eval_frame.py"),
    os.path.join("torch", "_jit_internal.py"),
    os.path.join("torch", "utils", "_contextlib.py"),
    __file__,
)


def _issuer() -> str:
    """ "path:line" of the innermost frame outside the dispatch machinery,
    the path from its `site-packages` (or the package) on."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.endswith(_MACHINERY):
            path = frame.filename.replace(os.sep, "/")
            for marker in ("site-packages/", "src/"):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            return f"{path}:{frame.lineno}"
    return "?"
