"""A weights file's value read when used (`_distributed.stored_values`):
blocks read alone and counted, the whole value read once, bfloat16 as
Keras stores it, a closed file opened again or refused with the fix."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import h5py  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from keras_torch_distribution._distributed import stored_values  # noqa: E402

WHOLE = np.arange(6 * 8, dtype="float32").reshape(6, 8)


@pytest.fixture
def dataset(tmp_path):
    path = str(tmp_path / "w.h5")
    with h5py.File(path, "w") as f:
        f["x"] = WHOLE
        bf16 = f.create_dataset("b", data=WHOLE.astype(ml_dtypes.bfloat16))
        bf16.attrs["dtype"] = "bfloat16"  # as Keras' H5IOStore writes it
    f = h5py.File(path, "r")
    yield path, f
    f.close()


def test_a_block_is_read_alone_and_counted(dataset):
    path, f = dataset
    stored_values.reads.clear()
    value = stored_values.StoredValue(f["x"], reopen=path)
    assert value.shape == (6, 8) and value.dtype == np.float32
    assert stored_values.reads.bytes == 0  # shape and dtype read nothing
    block = value.read_block(((2, 4), (4, 8)))
    np.testing.assert_array_equal(block.numpy(), WHOLE[2:4, 4:8])
    assert stored_values.reads.bytes == 2 * 4 * 4
    into = torch.empty((3, 8))
    assert value.read_block(((3, 6), (0, 8)), into=into) is into
    np.testing.assert_array_equal(into.numpy(), WHOLE[3:6])
    assert stored_values.reads.bytes == 2 * 4 * 4 + 3 * 8 * 4
    # An empty block (an uneven shard's last piece) reads nothing.
    assert value.read_block(((6, 6), (0, 8))).shape == (0, 8)
    assert stored_values.reads.count == 2


def test_used_as_an_array_it_is_read_whole_once(dataset):
    path, f = dataset
    stored_values.reads.clear()
    value = stored_values.StoredValue(f["x"], reopen=path)
    np.testing.assert_array_equal(np.asarray(value), WHOLE)
    np.testing.assert_array_equal(value[1], WHOLE[1])
    assert float(value.sum()) == float(WHOLE.sum())
    assert stored_values.reads.bytes == WHOLE.nbytes  # once


def test_bfloat16_blocks_cast_into_float32(dataset):
    path, f = dataset
    value = stored_values.StoredValue(f["b"], bfloat16=True, reopen=path)
    assert value.dtype == np.dtype(ml_dtypes.bfloat16)
    into = torch.empty((2, 8), dtype=torch.float32)
    value.read_block(((0, 2), (0, 8)), into=into)
    np.testing.assert_array_equal(into.numpy(), WHOLE[:2])
    assert value.read_block(((0, 1), (0, 8))).dtype == torch.bfloat16


def test_a_closed_file_is_opened_again_or_the_error_says_why(dataset):
    path, f = dataset
    on_disk = stored_values.StoredValue(f["x"], reopen=path)
    in_memory = stored_values.StoredValue(f["x"])
    kept = stored_values.StoredValue(f["x"]).keep()  # read before closing
    f.close()
    np.testing.assert_array_equal(
        on_disk.read_block(((0, 1), (0, 8))).numpy(), WHOLE[:1]
    )
    np.testing.assert_array_equal(np.asarray(kept), WHOLE)
    with pytest.raises(RuntimeError, match="'/x' was closed before"):
        in_memory.read_block(((0, 1), (0, 8)))
