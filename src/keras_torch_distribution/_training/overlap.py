"""Gradient all-reduce overlapped with backward, as DDP does it.

For a data-parallel model whose trainable variables are all plain tensors,
gradients are grouped into buckets in reverse creation order (roughly the
order backward produces them). A hook on each parameter counts gradients as
they are accumulated; when a bucket is complete (and every bucket before it
has been launched, so every rank launches in the same order), its mean
all-reduce starts asynchronously while backward goes on. `finish` in the
optimizer step waits for the buckets and writes the averages back into the
gradients.

Anything unusual (a second backward before the step, gradients that are not
the parameters' own `.grad`) makes `finish` report False after completing
what was launched; the caller then averages the gradients synchronously.
"""

import torch

from keras_torch_distribution._distributed import collectives
from keras_torch_distribution._distributed import replicas


class OverlappedReducer:
    """Averages the gradients of `params` over `group` during backward."""

    def __init__(self, params, group, count):
        self.params = list(params)
        self.group = group
        self.count = count
        self.buckets = collectives.buckets(
            list(reversed(self.params)), collectives.OVERLAP_BUCKET_BYTES
        )
        self.bucket_of = {}
        for index, bucket in enumerate(self.buckets):
            for param in bucket:
                self.bucket_of[id(param)] = index
        self.handles = [
            p.register_post_accumulate_grad_hook(self._on_gradient)
            for p in self.params
        ]
        self._reset()

    def _reset(self):
        self.ready = [0] * len(self.buckets)
        self.works = {}  # bucket index -> collectives.FlatBucket in flight
        self.next_to_launch = 0
        self.dirty = False
        self.seen = False

    def _on_gradient(self, param):
        self.seen = True
        index = self.bucket_of[id(param)]
        self.ready[index] += 1
        if self.ready[index] > len(self.buckets[index]):
            self.dirty = True  # a second backward before the step
            return
        while self.next_to_launch < len(self.buckets) and self.ready[
            self.next_to_launch
        ] == len(self.buckets[self.next_to_launch]):
            self._launch(self.next_to_launch)
            self.next_to_launch += 1

    def _launch(self, index):
        pieces = [
            p.grad
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in self.buckets[index]
        ]
        self.works[index] = collectives.FlatBucket(pieces).all_reduce(
            self.group, replicas.gradient_factor(self.count), async_op=True
        )

    def finish(self, grads):
        """Complete this step's all-reduces; True if `grads` now hold the
        averages. Collective: call on every rank."""
        if not self.seen:
            return False
        own = len(grads) == len(self.params) and all(
            g is p.grad for g, p in zip(grads, self.params)
        )
        while self.next_to_launch < len(self.buckets):
            self._launch(self.next_to_launch)  # buckets with unused params
            self.next_to_launch += 1
        for index in sorted(self.works):
            self.works[index].wait()
        usable = own and not self.dirty
        if usable:
            for index, bucket in self.works.items():
                bucket.copy_back([p.grad for p in self.buckets[index]])
        self._reset()
        return usable

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
