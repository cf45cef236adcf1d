"""Stream and slice: every block of a sharded variable, initialized alone, is
bit for bit the same block of the value one Keras process gives.

Single process: `sharded_init.init_block` is called directly with each box a
layout gives (DTensor `Shard` semantics: ceil-sized pieces, the last ones
smaller or empty), and compared with `np.array_equal` to the slice of the full
value of a fresh instance of the same initializer (same seed).
"""

import itertools
import logging
import math

import keras
import numpy as np
import pytest
import torch

from keras_torch_distribution import _log
from keras_torch_distribution._variables import sharded_init

# (shape, pieces per dim): shard on dim 0, dim 1, both, uneven, 1-D biases,
# 3-D and 4-D conv kernels, shapes under 16 values, rows that are not a
# multiple of 16 values.
LAYOUTS = [
    ((1001, 6), (2, 1)),
    ((6, 1001), (1, 2)),
    ((33, 17), (2, 2)),
    ((40, 16), (4, 1)),
    ((40, 16), (2, 2)),
    ((3, 4), (2, 1)),
    ((3, 4), (1, 2)),
    ((5, 3), (4, 1)),  # uneven with an empty last block
    ((2, 2), (2, 2)),
    ((7,), (2,)),
    ((1001,), (4,)),
    ((5, 7, 9), (1, 1, 2)),
    ((5, 7, 9), (2, 1, 1)),
    ((3, 3, 5, 8), (1, 1, 1, 2)),
    ((3, 3, 5, 8), (1, 1, 2, 2)),
    ((3, 3, 5, 8), (2, 1, 1, 4)),
    ((1, 1, 3, 5), (1, 1, 1, 2)),
]

SEEDED = {
    "random_normal": lambda: keras.initializers.RandomNormal(0.5, 2.0, seed=11),
    "random_uniform": lambda: keras.initializers.RandomUniform(
        -3.0, 1.0, seed=12
    ),
    "truncated_normal": lambda: keras.initializers.TruncatedNormal(
        0.1, 0.7, seed=13
    ),
    "glorot_uniform": lambda: keras.initializers.GlorotUniform(seed=14),
    "glorot_normal": lambda: keras.initializers.GlorotNormal(seed=15),
    "he_normal": lambda: keras.initializers.HeNormal(seed=16),
    "he_uniform": lambda: keras.initializers.HeUniform(seed=17),
    "lecun_normal": lambda: keras.initializers.LecunNormal(seed=18),
    "lecun_uniform": lambda: keras.initializers.LecunUniform(seed=19),
    "variance_scaling_fan_avg_uniform": lambda: (
        keras.initializers.VarianceScaling(
            scale=0.3, mode="fan_avg", distribution="uniform", seed=20
        )
    ),
    "variance_scaling_fan_out_untruncated": lambda: (
        keras.initializers.VarianceScaling(
            scale=2.5,
            mode="fan_out",
            distribution="untruncated_normal",
            seed=21,
        )
    ),
    "variance_scaling_fan_in_truncated": lambda: (
        keras.initializers.VarianceScaling(
            scale=1.5, mode="fan_in", distribution="truncated_normal", seed=22
        )
    ),
    "seed_generator_normal": lambda: keras.initializers.RandomNormal(
        seed=keras.random.SeedGenerator(23)
    ),
    "seed_generator_glorot": lambda: keras.initializers.GlorotUniform(
        seed=keras.random.SeedGenerator(24)
    ),
    "zeros": lambda: keras.initializers.Zeros(),
    "ones": lambda: keras.initializers.Ones(),
    "constant": lambda: keras.initializers.Constant(0.25),
}


def _pieces(length, count):
    """DTensor Shard boxes of one dim: ceil-sized, the last smaller or empty."""
    chunk = math.ceil(length / count) if length else 0
    out = []
    for index in range(count):
        lo = min(index * chunk, length)
        out.append((lo, min(lo + chunk, length)))
    return out


def _boxes(shape, pieces):
    per_dim = [_pieces(n, p) for n, p in zip(shape, pieces)]
    return [tuple(box) for box in itertools.product(*per_dim)]


def _slices(box):
    return tuple(slice(lo, hi) for lo, hi in box)


def _full(make, shape, dtype="float32"):
    value = make()(shape, dtype=dtype)
    return keras.ops.convert_to_numpy(value)


def _check_all_boxes(make, shape, pieces, dtype="float32", path="v"):
    full = _full(make, shape, dtype)
    assert full.shape == shape
    for box in _boxes(shape, pieces):
        block = sharded_init.init_block(make(), shape, dtype, box, path)
        assert isinstance(block, torch.Tensor)
        expected = full[_slices(box)]
        got = keras.ops.convert_to_numpy(block)
        assert got.shape == expected.shape, (shape, box)
        assert got.dtype == expected.dtype, (shape, box)
        assert np.array_equal(got, expected), (shape, pieces, box)


@pytest.fixture(params=[48, None], ids=["chunk48", "chunk_default"])
def chunk_draws(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(sharded_init, "CHUNK_DRAWS", request.param)
    return request.param


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_every_block_equals_one_process_slice(name, chunk_draws):
    for shape, pieces in LAYOUTS:
        _check_all_boxes(SEEDED[name], shape, pieces)


@pytest.mark.parametrize(
    "name", ["random_normal", "truncated_normal", "glorot_uniform", "he_normal"]
)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float16"])
def test_other_float_dtypes(name, dtype, monkeypatch):
    monkeypatch.setattr(sharded_init, "CHUNK_DRAWS", 48)
    for shape, pieces in [
        ((33, 17), (2, 2)),
        ((3, 4), (1, 2)),
        ((3, 3, 5, 8), (1, 1, 2, 2)),
    ]:
        _check_all_boxes(SEEDED[name], shape, pieces, dtype=dtype)


@pytest.mark.parametrize("max_draws", [1, 16, 17, 48, 100, 4096])
@pytest.mark.parametrize("kind", ["normal", "uniform", "truncated_normal"])
def test_stream_block_any_chunk_size(kind, max_draws):
    """`_stream_block` directly, with explicit (tiny, odd) chunk sizes."""
    make = {
        "normal": SEEDED["random_normal"],
        "uniform": SEEDED["random_uniform"],
        "truncated_normal": SEEDED["truncated_normal"],
    }[kind]
    for shape, pieces in [
        ((1001, 6), (2, 1)),
        ((33, 17), (2, 2)),
        ((3, 4), (2, 2)),
        ((37,), (3,)),
        ((3, 3, 5, 8), (1, 1, 2, 2)),
    ]:
        full = _full(make, shape)
        for box in _boxes(shape, pieces):
            call = sharded_init.record_random_initializer(
                make(), shape, "float32"
            )
            assert call is not None and call.kind == kind
            block = sharded_init._stream_block(
                call, shape, torch.float32, box, max_draws=max_draws
            )
            assert np.array_equal(block.numpy(), full[_slices(box)]), (
                shape,
                box,
            )


def test_arbitrary_boxes(monkeypatch):
    """Boxes no layout of ours makes (middle, single rows, empty) still
    slice."""
    monkeypatch.setattr(sharded_init, "CHUNK_DRAWS", 48)
    shape = (50, 9)
    make = SEEDED["glorot_normal"]
    full = _full(make, shape)
    for box in [
        ((17, 18), (0, 9)),
        ((3, 41), (2, 7)),
        ((49, 50), (8, 9)),
        ((10, 10), (0, 9)),
        ((0, 50), (4, 4)),
    ]:
        block = sharded_init.init_block(make(), shape, "float32", box, "v")
        assert np.array_equal(block.numpy(), full[_slices(box)]), box


@pytest.mark.parametrize("gain", [1.0, 0.5])
def test_identity(gain):
    make = lambda: keras.initializers.Identity(gain=gain)  # noqa: E731
    for shape, pieces in [
        ((33, 17), (2, 2)),
        ((6, 1001), (1, 2)),
        ((4, 4), (2, 2)),
        ((5, 3), (4, 1)),
    ]:
        _check_all_boxes(make, shape, pieces)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_seen(monkeypatch):
    monkeypatch.setattr(_log, "_warned", set())
    handler = _Capture()
    _log.logger.addHandler(handler)
    yield handler.messages
    _log.logger.removeHandler(handler)


def test_orthogonal_falls_back_with_one_warning(warnings_seen):
    make = lambda: keras.initializers.Orthogonal(gain=1.3, seed=5)  # noqa: E731
    for shape, pieces in [((33, 17), (2, 2)), ((6, 40), (1, 2))]:
        _check_all_boxes(make, shape, pieces, path="dense/kernel")
    ortho = [m for m in warnings_seen if "dense/kernel" in m]
    assert len(ortho) == 1, warnings_seen
    assert "Orthogonal" in ortho[0]


class Wavy(keras.initializers.Initializer):
    """A user-defined initializer: no way to initialize it by blocks."""

    def __init__(self, seed=7):
        self.seed = seed

    def __call__(self, shape, dtype=None):
        noise = keras.random.uniform(shape, dtype=dtype, seed=self.seed)
        ramp = keras.ops.reshape(
            keras.ops.arange(math.prod(shape), dtype=dtype), shape
        )
        return keras.ops.sin(ramp) + noise


def test_user_initializer_falls_back_with_one_warning(warnings_seen):
    for shape, pieces in [
        ((33, 17), (2, 2)),
        ((3, 3, 5, 8), (1, 1, 2, 2)),
        ((7,), (2,)),
    ]:
        _check_all_boxes(Wavy, shape, pieces, path="my_layer/kernel")
    _check_all_boxes(Wavy, (4, 6), (2, 1), path="other/kernel")
    mine = [m for m in warnings_seen if "my_layer/kernel" in m]
    other = [m for m in warnings_seen if "other/kernel" in m]
    assert len(mine) == 1 and len(other) == 1, warnings_seen
    assert "Wavy" in mine[0]


def test_built_in_initializers_do_not_warn(warnings_seen, monkeypatch):
    monkeypatch.setattr(sharded_init, "CHUNK_DRAWS", 48)
    for name in sorted(SEEDED):
        _check_all_boxes(
            SEEDED[name], (33, 17), (2, 2), path=f"layer_{name}/kernel"
        )
    _check_all_boxes(lambda: keras.initializers.Identity(), (8, 8), (2, 2))
    assert warnings_seen == []


def test_a_whole_fallback_value_is_computed_on_the_host(monkeypatch):
    """An initializer that cannot be drawn block by block computes the whole
    variable in host memory (a CPU device scope); only the block goes to
    Keras' device ("meta" stands for the GPU here: without the scope, the
    initializer would compute the whole variable there)."""
    from helpers import Allocations
    from keras_torch_distribution import _keras

    shape, box = (40, 16), ((10, 20), (0, 16))
    expected = np.asarray(Wavy()(shape, dtype="float32"))[10:20]
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "meta")
    with Allocations() as made:
        block = sharded_init.init_block(
            Wavy(), shape, "float32", box, "wavy/kernel"
        )
    assert block.device.type == "meta" and tuple(block.shape) == (10, 16)
    assert made.largest("meta") == 10 * 16
    assert made.largest("cpu") == 40 * 16  # whole, on the host only
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "cpu")
    block = sharded_init.init_block(
        Wavy(), shape, "float32", box, "wavy/kernel"
    )
    np.testing.assert_array_equal(block.numpy(), expected)
    assert (
        block.untyped_storage().nbytes() == 10 * 16 * 4
    )  # not a view of the whole
