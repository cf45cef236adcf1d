"""Loading shard by shard: a keras_hub preset (`model.weights.h5`, and
Keras' sharded weights files) saved by one process, loaded on 2 under
ModelParallel with the backbone's own layout map and under FSDP (the same
map on a batch axis of 2): every variable equal to one process's, the
logits too; each rank reads from the files no more than it keeps plus one
block of the largest variable (`stored_values.reads`), and holds no whole
copy of a sharded variable on the way (tracemalloc's peak of host
allocations during `load_weights`: numpy's reads are traced). The same for
a Hugging Face checkpoint that keras_hub converts (safetensors, one file
and sharded with an index), whose tensors keras_hub transposes and
reshapes before `assign`; its blocks are read with positioned reads, so
the file's memory map (safetensors', which keras_hub opens) holds only
the pages of the tensors keras_hub reads whole (/proc/self/smaps).

keras_hub (and safetensors, sentencepiece for its converters) is installed
by .ci/run; without it these tests are skipped.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras_hub = pytest.importorskip("keras_hub")

# The embeddings (VOCAB x HIDDEN, 4 MiB) are the largest variables.
VOCAB, HIDDEN, SEQ, ROWS = 16384, 64, 8, 2
# Python objects h5py and Keras make while loading (traced: about 200 KB).
SLACK = 512 * 1024
# The pages Linux maps around a fault on a file it has cached (its
# fault_around_bytes, 64 KiB).
FAULT_AROUND = 64 * 1024


def _backbone(**kwargs):
    keras.utils.set_random_seed(3)
    return keras_hub.models.LlamaBackbone(
        **kwargs,
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=HIDDEN,
        intermediate_dim=2 * HIDDEN,
    )


def _inputs():
    ids = np.random.default_rng(0).integers(1, VOCAB, (ROWS, SEQ))
    return {
        "token_ids": ids.astype("int32"),
        "padding_mask": np.ones((ROWS, SEQ), bool),
    }


def _logits(backbone):
    hidden = backbone(_inputs())
    embedding = backbone.token_embedding
    return keras.ops.convert_to_numpy(embedding(hidden, reverse=True))


def _save_presets(directory):
    """One process: the tiny Llama saved as a preset, whole and in Keras'
    sharded weights files, and as a `.keras` file; its weights and
    logits."""
    keras.distribution.set_distribution(None)
    backbone = _backbone()
    whole = os.path.join(directory, "whole")
    sharded = os.path.join(directory, "sharded")
    archive = os.path.join(directory, "llama.keras")
    backbone.save_to_preset(whole)
    # About 4.2 MB a file: the embeddings (4 MiB) each in a file of
    # their own, the layers' variables spread over files with them.
    backbone.save_to_preset(sharded, max_shard_size=0.0042)
    backbone.save(archive)
    weights = {v.path: np.asarray(v) for v in backbone.weights}
    return (whole, sharded, archive), weights, _logits(backbone)


def _set_distribution(kind, reverse_key=True):
    devices = keras.distribution.list_devices()
    shape = (1, len(devices)) if kind == "model" else (len(devices), 1)
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    if reverse_key:  # the key keras_hub's map misses (the package warns)
        layout_map["token_embedding/reverse_embeddings"] = ("batch", "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )


def _load_on_rank(kind, source):
    """On each rank: build the backbone from the preset's config under the
    distribution, then load its weights (or `keras.saving.load_model` a
    `.keras` file), counting the bytes read and the peak of host
    allocations during the load; then load the preset with `from_preset`."""
    import tracemalloc

    from keras_torch_distribution._distributed import stored_values
    from keras_torch_distribution._variables import born_sharded

    keras.backend.clear_session()
    _set_distribution(kind)
    archive = source.endswith(".keras")
    if not archive:
        backbone = keras_hub.models.Backbone.from_preset(
            source, load_weights=False
        )
    stored_values.reads.clear()
    tracemalloc.start()
    try:
        if archive:
            backbone = keras.saving.load_model(source)
        else:
            # What from_preset loads: the preset's weights file(s).
            weights_file = "model.weights.h5"
            if not os.path.exists(os.path.join(source, weights_file)):
                weights_file = "model.weights.json"
            backbone.load_weights(os.path.join(source, weights_file))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    read = stored_values.reads.bytes
    kept = sum(born_sharded.local_bytes(v) for v in backbone.weights)
    blocks = [
        born_sharded.local_bytes(v)
        for v in backbone.weights
        if hasattr(v.value, "placements")
    ]
    whole_replicated = [
        born_sharded.local_bytes(v)
        for v in backbone.weights
        if not hasattr(v.value, "placements")
    ]
    loaded = backbone
    if not archive:  # the whole from_preset call loads the same values
        keras.backend.clear_session()
        _set_distribution(kind)
        loaded = keras_hub.models.Backbone.from_preset(source)
    return {
        "read": read,
        "kept": kept,
        "largest_block": max(blocks),
        "largest_replicated": max(whole_replicated),
        "peak": peak,
        "sharded": len(blocks),
        "weights": {v.path: np.asarray(v) for v in backbone.weights},
        "loaded": {v.path: np.asarray(v) for v in loaded.weights},
        "logits": _logits(loaded),
    }


@pytest.mark.parametrize("kind", ["model", "fsdp"])
def test_preset_loads_shard_by_shard(pool2, tmp_path, kind):
    sources, weights, logits = _save_presets(str(tmp_path))
    largest_whole = max(w.nbytes for w in weights.values())
    for source in sources:
        archive = source.endswith(".keras")
        results = pool2.run(_load_on_rank, kind, source)
        for rank, got in enumerate(results):
            where = f"{kind} {os.path.basename(source)} rank {rank}"
            _assert_loaded_exactly(got, weights, logits, where)
            assert got["read"] < sum(w.nbytes for w in weights.values())
            # No whole copy of a sharded variable on the way to its block
            # (load_model also builds the model: its Python objects).
            slack = 4 * SLACK if archive else SLACK
            bound = max(got["largest_block"], got["largest_replicated"]) + slack
            limit = os.path.getsize(source) if archive else largest_whole
            assert bound < limit, (where, bound, limit)
            assert got["peak"] <= bound, (where, got["peak"], bound)


def _load_without_reverse_key(preset):
    """from_preset under keras_hub's own map: the package logs what it
    leaves whole (rank 0 speaks)."""
    import logging

    messages = []

    class Records(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    keras.backend.clear_session()
    _set_distribution("model", reverse_key=False)
    records = Records()
    logger = logging.getLogger("keras_torch_distribution")
    logger.addHandler(records)
    try:
        backbone = keras_hub.models.Backbone.from_preset(preset)
    finally:
        logger.removeHandler(records)
    return {
        "messages": [m for m in messages if "whole on every rank" in m],
        "weights": {v.path: np.asarray(v) for v in backbone.weights},
    }


def test_preset_under_keras_hub_map_warns_about_reverse_embeddings(
    pool2, tmp_path
):
    keras.distribution.set_distribution(None)
    backbone = _backbone()
    preset = str(tmp_path / "preset")
    backbone.save_to_preset(preset)
    rank0, rank1 = pool2.run(_load_without_reverse_key, preset)
    assert len(rank0["messages"]) == 1, rank0["messages"]
    assert (
        "Variable 'token_embedding/reverse_embeddings' (shape (64, 16384)) "
        "is whole on every rank" in rank0["messages"][0]
    )
    assert (
        "add layout_map['token_embedding/reverse_embeddings'] = "
        "(None, 'model')" in rank0["messages"][0]
    ), rank0["messages"][0]
    assert rank1["messages"] == []
    for got in (rank0, rank1):
        for v in backbone.weights:
            np.testing.assert_array_equal(got["weights"][v.path], np.asarray(v))


def _load_as_float32(preset):
    """A bfloat16 preset loaded into a float32 backbone under the layout
    map: blocks read in bfloat16 and cast on the way."""
    from keras_torch_distribution._distributed import stored_values
    from keras_torch_distribution._variables import born_sharded

    keras.backend.clear_session()
    _set_distribution("model")
    backbone = keras_hub.models.Backbone.from_preset(
        preset, load_weights=False, dtype="float32"
    )
    stored_values.reads.clear()
    backbone.load_weights(os.path.join(preset, "model.weights.h5"))
    return {
        "read": stored_values.reads.bytes,
        "kept": sum(born_sharded.local_bytes(v) for v in backbone.weights),
        "dtypes": {str(v.dtype) for v in backbone.weights},
        "weights": {v.path: np.asarray(v) for v in backbone.weights},
    }


def test_bfloat16_preset_loads_into_float32_block_by_block(pool2, tmp_path):
    keras.distribution.set_distribution(None)
    backbone = _backbone(dtype="bfloat16")
    preset = str(tmp_path / "preset")
    backbone.save_to_preset(preset)
    expected = {
        v.path: keras.ops.convert_to_numpy(keras.ops.cast(v, "float32"))
        for v in backbone.weights
    }
    for rank, got in enumerate(pool2.run(_load_as_float32, preset)):
        assert got["dtypes"] == {"float32"}, got["dtypes"]
        for path, value in expected.items():
            np.testing.assert_array_equal(
                got["weights"][path], value, err_msg=f"rank {rank} {path}"
            )
        # bfloat16 read: half the bytes the float32 blocks keep.
        assert got["read"] * 2 == got["kept"], (got["read"], got["kept"])


# -- a Hugging Face checkpoint that keras_hub converts --------------------

HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 4, 2, 2 * HIDDEN, 2


def _hf_tensors():
    """A tiny Llama in transformers' names and layouts: projections
    (out, in), untied lm_head."""
    rng = np.random.default_rng(5)
    head = HIDDEN // HEADS

    def normal(*shape):
        return (0.1 * rng.standard_normal(shape)).astype("float32")

    tensors = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN),
        "lm_head.weight": normal(VOCAB, HIDDEN),
        "model.norm.weight": 1 + normal(HIDDEN),
    }
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        tensors.update(
            {
                layer + "input_layernorm.weight": 1 + normal(HIDDEN),
                layer + "post_attention_layernorm.weight": 1 + normal(HIDDEN),
                layer + "self_attn.q_proj.weight": normal(HEADS * head, HIDDEN),
                layer + "self_attn.k_proj.weight": normal(
                    KV_HEADS * head, HIDDEN
                ),
                layer + "self_attn.v_proj.weight": normal(
                    KV_HEADS * head, HIDDEN
                ),
                layer + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * head),
                layer + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
                layer + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
                layer + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
            }
        )
    return tensors


def _save_hf_checkpoints(directory):
    """The tiny Llama as transformers saves it: config.json and
    model.safetensors; and sharded, model.safetensors.index.json naming
    two files. Returns both directories."""
    import json

    from safetensors.numpy import save_file

    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    tensors = _hf_tensors()
    whole = os.path.join(directory, "hf")
    sharded = os.path.join(directory, "hf-sharded")
    for path in (whole, sharded):
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    save_file(tensors, os.path.join(whole, "model.safetensors"))
    files = {"model-00001-of-00002.safetensors": {}}
    files["model-00002-of-00002.safetensors"] = {}
    for key, value in tensors.items():
        first = key.startswith(("model.embed_tokens", "model.layers.0."))
        files[sorted(files)[0 if first else 1]][key] = value
    weight_map = {}
    for name, part in files.items():
        save_file(part, os.path.join(sharded, name))
        weight_map.update({key: name for key in part})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return whole, sharded


def _mapped_bytes(directory):
    """Bytes of the safetensors files in `directory` that this process has
    in memory through a memory map (the Rss of their mappings in
    /proc/self/smaps: pages it touched, and the pages around them the
    kernel maps on a fault); None where there is no /proc."""
    if not os.path.exists("/proc/self/smaps"):
        return None
    paths = {
        os.path.realpath(os.path.join(directory, name))
        for name in os.listdir(directory)
        if name.endswith(".safetensors")
    }
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                counting = len(fields) >= 6 and fields[5] in paths
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _load_hf_on_rank(kind, sources):
    """On each rank, for each checkpoint: build the backbone from its
    config under the distribution, convert the weights into it as
    `from_preset` does (keras_hub's loader and Llama converter), counting
    the bytes read and the peak of host allocations; then `from_preset`
    the checkpoint whole."""
    import tracemalloc

    from keras_hub.src.utils.preset_utils import get_preset_loader
    from keras_hub.src.utils.transformers import safetensor_utils

    from keras_torch_distribution._distributed import stored_values
    from keras_torch_distribution._variables import born_sharded

    found = {}
    for source in sources:
        keras.backend.clear_session()
        _set_distribution(kind)
        backbone = keras_hub.models.LlamaBackbone.from_preset(
            source, load_weights=False
        )
        loader = get_preset_loader(source)
        stored_values.reads.clear()
        tracemalloc.start()
        try:
            with safetensor_utils.SafetensorLoader(source) as files:
                loader.converter.convert_weights(backbone, files, loader.config)
                mapped = _mapped_bytes(source)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        read = stored_values.reads.bytes
        keras.backend.clear_session()
        _set_distribution(kind)
        loaded = keras_hub.models.LlamaBackbone.from_preset(source)
        found[os.path.basename(source)] = {
            "read": read,
            "kept": sum(born_sharded.local_bytes(v) for v in backbone.weights),
            "largest_block": max(
                born_sharded.local_bytes(v)
                for v in backbone.weights
                if born_sharded.is_sharded(v)
            ),
            "largest_replicated": max(
                born_sharded.local_bytes(v)
                for v in backbone.weights
                if not born_sharded.is_sharded(v)
            ),
            "peak": peak,
            "mapped": mapped,
            "replicated": [
                born_sharded.local_bytes(v)
                for v in backbone.weights
                if not born_sharded.is_sharded(v)
            ],
            "files": len(
                [n for n in os.listdir(source) if n.endswith(".safetensors")]
            ),
            "file_bytes": sum(
                os.path.getsize(os.path.join(source, n))
                for n in os.listdir(source)
                if n.endswith(".safetensors")
            ),
            "sharded": sum(
                born_sharded.is_sharded(v) for v in backbone.weights
            ),
            "weights": {v.path: np.asarray(v) for v in backbone.weights},
            "loaded": {v.path: np.asarray(v) for v in loaded.weights},
            "logits": _logits(loaded),
        }
    return found


@pytest.mark.parametrize("kind", ["model", "fsdp"])
def test_hugging_face_checkpoint_loads_shard_by_shard(pool2, tmp_path, kind):
    pytest.importorskip("safetensors")
    sources = _save_hf_checkpoints(str(tmp_path))
    keras.distribution.set_distribution(None)
    one = keras_hub.models.LlamaBackbone.from_preset(sources[0])
    weights = {v.path: np.asarray(v) for v in one.weights}
    logits = _logits(one)
    largest_whole = max(w.nbytes for w in weights.values())
    results = pool2.run(_load_hf_on_rank, kind, sources)
    for rank, by_source in enumerate(results):
        for source, got in by_source.items():
            where = f"{kind} {source} rank {rank}"
            _assert_loaded_exactly(got, weights, logits, where)
            # No whole copy of a tensor on the way to its block.
            bound = max(got["largest_block"], got["largest_replicated"]) + SLACK
            assert bound < largest_whole, (where, bound, largest_whole)
            assert got["peak"] <= bound, (where, got["peak"], bound)
            # The file's pages: the blocks are read with positioned reads,
            # so the file's mapping (safetensors' own, which keras_hub opens)
            # holds only the pages of the tensors keras_hub reads whole
            # (variables not sharded), each with the kernel's fault-around
            # window on either side, and the header's; not every page a
            # block's rows cross (half the file and more through it).
            if got["mapped"] is not None:
                mapped_bound = sum(got["replicated"]) + FAULT_AROUND * (
                    2 * len(got["replicated"]) + got["files"]
                )
                assert mapped_bound < got["file_bytes"] / 4, where
                assert got["mapped"] <= mapped_bound, (
                    where,
                    got["mapped"],
                    mapped_bound,
                    got["file_bytes"],
                )


def _assert_loaded_exactly(got, weights, logits, where):
    """A rank's load (`_load_on_rank`, `_load_hf_on_rank`): its sharded
    variables, every value equal to one process's (after building and
    after `load_weights`), its logits one process's, and only what it
    keeps read from the file (plus one block)."""
    assert got["sharded"] >= 8, where
    for name in ("weights", "loaded"):
        assert got[name].keys() == weights.keys(), where
        for path, value in weights.items():
            np.testing.assert_array_equal(
                got[name][path], value, err_msg=f"{where} {path}"
            )
    np.testing.assert_allclose(
        got["logits"], logits, rtol=1e-5, atol=1e-5, err_msg=where
    )
    # Read: what the rank keeps, nothing of the others' blocks.
    assert got["read"] <= got["kept"] + got["largest_block"], (
        where,
        got["read"],
        got["kept"],
    )
