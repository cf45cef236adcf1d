"""What a layout map leaves whole is said (issue 18, item 5).

keras_hub's Llama map has no key for `token_embedding/reverse_embeddings`:
under it, that matrix is whole on every rank. `fit` logs one warning naming
it, its bytes per rank and the LayoutMap key that would shard it; the shard
report and `ktd report CHECKPOINT` mark it. With the key added, nothing is
logged and the variable is stored 1/2 per rank.
"""

import logging
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import LogRecords  # noqa: E402

keras_hub = pytest.importorskip("keras_hub")

VOCAB, SEQ, ROWS = 64, 8, 8
# The tiny Llama's whole bytes: embeddings and reverse_embeddings 64 x 16,
# per block q, k, v, o 16 x 2 x 8, MLP 3 x 16 x 32, 2 norms, final norm.
MODEL_BYTES = 4 * (2 * VOCAB * 16 + 2 * (4 * 256 + 3 * 16 * 32 + 2 * 16) + 16)
REVERSE_BYTES = 4 * 16 * VOCAB

WARNING = (
    "Variable 'token_embedding/reverse_embeddings' (shape (16, 64)) is whole "
    "on every rank: 4,096 bytes per rank, {share:.1f}% of the model's "
    "variables, with its gradient and optimizer slots, while the LayoutMap "
    "shards 15 other variables. No LayoutMap key shards it. To store it 1/2 "
    "per rank, add layout_map['token_embedding/reverse_embeddings'] = "
    "(None, 'batch') before building the model."
).format(share=100 * REVERSE_BYTES / MODEL_BYTES)


def _fit_llama(shard_reverse, checkpoint_dir=None):
    import keras_torch_distribution as ktd
    from keras_torch_distribution import checkpoint

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    if shard_reverse:
        layout_map["token_embedding/reverse_embeddings"] = (None, "batch")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ids = np.random.default_rng(0).integers(1, VOCAB, (ROWS, SEQ + 1))
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((ROWS, SEQ), bool)}
    records = LogRecords()
    logger = logging.getLogger("keras_torch_distribution")
    logger.addHandler(records)
    try:
        model.fit(x, ids[:, 1:], batch_size=4, epochs=2, verbose=0)
        model.evaluate(x, ids[:, 1:], batch_size=4, verbose=0)
    finally:
        logger.removeHandler(records)
    reverse = model.backbone.token_embedding.reverse_embeddings
    tables = ktd.report(model, print_fn=lambda text: None)
    if checkpoint_dir is not None:
        checkpoint.save(model, checkpoint_dir)
    return dict(
        messages=[m for m in records.messages if "whole on every rank" in m],
        local_shape=tuple(reverse.value.to_local().shape)
        if hasattr(reverse.value, "to_local")
        else tuple(reverse.value.shape),
        marked=[row["path"] for row in tables[0] if row.get("left_whole")],
    )


@pytest.mark.slow
def test_map_that_leaves_reverse_embeddings_whole_warns_once(pool2, tmp_path):
    from keras_torch_distribution._report import checkpoint_table
    from keras_torch_distribution._report import format_checkpoint_table

    path = str(tmp_path / "ckpt")
    rank0, rank1 = pool2.run(_fit_llama, False, path)
    # One warning for the two fits and the evaluate, on rank 0 only.
    assert rank0["messages"] == [WARNING], rank0["messages"]
    assert rank1["messages"] == []
    assert rank0["local_shape"] == (16, VOCAB)
    assert rank0["marked"] == ["token_embedding/reverse_embeddings"]
    rows = checkpoint_table(path)
    marked = [row["key"] for row in rows if row.get("whole")]
    assert marked == ["model/token_embedding/reverse_embeddings"]
    text = format_checkpoint_table(rows)
    assert (
        "WHOLE: model/token_embedding/reverse_embeddings was whole on every "
        f"rank ({100 * REVERSE_BYTES / MODEL_BYTES:.1f}% of the model's "
        "bytes); layout_map['token_embedding/reverse_embeddings'] = "
        "(None, 'batch') would shard it"
    ) in text, text


@pytest.mark.slow
def test_no_warning_when_every_large_variable_is_sharded(pool2, tmp_path):
    from keras_torch_distribution._report import checkpoint_table

    path = str(tmp_path / "ckpt")
    results = pool2.run(_fit_llama, True, path)
    for result in results:
        assert result["messages"] == []
        assert result["marked"] == []
        assert result["local_shape"] == (16, VOCAB // 2)
    assert not [
        row["key"] for row in checkpoint_table(path) if row.get("whole")
    ]
