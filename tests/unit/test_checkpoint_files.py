"""Checkpoint paths and files refused in the pytest process (no pool):
missing, incomplete and foreign folders, unserializable extras, an unbuilt
model, DCP metadata that points outside the checkpoint, and one host's copy
of a checkpoint saved on hosts that did not share its folder.

Checkpoints on gloo ranks, and hostile, damaged or mismatched ones, are in
multiprocess/test_checkpoint.py and multiprocess/test_checkpoint_safety.py.
"""

import pickle

import pytest

from helpers import checkpoint_model
from helpers import record_file
from helpers import rewrite_marker


def test_incomplete_and_foreign_paths_are_refused(tmp_path):
    from keras_torch_distribution import checkpoint

    model = checkpoint_model()
    with pytest.raises(checkpoint.NotACheckpointError, match="does not exist"):
        checkpoint.load(model, tmp_path / "nothing")
    # What a process that died while writing leaves behind.
    (tmp_path / "ckpt.incomplete").mkdir()
    (tmp_path / "ckpt.incomplete" / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(checkpoint.NotACheckpointError, match="incomplete"):
        checkpoint.load(model, tmp_path / "ckpt")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(
        checkpoint.NotACheckpointError, match="is not a complete checkpoint"
    ):
        checkpoint.load(model, tmp_path / "plain")
    with pytest.raises(FileExistsError, match="exists and is not a checkpoint"):
        checkpoint.save(model, tmp_path / "plain")
    assert (tmp_path / "plain" / "notes.txt").read_text() == "mine"
    with pytest.raises(TypeError, match="JSON-serializable"):
        checkpoint.save(model, tmp_path / "x", extra={"f": object()})
    # A save over the stale temporary directory completes and replaces it.
    checkpoint.save(model, tmp_path / "ckpt")
    assert checkpoint.is_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt.incomplete").exists()
    unbuilt = __import__("keras").Sequential(
        [__import__("keras").layers.Dense(2)]
    )
    with pytest.raises(ValueError, match="is not built"):
        checkpoint.load(unbuilt, tmp_path / "ckpt")


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from keras_torch_distribution import checkpoint

    path = tmp_path / "ckpt"
    checkpoint.save(checkpoint_model(), path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()  # our own file
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    record_file(str(path), ".metadata")
    with pytest.raises(
        checkpoint.UnsafeCheckpointError,
        match="not one of the checkpoint's files",
    ):
        checkpoint.load(checkpoint_model(), path)


def test_missing_file_is_named_and_unwritable_folder_is_a_write_error(tmp_path):
    from keras_torch_distribution import checkpoint

    model = checkpoint_model()
    checkpoint.save(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").unlink()
    with pytest.raises(checkpoint.NotACheckpointError) as error:
        checkpoint.load(model, tmp_path / "ckpt")
    assert "has no '.metadata'" in str(error.value)
    assert "keras_checkpoint" not in str(error.value).split("it has no")[-1]
    # A folder the job cannot create (a file stands where a directory must
    # be; chmod does not stop root): CheckpointWriteError with the path.
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" / "ckpt"
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        checkpoint.save(model, target)
    assert str(target) in str(error.value) and "NotADirectoryError" in str(
        error.value
    )
    assert "Choose a folder this job can write to" in str(error.value)


def test_a_failed_save_leaves_no_incomplete_folder(tmp_path, monkeypatch):
    from keras_torch_distribution import checkpoint
    from keras_torch_distribution.checkpoint import _streams

    model = checkpoint_model()

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    real_open = _streams._open
    calls = []

    def failing_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".distcp"):
            calls.append(path)
            no_space()
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(_streams, "_open", failing_open)
    with pytest.raises(
        checkpoint.CheckpointWriteError, match="No space left on device"
    ):
        checkpoint.save(model, tmp_path / "ckpt")
    assert calls
    assert not (tmp_path / "ckpt.incomplete").exists()
    assert not (tmp_path / "ckpt").exists()


def test_one_hosts_copy_of_a_split_checkpoint_names_what_it_lacks(tmp_path):
    """What a host whose ranks wrote only some files holds: the marker
    lists another host's file, which is not there."""
    from keras_torch_distribution import checkpoint
    from keras_torch_distribution.checkpoint import inspect

    path = tmp_path / "ckpt"
    checkpoint.save(checkpoint_model(), path)

    def split(marker):
        marker["storage_groups"] = [[0], [1, 2]]
        for rank in (1, 2):
            marker["files"][f"__{rank}_0.distcp"] = {
                "bytes": 10,
                "crc32": "00000000",
                "rank": rank,
                "host": "node-b",
            }

    rewrite_marker(str(path), split)
    with pytest.raises(checkpoint.SplitCheckpointError) as error:
        checkpoint.load(checkpoint_model(), path)
    message = str(error.value)
    assert "lacks 2 file(s) written by rank(s) [1, 2]" in message
    assert "'__1_0.distcp', '__2_0.distcp'" in message
    assert f"rsync -a node-b:{path}/ {path}/" in message
    assert error.value.missing == {
        "__1_0.distcp": (1, "node-b"),
        "__2_0.distcp": (2, "node-b"),
    }
    again = pickle.loads(pickle.dumps(error.value))  # crosses ranks
    assert again.missing == error.value.missing and str(again) == message
    # It is not a checkpoint there (what `ktd report` reports).
    assert isinstance(error.value, checkpoint.NotACheckpointError)
    with pytest.raises(checkpoint.SplitCheckpointError):
        inspect.verify(path)


def test_storage_groups_from_the_probes_each_rank_saw():
    from keras_torch_distribution.checkpoint import _storage

    # Ranks 0-1 on one disk, 2-3 on another: 0 and 2 (their hosts' first
    # ranks) read each other's probes, the others their first rank's.
    assert _storage._groups_from([[0], [0], [2], [2]]) == [[0, 1], [2, 3]]
    assert _storage._groups_from([[0, 2], [0], [2], [2]]) == [[0, 1, 2, 3]]
    # Rank 3 does not see its host's first rank (a container with mounts
    # of its own) but sees rank 4, on the same mounts.
    seen = [[0], [0], [2], [3, 4], [3, 4]]
    assert _storage._groups_from(seen) == [[0, 1], [2], [3, 4]]
    assert _storage._groups_from([[], [], [2]]) == [[0], [1], [2]]
