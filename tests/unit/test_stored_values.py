"""A weights file's value read when used (`_distributed.stored_values`):
blocks read alone and counted, the whole value read once, bfloat16 as
Keras stores it, a closed file opened again or refused with the fix; a
safetensors file read box by box with positioned reads
(`_distributed.safetensors_file`): every dtype, equal to safetensors' own
reads, one read per contiguous run."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import h5py  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from keras_torch_distribution._distributed import safetensors_file  # noqa: E402
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


# -- a tensor of a safetensors file, transposed and reshaped unread -------

safetensors_numpy = pytest.importorskip("safetensors.numpy")
HF = np.arange(8 * 12, dtype="float32").reshape(8, 12)


@pytest.fixture
def tensor_file(tmp_path):
    path = str(tmp_path / "model.safetensors")
    safetensors_numpy.save_file({"w": HF, "s": np.array(3.0, "float32")}, path)
    f = safetensors_file.SafetensorsFile(path)
    yield f
    f.close()


def _chains(value, whole):
    """(transformed value, the same numpy ops on the whole): the ones
    keras_hub's converters apply (Llama / Qwen: `np.reshape(np.transpose(x),
    shape)`; Gemma: `np.transpose(np.reshape(x, ...), axes)`; Mistral:
    `.astype`), and longer ones."""
    yield value, whole
    yield np.transpose(value, axes=(1, 0)), np.transpose(whole, axes=(1, 0))
    yield (
        np.reshape(np.transpose(value), [12, 2, 4]),
        np.reshape(np.transpose(whole), [12, 2, 4]),
    )
    yield (
        np.transpose(np.reshape(value, (2, 4, 12)), axes=(0, 2, 1)),
        np.transpose(np.reshape(whole, (2, 4, 12)), axes=(0, 2, 1)),
    )
    yield (
        np.transpose(np.reshape(value, (2, 4, 12)), axes=(1, 2, 0)),
        np.transpose(np.reshape(whole, (2, 4, 12)), axes=(1, 2, 0)),
    )
    yield (
        np.reshape(value.T.astype(np.float16), (3, 4, -1)).transpose(2, 0, 1),
        np.reshape(whole.T.astype(np.float16), (3, 4, -1)).transpose(2, 0, 1),
    )
    yield value.reshape(4, 24).reshape(96), whole.reshape(96)
    yield value.reshape(12, 8), whole.reshape(12, 8)  # groups across dims


def _boxes(shape, rng, count=12):
    for _ in range(count):
        box = []
        for n in shape:
            lo = int(rng.integers(0, n))
            box.append((lo, int(rng.integers(lo + 1, n + 1))))
        yield tuple(box)


def test_blocks_of_transposed_and_reshaped_tensors_equal_numpys(tensor_file):
    rng = np.random.default_rng(0)
    value = stored_values.tensor_file_value(tensor_file, "w")
    assert isinstance(value, stored_values.TensorFileValue)
    assert stored_values.is_stored_value(value)
    for lazy, expected in _chains(value, HF):
        assert lazy.shape == expected.shape and lazy.dtype == expected.dtype
        for box in _boxes(expected.shape, rng):
            stored_values.reads.clear()
            block = lazy.read_block(box)
            want = expected[tuple(slice(lo, hi) for lo, hi in box)]
            np.testing.assert_array_equal(block.numpy(), want, err_msg=str(box))
            assert stored_values.reads.bytes <= HF.nbytes
        into = torch.empty(expected.shape, dtype=torch.float64)
        lazy.read_block(tuple((0, n) for n in expected.shape), into=into)
        np.testing.assert_array_equal(into.numpy(), expected)
        assert lazy._whole is None  # none of this read the whole tensor


def test_blocks_through_transposes_are_read_in_pieces(tensor_file, monkeypatch):
    """Into a variable's tensor, a block through transposes and casts is
    read a few stored rows at a time (no whole block on the host)."""
    monkeypatch.setattr(stored_values, "PIECE_BYTES", 2 * 12 * 4)
    rng = np.random.default_rng(3)
    value = stored_values.tensor_file_value(tensor_file, "w")
    for lazy, expected in (
        (value.T, HF.T),
        (np.transpose(value).astype(np.float16), HF.T.astype(np.float16)),
        (value.astype(np.float64), HF.astype(np.float64)),
    ):
        for box in _boxes(expected.shape, rng):
            want = expected[tuple(slice(lo, hi) for lo, hi in box)]
            into = torch.zeros(want.shape, dtype=torch.float32)
            stored_values.reads.clear()
            assert lazy.read_block(box, into=into) is into
            np.testing.assert_array_equal(
                into.numpy(), want.astype(np.float32), err_msg=str(box)
            )
            assert stored_values.reads.largest <= 2 * 12 * 4, box
            assert stored_values.reads.bytes == want.size * 4, box


def test_a_block_is_read_alone_where_the_reshape_keeps_it_a_box(tensor_file):
    value = stored_values.tensor_file_value(tensor_file, "w")
    # Llama's query kernel: (heads * head_dim, hidden) -> (hidden, heads,
    # head_dim); heads sharded, head_dim whole: exactly the block is read.
    query = np.reshape(np.transpose(value), (12, 2, 4))
    stored_values.reads.clear()
    query.read_block(((0, 12), (1, 2), (0, 4)))
    assert stored_values.reads.bytes == 12 * 4 * 4
    # head_dim sharded: every head's rows (the smallest box holding them).
    stored_values.reads.clear()
    block = query.read_block(((0, 12), (0, 2), (2, 4)))
    assert stored_values.reads.bytes == 12 * 8 * 4
    expected = np.reshape(HF.T, (12, 2, 4))[:, :, 2:4]
    np.testing.assert_array_equal(block.numpy(), expected)


def test_other_uses_read_the_whole_tensor_once_and_say_why(tensor_file):
    from keras_torch_distribution import _log

    value = np.transpose(stored_values.tensor_file_value(tensor_file, "w"))
    stored_values.reads.clear()
    with pytest.MonkeyPatch.context() as patch:
        said = []
        patch.setattr(_log, "warn_once", lambda *a: said.append(a))
        np.testing.assert_array_equal(value * 2, HF.T * 2)
        np.testing.assert_array_equal(np.split(value, 2)[1], HF.T[6:])
        np.testing.assert_array_equal(value[3], HF.T[3])
    assert stored_values.reads.bytes == HF.nbytes  # once, said once
    assert [a[2] for a in said] == ["np.multiply"], said
    assert "reads it whole on every rank" in said[0][1]
    # A 0-d tensor is read at once.
    assert stored_values.tensor_file_value(tensor_file, "s") == 3.0


def test_reshape_and_transpose_arguments_are_numpys(tensor_file):
    value = stored_values.tensor_file_value(tensor_file, "w")
    with pytest.raises(ValueError, match="cannot reshape array of size 96"):
        value.reshape(5, -1)
    with pytest.raises(ValueError, match="axes don't match array"):
        np.transpose(value, (0, 0))
    assert np.transpose(value, (-1, 0)).shape == (12, 8)
    assert value.reshape((-1,)).shape == (96,)


def _safetensors_tensors():
    rng = np.random.default_rng(1)
    tensors = {
        "f32": rng.standard_normal((5, 6, 7)).astype("float32"),
        "f16": rng.standard_normal((4, 9)).astype("float16"),
        "f64": rng.standard_normal((3, 4)),
        "bf16": rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-9, 9, (7, 3)).astype("int64"),
        "i32": rng.integers(-9, 9, (2, 3, 4)).astype("int32"),
        "u8": rng.integers(0, 255, (8, 8)).astype("uint8"),
        "bool": rng.integers(0, 2, (5, 5)).astype(bool),
        "vector": np.arange(10, dtype="float32"),
    }
    return tensors


def test_safetensors_boxes_equal_safetensors_own_reads(tmp_path):
    from safetensors import safe_open

    tensors = _safetensors_tensors()
    path = str(tmp_path / "all.safetensors")
    safetensors_numpy.save_file(tensors, path, metadata={"format": "np"})
    rng = np.random.default_rng(2)
    reader = safetensors_file.SafetensorsFile(path)
    with safe_open(path, framework="np") as theirs:
        assert sorted(reader.keys()) == sorted(theirs.keys())
        for key, value in tensors.items():
            assert reader.info(key) == (value.shape, value.dtype), key
            np.testing.assert_array_equal(reader.read_whole(key), value)
            for box in _boxes(value.shape, rng, count=20):
                got = reader.read_box(key, box)
                want = theirs.get_slice(key)[tuple(slice(*b) for b in box)]
                assert got.dtype == want.dtype, key
                np.testing.assert_array_equal(got, want, err_msg=str(box))
    # Into a given array; an empty box reads nothing.
    out = np.empty((2, 6, 3), "float32")
    assert reader.read_box("f32", ((1, 3), (0, 6), (2, 5)), out=out) is out
    np.testing.assert_array_equal(out, tensors["f32"][1:3, :, 2:5])
    assert reader.read_box("f32", ((1, 1), (0, 6), (0, 7))).shape == (0, 6, 7)
    reader.close()


def test_safetensors_runs_merge_over_whole_trailing_dims():
    runs = safetensors_file.runs
    # Rows: one run; the whole tensor: one run.
    assert list(runs((8, 12), ((2, 5), (0, 12)))[0]) == [24]
    assert runs((8, 12), ((2, 5), (0, 12)))[1] == 36
    assert runs((8, 12), ((0, 8), (0, 12)))[1] == 96
    # Columns: one run per row.
    offsets, run = runs((8, 12), ((0, 3), (4, 6)))
    assert list(offsets) == [4, 16, 28]
    assert run == 2
    # A box of whole trailing dims under a cut one: a run per outer index.
    offsets, run = runs((2, 3, 4, 5), ((0, 2), (1, 3), (0, 4), (0, 5)))
    assert list(offsets) == [20, 80]
    assert run == 40


def test_safetensors_reads_one_positioned_read_per_run(tmp_path, monkeypatch):
    path = str(tmp_path / "w.safetensors")
    safetensors_numpy.save_file({"w": HF}, path)
    reader = safetensors_file.SafetensorsFile(path)
    reader.keys()
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: calls.append(a[2]) or real(*a))
    np.testing.assert_array_equal(
        reader.read_box("w", ((2, 6), (0, 12))), HF[2:6]
    )
    assert len(calls) == 1
    calls.clear()
    np.testing.assert_array_equal(
        reader.read_box("w", ((2, 6), (3, 5))), HF[2:6, 3:5]
    )
    header = reader._data_start
    assert calls == [header + 4 * (12 * row + 3) for row in range(2, 6)]
    reader.close()


def test_safetensors_damage_and_unknown_names_say_what(tmp_path):
    path = str(tmp_path / "w.safetensors")
    safetensors_numpy.save_file({"w": HF}, path)
    reader = safetensors_file.SafetensorsFile(path)
    with pytest.raises(KeyError, match="has no tensor 'v'"):
        reader.info("v")
    with pytest.raises(ValueError, match=r"box \(\(0, 9\), \(0, 12\)\) is not"):
        reader.read_box("w", ((0, 9), (0, 12)))
    reader.close()
    with open(path, "r+b") as f:  # truncate the data
        f.truncate(os.path.getsize(path) - 8)
    reader = safetensors_file.SafetensorsFile(path)
    with pytest.raises(EOFError, match="the file is truncated"):
        reader.read_box("w", ((7, 8), (0, 12)))
    reader.close()
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        safetensors_file.SafetensorsFile(str(short)).keys()


def test_keras_hub_files_read_blocks_from_the_path_the_loader_asked_for(
    tmp_path, monkeypatch
):
    """`_saving.loader_path` notes the path keras_hub's loader fetches;
    `_saving.loader_file` pairs the file it then opens with a reader of
    that path (closed with the loader), or, the path unknown, leaves the
    file keras_hub's own and says so."""
    import contextlib

    from safetensors import safe_open

    from keras_torch_distribution import _log
    from keras_torch_distribution import _saving
    from keras_torch_distribution._variables import born_sharded

    path = str(tmp_path / "model.safetensors")
    safetensors_numpy.save_file({"w": HF}, path)
    monkeypatch.setattr(born_sharded.state, "sharded_exist", True)
    said = []
    monkeypatch.setattr(_log, "warn_once", lambda *a: said.append(a))

    def enter(loader, context):
        return contextlib.ExitStack.enter_context(loader, context)

    with contextlib.ExitStack() as loader:
        local = _saving.loader_path(
            lambda preset, name: os.path.join(preset, name),
            str(tmp_path),
            "model.safetensors",
        )
        assert local == path
        file = _saving.loader_file(
            enter, loader, safe_open(local, framework="np")
        )
        assert isinstance(file, _saving.SliceReadingFile)
        assert _saving.loader_paths.last is None  # taken
        np.testing.assert_array_equal(file.get_tensor("w"), HF)
        monkeypatch.setattr(_saving.sharded_ports, "depth", 1)
        value = file.get_tensor("w")
        assert isinstance(value, stored_values.TensorFileValue)
        np.testing.assert_array_equal(
            value.T.read_block(((2, 5), (1, 3))).numpy(), HF.T[2:5, 1:3]
        )
        reader = file._reader
        assert reader._file is not None
        # A file opened without its path asked for first: keras_hub's own.
        opened = safe_open(path, framework="np")
        assert _saving.loader_file(enter, loader, opened) is opened
        assert "did not see" in said[0][1]
    assert reader._file is None  # closed with the loader
