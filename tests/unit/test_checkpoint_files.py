"""Checkpoint paths and files refused in the pytest process (no pool):
missing, incomplete and foreign folders, unserializable extras, an unbuilt
model, and DCP metadata that points outside the checkpoint.

Checkpoints on gloo ranks, and hostile, damaged or mismatched ones, are in
multiprocess/test_checkpoint.py and multiprocess/test_checkpoint_safety.py.
"""

import pickle

import pytest

from helpers import checkpoint_model
from helpers import record_file


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
    with pytest.raises(checkpoint.NotACheckpointError, match="is not a complete checkpoint"):
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
    unbuilt = __import__("keras").Sequential([__import__("keras").layers.Dense(2)])
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
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="not one of the checkpoint's files"):
        checkpoint.load(checkpoint_model(), path)
