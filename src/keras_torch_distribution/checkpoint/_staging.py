"""Where async saves copy the values before returning: pinned host memory
reused from one save to the next, on CUDA (`StagingMemory`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import staging as dcp_staging
from torch.distributed.tensor import DTensor

from keras_torch_distribution._processes import runtime

if TYPE_CHECKING:
    pass


# torch's async_save takes a stager of its own (`async_stager=`) and its
# BlockingAsyncStager can keep the staged copy (`cache_staged_state_dict`,
# in pinned memory): both since torch 2.4ish; detected, not assumed.
_CACHED_STAGING = (
    "async_stager" in inspect.signature(dcp.async_save).parameters
    and hasattr(dcp_staging, "BlockingAsyncStager")
    and "cache_staged_state_dict"
    in inspect.signature(dcp_staging.BlockingAsyncStager.__init__).parameters
)


class StagingMemory:
    """Where async saves copy the values before returning, on CUDA: one
    pinned host copy of this rank's state, made by the first save and
    reused by the next ones (torch's BlockingAsyncStager with
    cache_staged_state_dict=True), as torchtitan stages. Pinned memory
    makes the device-to-host copy fast; reusing it spares a new host copy
    per save. It is kept while the saved variables keep their structure
    (keys, shapes, dtypes, layouts) and made again when it changes; it
    holds one copy of this rank's state in host memory for as long.

    Without CUDA (nothing to pin) or on a torch without these, each save
    stages into fresh memory as torch's FileSystemWriter does."""

    def __init__(self) -> None:
        self.stager = None
        self.structure = None  # of the state dict `stager` holds a copy of

    def stager_for(
        self, state_dict: dict[str, torch.Tensor]
    ) -> dcp_staging.BlockingAsyncStager | None:
        """The stager for `state_dict`, or None (the writer stages)."""
        if not pinned_staging_available():
            return None
        structure = _structure(state_dict)
        if structure != self.structure:
            self.stager = dcp_staging.BlockingAsyncStager(
                cache_staged_state_dict=True
            )
            self.structure = structure
        return self.stager

    def clear(self) -> None:
        self.stager = self.structure = None


staging_memory = StagingMemory()


def pinned_staging_available() -> bool:
    """True where async saves stage into reused pinned memory: this torch
    has the stager, and the values are on CUDA (CPU memory needs no
    staging copy pinned for a device)."""
    return _CACHED_STAGING and runtime.uses_cuda()


def _structure(state_dict):
    """What a staged copy of `state_dict` must match to be reused."""
    entries = []
    for key, value in sorted(state_dict.items()):
        local = value.to_local() if isinstance(value, DTensor) else value
        entries.append(
            (
                key,
                type(value).__name__,
                tuple(value.shape),
                str(value.dtype),
                tuple(local.shape),
                str(getattr(value, "placements", None)),
            )
        )
    return tuple(entries)
