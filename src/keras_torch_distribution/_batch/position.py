"""Where `fit` is in its data, saved with every backup, and a resume at
exactly that batch.

Keras resumes a backup at the start of its epoch, and draws the next
epoch's shuffle from torch's global generator as it happens to be in the
new process: a resumed run trains on other batches than an uninterrupted
one (and a mid-epoch backup trains the epoch's first batches twice). Here,
during a multi-process `fit` (`start()` .. `end()`), the training loop's
`EpochIterator._enumerate_iterator` is followed (`enumerate_batches`):

- which iterator of batches (the "source") the epoch draws from, what its
  shuffle order was drawn from just before it was made (torch's global RNG
  state on Keras 3.15; the data adapter's epoch count, its seed, on 3.16),
  and how many batches were taken from it;
- how many batches of the current epoch are done, and whether the epoch's
  batches are all done.

`saved()` gives that, with the same state now, as JSON for a backup's
`extra`; `resume_from(extra)` asks the next training loop to continue there:
the source is made again from the saved state, the batches done are
taken from it and dropped (arrays: slices of the global batch; other inputs:
read and dropped), and the state is set to the one saved, so the
resumed run sees the same batches and random draws as the uninterrupted
one. Keras' step numbers in the resumed epoch go on from the batch reached.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._batch import adapter


def _encode(rng: torch.Tensor) -> str:
    return base64.b64encode(rng.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    data = bytearray(base64.b64decode(text))
    return torch.frombuffer(data, dtype=torch.uint8)


class _Tracker:
    """The training loop's position in its data."""

    def __init__(self, iterator):
        self.adapter = adapter.keras_adapter(
            _keras.epoch_iterator_data_adapter(iterator)
        )
        self.source = None
        self.rng_at_source_start = None
        self.adapter_epoch_at_source_start = None
        self.source_batches = 0
        self.epoch_batches = 0
        self.epoch_done = False

    def new_source(self, source, before):
        self.source = source
        self.rng_at_source_start, self.adapter_epoch_at_source_start = before
        self.source_batches = 0

    def shuffle_state(self):
        """What the next source's order is drawn from: torch's global RNG
        state (Keras 3.15), and the adapter's epoch count (3.16)."""
        return torch.get_rng_state(), _keras.data_adapter_epoch(self.adapter)

    def set_shuffle_state(self, rng, adapter_epoch):
        torch.set_rng_state(rng)
        if adapter_epoch is not None:
            _keras.set_data_adapter_epoch(self.adapter, adapter_epoch)


class _State:
    def __init__(self):
        self.clear()

    def clear(self):
        self.running = False  # between start() and end()
        self.epoch = 0  # the epoch fit is in (on_epoch_begin)
        self.tracker = None  # the training loop's, once it enumerates
        self.iterator = None  # the training loop's EpochIterator
        self.pending = None  # a resume request for the next training loop


state = _State()


def start() -> None:
    """A multi-process `fit` passed `on_train_begin`: the next epoch
    iterator enumerated is its training loop's."""
    state.running = True
    state.tracker = None
    state.iterator = None


def end() -> None:
    """`fit` returned or raised."""
    state.clear()


def set_epoch(epoch: int) -> None:
    state.epoch = epoch


def reached() -> tuple[int, int]:
    """(epoch, batches done in it) `fit` has reached: (epoch + 1, 0) once
    an epoch's batches are all done."""
    tracker = state.tracker
    if tracker is None:
        return state.epoch, 0
    if tracker.epoch_done:
        return state.epoch + 1, 0
    return state.epoch, tracker.epoch_batches


def saved() -> dict[str, Any] | None:
    """The position to store with a backup, as JSON; None outside a
    tracked `fit`."""
    tracker = state.tracker
    if not state.running or tracker is None:
        return None
    epoch, batch = reached()
    rng, adapter_epoch = tracker.shuffle_state()
    position = {
        "epoch": epoch,
        "batch": batch,
        "source_batches": tracker.source_batches,
        "rng": _encode(rng),
        "adapter_epoch": adapter_epoch,
    }
    if tracker.rng_at_source_start is not None:
        position["rng_at_source_start"] = _encode(tracker.rng_at_source_start)
        position["adapter_epoch_at_source_start"] = (
            tracker.adapter_epoch_at_source_start
        )
    return position


def resume_from(position: dict[str, Any] | None) -> None:
    """Make the next training loop continue at `position` (what `saved()`
    gave; None: Keras' own resume at the epoch's start)."""
    state.pending = position


def enumerate_batches(original, iterator):
    """Keras `EpochIterator._enumerate_iterator`: the same steps; the
    training loop of a multi-process `fit` is followed, and resumed where
    `resume_from` asked."""
    resume = None
    if state.running and state.tracker is None:
        state.tracker = _Tracker(iterator)
        state.iterator = iterator
        resume, state.pending = state.pending, None
    if not state.running or iterator is not state.iterator:
        yield from original(iterator)
        return
    tracker = state.tracker
    tracker.epoch_batches = 0
    tracker.epoch_done = False
    steps = original(iterator)
    if resume is not None:
        first = _resume(steps, iterator, tracker, resume)
        if first is None:
            tracker.epoch_done = True
            return
        yield first
    while True:
        item = _pull(steps, iterator, tracker)
        if item is None:
            tracker.epoch_done = True
            return
        yield item


def _pull(steps, iterator, tracker):
    """The next (begin, end, source) step of Keras' loop, or None at the
    epoch's end; notes a new source with the shuffle state it was made from."""
    before = tracker.shuffle_state()
    source = _keras.epoch_iterator_source(iterator)
    try:
        item = next(steps)
    except StopIteration:
        made = _keras.epoch_iterator_source(iterator)
        if made is not None and made is not source:
            tracker.new_source(made, before)  # for the next epoch
        return None
    if item[2] is not tracker.source:
        tracker.new_source(item[2], before)
    count = _keras.epoch_iterator_steps_per_execution(iterator)
    tracker.source_batches += count
    tracker.epoch_batches += count
    return item


def _resume(steps, iterator, tracker, resume):
    """Take the batches the interrupted run had done in this epoch; the
    first step still to train, or None when the epoch has none left."""
    now = (_decode(resume["rng"]), resume.get("adapter_epoch"))
    batch = int(resume.get("batch", 0))
    if batch == 0 and _keras.epoch_iterator_makes_new_source_each_epoch(
        iterator
    ):
        # The uninterrupted run made this epoch's source from the state
        # it had at the backup.
        tracker.set_shuffle_state(*now)
        return _pull(steps, iterator, tracker)
    if "rng_at_source_start" not in resume:
        raise ValueError(
            "The backup's position has no RNG state of its batches' source: "
            f"{sorted(resume)}. It was not written by this package's "
            "BackupAndRestore or ShardedCheckpoint in a multi-process fit; "
            "remove the backup directory to start over."
        )
    tracker.set_shuffle_state(
        _decode(resume["rng_at_source_start"]),
        resume.get("adapter_epoch_at_source_start"),
    )
    item = _pull(steps, iterator, tracker)  # makes the source
    extra = int(resume.get("source_batches", batch)) - batch
    if item is not None and extra > 0:
        _drop(item[2], extra, resume)
        tracker.source_batches += extra
        _keras.add_epoch_iterator_batches_seen(iterator, extra)
    count = _keras.epoch_iterator_steps_per_execution(iterator)
    to_skip = batch // count
    skipped = 0
    if to_skip == 0:
        tracker.set_shuffle_state(*now)
    while skipped < to_skip and item is not None:
        _drop(item[2], count, resume)
        skipped += 1
        if skipped == to_skip:
            # Before the next pull: at an epoch's end it makes the next
            # source, from the state the uninterrupted run had then.
            tracker.set_shuffle_state(*now)
        item = _pull(steps, iterator, tracker)
    if skipped < to_skip:
        _ran_out(resume)
    tracker.epoch_batches = batch + (count if item is not None else 0)
    return item  # None: the backup was taken after the epoch's last batch


def _ran_out(resume):
    raise ValueError(
        f"The backup was taken at epoch {resume.get('epoch')}, after "
        f"{resume.get('batch')} batches, but this fit's data ran out before "
        "that point. Resume with the same data, batch_size and "
        "steps_per_epoch as the run that wrote the backup, or remove the "
        "backup directory to start over."
    )


def _drop(source, count, resume):
    for _ in range(count):
        if next(source, _NONE) is _NONE:
            _ran_out(resume)


_NONE = object()
