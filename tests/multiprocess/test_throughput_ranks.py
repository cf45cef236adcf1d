"""`callbacks.Throughput` on 2 gloo processes under DataParallel: samples
and tokens are the global batch's (both replicas' rows, counted by hand),
every rank has the same figures, and the peak memory is every rank's,
gathered at the epoch's end, the worst one named."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

ROWS, BATCH, SEQ = 44, 8, 6  # global batches: 5 of 8 rows, one of 4


def _fit_with_throughput():
    import resource

    import keras

    from keras_torch_distribution import callbacks

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((SEQ,), dtype="int32"),
                keras.layers.Embedding(20, 4),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        model.compile("sgd", "mse")
        ids = np.random.default_rng(0).integers(0, 20, (ROWS, SEQ))
        throughput = callbacks.Throughput()
        model.fit(
            ids,
            np.ones((ROWS, 1), "float32"),
            batch_size=BATCH,
            epochs=1,
            callbacks=[throughput],
            verbose=0,
        )
    finally:
        keras.distribution.set_distribution(None)
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return throughput.epochs[-1], own_peak


def test_global_figures_and_the_worst_rank(pool2):
    results = pool2.run(_fit_with_throughput)
    (first, _), (second, _) = results
    for rank, (epoch, own_peak) in enumerate(results):
        assert epoch["steps"] == 6
        assert epoch["samples"] == ROWS  # both replicas' rows
        assert epoch["tokens"] == ROWS * SEQ
        timed = epoch["timed"]  # after the first step, as Keras' ms/step
        assert timed["samples"] == ROWS - BATCH
        assert epoch["samples/s"] == timed["samples"] / timed["seconds"]
        assert 0 < epoch["peak_bytes"][rank] <= own_peak
    assert first["peak_bytes"] == second["peak_bytes"]
    worst = int(np.argmax(first["peak_bytes"]))
    for epoch, _ in results:
        assert epoch["peak_mem_rank"] == worst
        assert epoch["peak_mem_MiB"] == first["peak_bytes"][worst] / 2**20
