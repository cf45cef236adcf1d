"""Input sharding across data-parallel replicas, as Keras on JAX does it.

`batch_size` in fit / evaluate / predict is the global batch. For inputs that
Keras batches (numpy arrays, torch tensors, dicts and tuples of them,
`keras.utils.PyDataset`), every process builds the same global batches (the
same shuffle: every process shares one seed) and keeps its replica's rows:
replica r of R gets rows [r*b, (r+1)*b) of each global batch of R*b rows; a
last, partial batch is split as evenly as possible and its gradients and
metrics are weighted by rows, so the numbers are those of one process.

A torch `DataLoader` yields per-process batches: replica r takes batches
r, r+R, r+2R, ... (a remainder of fewer than R batches is left out of each
epoch, with a warning). A Python generator is used as given (shard it
yourself). A batched `tf.data.Dataset` is taken as global batches, like arrays.
With `auto_shard_dataset=False` every input is used as given: each batch is
this replica's piece of a global batch made of the replicas' equal pieces,
in replica order.
"""

import keras
import torch
import torch.distributed

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._processes import runtime


def batch_rows():
    """Where this replica's batch sits in the global batch: (global rows,
    first row, rows), set as fit / evaluate / predict feed each batch
    (random draws and batch statistics need it); None outside them, and
    for batches nobody sharded (direct model calls: the rows a process
    passes are the whole batch)."""
    return replicas.batch_weight.rows


def get_data_adapter(
    original,
    x,
    y=None,
    sample_weight=None,
    batch_size=None,
    steps_per_epoch=None,
    shuffle=False,
    class_weight=None,
):
    """Keras' `get_data_adapter`, sharding its batches over replicas."""
    arguments = dict(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        steps_per_epoch=steps_per_epoch,
        shuffle=shuffle,
        class_weight=class_weight,
    )
    distribution = _keras.current_distribution()
    if (
        distribution is None
        or not runtime.is_multi_process()
        or _keras.is_data_adapter(x)
    ):
        return original(**arguments)
    with _keras.distribution_hidden():
        adapter = original(**arguments)
    group = replicas.current()
    if not group.is_distributed:
        return _as_given(adapter)
    if not distribution.auto_shard_dataset or _keras.is_generator(x):
        return _wrap(
            adapter,
            lambda batches: (
                _process_rows(b, group) for b in _together(batches, adapter)
            ),
            num_batches=adapter.num_batches,
        )
    if shuffle or _keras.is_torch_dataloader(x):
        _same_torch_generator_everywhere()
    if _keras.is_torch_dataloader(x):
        return _wrap(
            adapter,
            lambda batches: _together(
                _round_robin(iter(batches), adapter, group), adapter
            ),
            num_batches=_round_robin_count(adapter, group),
        )
    if batch_size is not None and batch_size % group.count:
        raise ValueError(
            f"batch_size={batch_size} is the global batch and must be "
            f"divisible by the {group.count} data-parallel replicas; use a "
            f"multiple of {group.count}, e.g. "
            f"{batch_size - batch_size % group.count or group.count}."
        )
    return _wrap(
        adapter,
        lambda batches: (_replica_rows(b, group) for b in batches),
        num_batches=adapter.num_batches,
    )


def torch_dataloader_batches(original, iterator):
    """Keras 3.16 `TorchEpochIterator._get_iterator`: the batches of the
    data adapter's torch DataLoader, as Keras 3.15 always iterates (this
    replica's rows, from `get_data_adapter`). Keras 3.16 iterates numpy
    batches under ModelParallel instead and wraps each as a DTensor of the
    global batch, so the model would see every replica's rows."""
    del original
    return iterator.data_adapter.get_torch_dataloader()


def _same_torch_generator_everywhere():
    """Keras (and a DataLoader) shuffle with torch's global generator;
    every process must draw the same permutation of the global batches
    (processes seeded differently would each take their rows of another
    one): rank 0's generator state goes to every process. Collective: call
    on every rank."""
    state = torch.get_rng_state()  # a CPU tensor: on the group for those
    torch.distributed.broadcast(state, src=0, group=runtime.cpu_group())
    torch.set_rng_state(state)


def _replica_rows(batch, group):
    rows = _rows(batch)
    base, extra = divmod(rows, group.count)
    start = group.index * base + min(group.index, extra)
    count = base + (1 if group.index < extra else 0)
    if count == 0:
        raise ValueError(
            f"A batch of {rows} rows cannot feed {group.count} data-parallel "
            "replicas (each needs at least one row). Make the number of "
            "samples leave a last batch of at least that many rows, e.g. by "
            "choosing another batch_size or dropping the remainder."
        )
    replicas.batch_weight.set(count * group.count / rows, (rows, start, count))
    return keras.tree.map_structure(
        lambda t: None if t is None else t[start : start + count], batch
    )


def _process_rows(batch, group):
    """A per-process batch: this replica's piece of a global batch made of
    the replicas' equal pieces, in replica order; it weighs an even share."""
    rows = _rows(batch)
    replicas.batch_weight.set(
        1.0, (rows * group.count, rows * group.index, rows)
    )
    return batch


def _rows(batch):
    leaves = [t for t in keras.tree.flatten(batch) if t is not None]
    return int(leaves[0].shape[0])


def _together(batches, adapter):
    """Batches whose number nobody knows end at the same step on every rank
    (`agreement.ends_together`); `iter()` is called at once."""
    if adapter.num_batches is None:
        return agreement.ends_together(iter(batches))
    return batches


def _round_robin_count(adapter, group):
    total = adapter.num_batches
    if total is None:
        return None
    if total % group.count:
        warn_once(
            ("dataloader-remainder", total, group.count),
            "The DataLoader has %d batches, not a multiple of the %d "
            "replicas: each epoch leaves the last %d out so that every "
            "process runs the same number of steps.",
            total,
            group.count,
            total % group.count,
        )
    return total // group.count


def _round_robin(batches, adapter, group):
    limit = _round_robin_count(adapter, group)
    for position, batch in enumerate(batches):
        if limit is not None and position >= limit * group.count:
            return
        if position % group.count == group.index:
            yield _process_rows(batch, group)


def _as_given(adapter):
    """The adapter's batches as they are (one replica: each is the whole
    global batch), each weighing an even share."""

    def even(batch):
        replicas.batch_weight.forget()
        return batch

    return _wrap(
        adapter,
        lambda batches: (even(b) for b in batches),
        num_batches=adapter.num_batches,
    )


class _WrappedDataAdapter(_keras.DataAdapter):
    """A Keras data adapter whose batches pass through `transform`.

    A transform calls `iter()` on the adapter's batches at once (a generator
    expression does), as Keras does: a DataLoader draws its iterator's seed
    from torch's global generator then, and unseeded dropout needs torch's
    stream exactly where one process has it."""

    def __init__(self, inner, transform, num_batches):
        self._inner = inner
        self._transform = transform
        self._num_batches = num_batches

    def get_numpy_iterator(self):
        return self._transform(self._inner.get_numpy_iterator())

    def get_torch_dataloader(self):
        return self._transform(self._inner.get_torch_dataloader())

    @property
    def num_batches(self):
        return self._num_batches

    @property
    def batch_size(self):
        return self._inner.batch_size

    @property
    def has_partial_batch(self):
        return self._inner.has_partial_batch

    @property
    def partial_batch_size(self):
        return self._inner.partial_batch_size

    def on_epoch_begin(self):
        self._inner.on_epoch_begin()

    def on_epoch_end(self):
        self._inner.on_epoch_end()


def keras_adapter(data_adapter):
    """The Keras data adapter inside `data_adapter` (this module's wrapper
    or a Keras adapter itself)."""
    return getattr(data_adapter, "_inner", data_adapter)


def _wrap(adapter, transform, num_batches):
    return _WrappedDataAdapter(adapter, transform, num_batches)
