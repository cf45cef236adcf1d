"""Ranks that could drift apart stay together (issue 20, items 3 to 5).

- A callback that sets `model.stop_training` on one rank only: every rank
  stops at that step (the numbers of one process stopped there), and every
  rank says which rank stopped.
- Per-process generators of different lengths: every rank ends the epoch
  where the shortest ended, and says which rank ran out.
- Copies equal from creation: with rank-dependent seeds, a 2 x 2 mesh's
  replicated variables and the copies of sharded blocks along the batch
  axis are equal right after the model is built, before any step.
- Per-process inputs that repeat on every replica: one warning naming the
  fix; none when each replica passes its part.
"""

import logging

import numpy as np

from helpers import data
from helpers import set_distribution

ROWS, BATCH = 64, 16


def _model():
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


class _Records:
    """The package logger's records on this rank while the block runs."""

    def __enter__(self):
        from keras_torch_distribution._log import logger

        self.messages = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(
            record.getMessage()
        )
        logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        from keras_torch_distribution._log import logger

        logger.removeHandler(self.handler)


def _weights(model):
    return [np.asarray(v) for v in model.weights]


# ---------------------------------------------------------------------------
# stop_training on one rank
# ---------------------------------------------------------------------------


def stop_on_one_rank(kind, stop_rank, stop_at_batch):
    """fit with a callback that stops training on `stop_rank` only (every
    rank when stop_rank is None: one process)."""
    import keras
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if kind is not None:
        set_distribution(kind)

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == stop_at_batch and stop_rank in (None, rank):
                self.model.stop_training = True

    model = _model()
    x, y = data(ROWS)
    with _Records() as records:
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=3,
            verbose=0,
            callbacks=[StopAt()],
            shuffle=False,
        )
    return history.history["loss"], _weights(model), records.messages


def test_stop_training_on_one_rank_stops_every_rank(pool2):
    reference = stop_on_one_rank(None, None, 1)
    for kind in ("dp", "mp"):
        results = pool2.run(stop_on_one_rank, kind, 1, 1)
        for rank, (losses, weights, messages) in enumerate(results):
            # Stopped in epoch 0 after batch 1, as one process stopped there.
            np.testing.assert_allclose(
                losses, reference[0], rtol=1e-4, atol=2e-5
            )
            for got, want in zip(weights, reference[1]):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
            said = [
                m
                for m in messages
                if "stop_training was set on rank(s) [1] only" in m
            ]
            # Keras counts epochs and batches from 1 (its "Epoch 1/2").
            assert said and "Epoch 1/3, after batch 2" in said[0], (
                kind,
                rank,
                messages,
            )


def test_stop_training_on_every_rank_says_nothing(pool2):
    results = pool2.run(stop_on_one_rank, "dp", None, 2)
    reference = stop_on_one_rank(None, None, 2)
    for losses, weights, messages in results:
        np.testing.assert_allclose(losses, reference[0], rtol=1e-4, atol=2e-5)
        assert not [m for m in messages if "stop_training" in m], messages


# ---------------------------------------------------------------------------
# Per-process generators of different lengths
# ---------------------------------------------------------------------------


def uneven_generators(batches_per_rank):
    """Each rank feeds its own generator (its part of each global batch) of
    batches_per_rank[rank] batches; one process feeds the global batches
    (batches_per_rank None)."""
    import keras
    import torch.distributed as dist

    x, y = data(ROWS)
    if batches_per_rank is None:
        rank, world, count = 0, 1, ROWS // BATCH
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        count = batches_per_rank[rank]
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False)
        )
    per = BATCH // world

    def batches():
        for step in range(count):
            rows = slice(
                step * BATCH + rank * per, step * BATCH + (rank + 1) * per
            )
            yield x[rows], y[rows]

    model = _model()
    with _Records() as records:
        history = model.fit(batches(), epochs=1, verbose=0)
    return history.history["loss"], _weights(model), records.messages


def test_generators_of_different_lengths_end_together(pool2):
    # Rank 1's generator has 2 batches, rank 0's all 4: both stop after 2,
    # with the numbers of one process on the first 2 global batches.
    results = pool2.run(uneven_generators, [4, 2])
    keras_reference = _reference_two_batches()
    for rank, (losses, weights, messages) in enumerate(results):
        for got, want in zip(weights, keras_reference[1]):
            np.testing.assert_allclose(
                got, want, rtol=1e-4, atol=2e-5, err_msg=f"rank {rank}"
            )
        said = [
            m
            for m in messages
            if "Rank(s) [1] ran out of input after 2 batches" in m
        ]
        assert said, (rank, messages)


def _reference_two_batches():
    import keras

    x, y = data(ROWS)
    model = _model()
    history = model.fit(
        x[: 2 * BATCH],
        y[: 2 * BATCH],
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        shuffle=False,
    )
    keras.backend.clear_session()
    return history.history["loss"], _weights(model)


# ---------------------------------------------------------------------------
# Copies equal from creation
# ---------------------------------------------------------------------------


def build_with_rank_seeds(kind):
    """Build (no step) with seed 1000 + rank; every rank's local values."""
    import keras
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    set_distribution(kind)
    keras.utils.set_random_seed(1000 + dist.get_rank())
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="out"),
            keras.layers.Dense(3, name="side"),  # replicated under the rules
        ]
    )
    local = {}
    for variable in model.weights:
        value = variable.value
        local[variable.path] = (
            (value.to_local() if isinstance(value, DTensor) else value)
            .detach()
            .numpy()
            .copy()
        )
    return local


def test_copies_are_equal_from_creation_on_2x2_mesh(pool4):
    # Ranks 0 and 2 hold the same block of each sharded kernel (model
    # coordinate 0 of batch coordinates 0 and 1); every rank holds the
    # replicated ones whole.
    local = pool4.run(build_with_rank_seeds, "hybrid")
    for path in local[0]:
        np.testing.assert_array_equal(
            local[2][path], local[0][path], err_msg=path
        )
        np.testing.assert_array_equal(
            local[3][path], local[1][path], err_msg=path
        )
    for path in ("side/kernel", "side/bias", "out/bias"):
        full = [p for p in local[0] if p.endswith(path)]
        assert full, list(local[0])
        for rank in (1, 2, 3):
            np.testing.assert_array_equal(
                local[rank][full[0]], local[0][full[0]]
            )
    # The blocks of a sharded kernel differ (rank 0 and 1 hold other columns).
    hidden = [p for p in local[0] if p.endswith("hidden/kernel")][0]
    assert local[0][hidden].shape == (6, 4)
    assert not np.array_equal(local[0][hidden], local[1][hidden])


def test_copies_are_equal_from_creation_data_parallel(pool2):
    local = pool2.run(build_with_rank_seeds, "dp")
    for path in local[0]:
        np.testing.assert_array_equal(
            local[1][path], local[0][path], err_msg=path
        )


# ---------------------------------------------------------------------------
# Per-process inputs that repeat on every replica
# ---------------------------------------------------------------------------


def per_process_inputs(same_everywhere):
    import keras
    import torch.distributed as dist

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False)
    )
    x, y = data(ROWS)
    if not same_everywhere:
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = x[rank::world], y[rank::world]
    model = _model()
    with _Records() as records:
        model.fit(x, y, batch_size=BATCH // 2, epochs=1, verbose=0)
    return records.messages


def test_identical_per_process_inputs_warn_once(pool2):
    messages = pool2.run(per_process_inputs, True)[0]
    said = [m for m in messages if "passed the same rows" in m]
    assert len(said) == 1, messages
    assert "fit(): every one of the 2 data-parallel replicas" in said[0]
    assert "auto_shard_dataset=True" in said[0]
    messages = pool2.run(per_process_inputs, False)[0]
    assert not [m for m in messages if "passed the same rows" in m], messages
