"""The one bucketed flat collective.

Many small collectives cost more than a few large ones, so tensors that
meet in one collective are put in buckets (one dtype and device each, cut
at a size), each bucket is concatenated into one flat tensor, the
collective runs on that, and the result is copied back into the tensors.
The gradient average after backward (`trainer`), the one overlapped with
backward (`overlap`), the metric-state sum (`trainer`) and the first
step's broadcast (`replica_start`) all go through here.
"""

import torch
import torch.distributed as dist

# For collectives that run when everything is ready (the gradient average
# after backward, the first step's broadcast): DDP's default bucket_cap_mb,
# few large collectives.
SYNC_BUCKET_BYTES = 25 * 1024 * 1024
# For the gradient average overlapped with backward (`overlap`): small
# enough that the first buckets are complete, and start, early in backward.
OVERLAP_BUCKET_BYTES = 4 * 1024 * 1024


def buckets(tensors, bucket_bytes=SYNC_BUCKET_BYTES):
    """`tensors` in buckets of one dtype and device each, in their order; a
    bucket is closed once it holds `bucket_bytes` or more (None: no limit).

    Buckets are listed in the order of their last tensor in `tensors`: for
    tensors produced in that order (gradients in backward), the order in
    which buckets are complete. Every rank that passes the same shapes and
    dtypes gets the same buckets.
    """
    closed = []  # (index of the last tensor, bucket)
    open_ = {}  # (dtype, device) -> [bucket, bytes, index of the last tensor]
    for index, tensor in enumerate(tensors):
        kind = (tensor.dtype, tensor.device)
        entry = open_.setdefault(kind, [[], 0, index])
        entry[0].append(tensor)
        entry[1] += tensor.numel() * tensor.element_size()
        entry[2] = index
        if bucket_bytes is not None and entry[1] >= bucket_bytes:
            closed.append((index, entry[0]))
            del open_[kind]
    closed += [(last, bucket) for bucket, _, last in open_.values()]
    closed.sort(key=lambda pair: pair[0])
    return [bucket for _, bucket in closed]


class FlatBucket:
    """Tensors of one dtype and device flattened into one tensor, `flat`,
    for one collective; `copy_back` writes its result into them."""

    def __init__(self, tensors):
        self.tensors = list(tensors)
        self.flat = torch.cat([t.reshape(-1) for t in self.tensors])
        self.work = None

    def all_reduce(self, group, scale=1.0, async_op=False, scaled_numel=None):
        """Sum `flat` over `group`, each rank's first multiplied by `scale`
        (1 / replicas for a mean; only its first `scaled_numel` elements
        when given); with `async_op`, `wait()` before reading it. Returns
        self. Collective: call on every rank."""
        if scale != 1.0:
            scaled = (
                self.flat if scaled_numel is None else self.flat[:scaled_numel]
            )
            scaled.mul_(scale)
        self.work = dist.all_reduce(self.flat, group=group, async_op=async_op)
        return self

    def broadcast(self, source, group):
        """`flat` of global rank `source` on every rank of `group`. Returns
        self. Collective: call on every rank."""
        dist.broadcast(self.flat, src=source, group=group)
        return self

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self

    def copy_back(self, targets=None):
        """Write the pieces of `flat` into `targets` (default: the tensors
        flattened), one per tensor flattened, in order; a None target is
        skipped."""
        targets = self.tensors if targets is None else targets
        offset = 0
        for tensor, target in zip(self.tensors, targets):
            n = tensor.numel()
            if target is not None:
                target.copy_(self.flat[offset : offset + n].view_as(target))
            offset += n


def all_reduce(
    tensors, group, scale=1.0, bucket_bytes=SYNC_BUCKET_BYTES, unscaled=()
):
    """Sum `tensors` in place over `group`, each rank's first multiplied by
    `scale` (1 / replicas for a mean), in flat buckets of `bucket_bytes`
    (None: one per dtype and device). `unscaled` tensors (one dtype and
    device) are summed too, not scaled, in the last bucket of their kind
    (one of their own if there is none). Collective: call on every rank."""
    unscaled = list(unscaled)
    bucketed = buckets(tensors, bucket_bytes)
    kind = (unscaled[0].dtype, unscaled[0].device) if unscaled else None
    carrier = None
    for index, bucket in enumerate(bucketed):
        if (bucket[0].dtype, bucket[0].device) == kind:
            carrier = index
    if unscaled and carrier is None:
        bucketed.append([])
        carrier = len(bucketed) - 1
    for index, bucket in enumerate(bucketed):
        extra = unscaled if index == carrier else []
        scaled_numel = sum(t.numel() for t in bucket)
        FlatBucket(bucket + extra).all_reduce(
            group, scale, scaled_numel=scaled_numel if extra else None
        ).copy_back()


def broadcast(tensors, source, group, bucket_bytes=SYNC_BUCKET_BYTES):
    """Write the values of global rank `source` into `tensors` on every rank
    of `group`, in flat buckets of `bucket_bytes` (boolean tensors travel
    as bytes). Collective: call on every rank."""
    views = [
        t.view(torch.uint8) if t.dtype == torch.bool else t for t in tensors
    ]
    for bucket in buckets(views, bucket_bytes):
        FlatBucket(bucket).broadcast(source, group).copy_back()
