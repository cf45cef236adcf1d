"""keras_hub backbones under their own `get_layout_map`, whose weights are
sharded on both the data and the model axis ("based on the Gemma team
training config"): FSDP on the batch axis, composed with tensor parallelism
on the model axis, against one process on the global batch (issue 11).

Tiny configs, no weights downloaded; keras_hub is installed by .ci/run.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras_hub = pytest.importorskip("keras_hub")

VOCAB, SEQ, ROWS, GLOBAL_BATCH = 64, 8, 16, 8
TOL = dict(rtol=5e-5, atol=5e-5)
FAMILIES = {
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(head_dim=8)),
    "llama": ("LlamaBackbone", "LlamaCausalLM", {}),
    "qwen": ("QwenBackbone", "QwenCausalLM", {}),
}


def _causal_lm(family):
    backbone_name, task_name, extra = FAMILIES[family]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        **extra,
    )
    model = getattr(keras_hub.models, task_name)(
        backbone=backbone, preprocessor=None
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def _data():
    ids = np.random.default_rng(0).integers(1, VOCAB, (ROWS, SEQ + 1))
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((ROWS, SEQ), bool)}
    return x, ids[:, 1:]


def _train(family, mesh_shape=None):
    if mesh_shape is not None:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            mesh_shape, ["batch", "model"], devices
        )
        backbone_class = getattr(keras_hub.models, FAMILIES[family][0])
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=backbone_class.get_layout_map(mesh),
                batch_dim_name="batch",
            )
        )
    model = _causal_lm(family)
    x, y = _data()
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
    )
    evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    logits = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    batch_sharded = {}
    for v in model.weights:
        value = v._value
        if hasattr(value, "placements") and any(
            getattr(p, "dim", None) is not None for p in value.placements[:1]
        ):
            batch_sharded[v.path] = (
                tuple(v.shape),
                tuple(value.to_local().shape),
            )
    return dict(
        loss=history.history["loss"],
        evaluation=evaluation,
        logits=np.asarray(logits, "float32"),
        weights={v.path: np.asarray(v, "float32") for v in model.weights},
        batch_sharded=batch_sharded,
    )


_references = {}


def _reference(family):
    if family not in _references:
        keras.backend.clear_session()
        _references[family] = _train(family)
    return _references[family]


def _check(results, reference):
    for result in results:
        np.testing.assert_allclose(result["loss"], reference["loss"], **TOL)
        np.testing.assert_allclose(
            result["evaluation"], reference["evaluation"], **TOL
        )
        np.testing.assert_allclose(result["logits"], reference["logits"], **TOL)
        for path, value in reference["weights"].items():
            np.testing.assert_allclose(
                result["weights"][path], value, err_msg=path, **TOL
            )
        # The map shards weights on the batch axis: FSDP, stored in part.
        assert result["batch_sharded"], "no weight is sharded on the batch axis"
        for path, (whole, local) in result["batch_sharded"].items():
            assert np.prod(local) < np.prod(whole), path


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_own_layout_map_fsdp_on_2_processes(pool2, family):
    """A (2, 1) mesh: 2 data replicas, the map's batch-axis dims FSDP."""
    _check(pool2.run(_train, family, (2, 1)), _reference(family))


@pytest.mark.slow
def test_gemma_map_fsdp_and_tensor_parallel_on_2x2(pool4):
    """A (2, 2) mesh: weights sharded on both axes, as Gemma's map says."""
    _check(pool4.run(_train, "gemma", (2, 2)), _reference("gemma"))
