"""`callbacks.Throughput` in one process: its figures against a count by
hand (rows, tokens, steps) over the time it measured, which a test
callback around it encloses; the progress line shows them; MFU where the
FLOPs are known (the 2-process global counts and worst rank are in
tests/multiprocess/test_throughput_ranks.py)."""

import re
import resource
import time

import keras
import numpy as np
import pytest

from keras_torch_distribution import callbacks

ROWS, BATCH, SEQ = 44, 8, 6  # 5 full batches and one of 4 rows


class Clock(keras.callbacks.Callback):
    """Each epoch's wall time, around the callbacks after it."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.ended = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self.ended - self.started)


def _fit(x, throughput, verbose=0):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(x.shape[1:], dtype=str(x.dtype)),
            keras.layers.Embedding(20, 4)
            if x.dtype.kind == "i"
            else keras.layers.Dense(4),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    model.compile("sgd", "mse")
    clock = Clock()
    history = model.fit(
        x,
        np.ones((len(x), 1), "float32"),
        batch_size=BATCH,
        epochs=2,
        callbacks=[throughput, clock],
        verbose=verbose,
    )
    return history, clock


def test_figures_against_a_count_by_hand(capsys):
    ids = np.random.default_rng(0).integers(0, 20, (ROWS, SEQ))
    throughput = callbacks.Throughput()
    history, clock = _fit(ids, throughput, verbose=2)
    assert len(throughput.epochs) == 2
    for epoch, outer in zip(throughput.epochs, clock.seconds):
        assert epoch["steps"] == 6  # ceil(44 / 8)
        assert epoch["samples"] == ROWS
        assert epoch["tokens"] == ROWS * SEQ
        assert 0 < epoch["seconds"] <= outer
        # As Keras' ms/step: the rates leave out the epoch's first step
        # (8 rows), which compiles and warms up (issue 48).
        timed = epoch["timed"]
        assert (timed["steps"], timed["samples"]) == (5, ROWS - BATCH)
        assert timed["tokens"] == (ROWS - BATCH) * SEQ
        seconds = timed["seconds"]
        assert 0 < seconds < epoch["seconds"]
        assert epoch["samples/s"] == pytest.approx((ROWS - BATCH) / seconds)
        assert epoch["tokens/s"] == pytest.approx(
            (ROWS - BATCH) * SEQ / seconds
        )
        assert epoch["step_ms"] == pytest.approx(1000 * seconds / 5)
        # this process's peak resident set, read at the epoch's end
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        assert 0 < epoch["peak_bytes"][0] <= peak
        assert epoch["peak_mem_MiB"] == epoch["peak_bytes"][0] / 2**20
        assert epoch["peak_mem_rank"] == 0
        assert "MFU" not in epoch and not epoch["mfu_known"]
    assert history.history["samples/s"] == [
        e["samples/s"] for e in throughput.epochs
    ]
    out = capsys.readouterr().out
    for name in ("samples/s:", "tokens/s:", "step_ms:", "peak_mem_MiB:"):
        assert out.count(name) == 2, out
    # Each figure with the digits it needs; no rank in one process.
    assert "peak_mem_rank" not in out
    line = [row for row in out.splitlines() if "samples/s:" in row][-1]
    assert re.search(r"peak_mem_MiB: \d+( |$)", line), line
    assert not re.search(r"(samples/s|tokens/s|step_ms): \d+\.\d{4}", line)
    assert len(line) < 140, line


def test_a_figure_is_a_float_shown_with_the_digits_it_needs():
    figure = callbacks.Figure(651.23)
    assert figure == 651.23 and isinstance(figure, float)
    assert f"{figure:.4f}" == "651" and f"{figure / 1:.4e}" == "651"
    assert f"{callbacks.Figure(98.34):.4f}" == "98.3"
    assert f"{callbacks.Figure(0.4123):.4f}" == "0.41"
    assert f"{callbacks.Figure(0, whole=True):.4e}" == "0"
    assert f"{callbacks.Figure(812.7, whole=True):.4f}" == "813"


def test_float_inputs_have_no_tokens_and_mfu_where_flops_are_known():
    x = np.random.default_rng(0).normal(size=(ROWS, 3)).astype("float32")
    throughput = callbacks.Throughput(flops_per_sample=1e6, peak_flops=1e9)
    _fit(x, throughput)
    epoch = throughput.epochs[-1]
    assert epoch["tokens"] is None and "tokens/s" not in epoch
    assert epoch["MFU"] == pytest.approx(1e6 * epoch["samples/s"] / 1e9)
