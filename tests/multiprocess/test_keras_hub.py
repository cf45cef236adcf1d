"""keras_hub causal LMs under the Keras distribution API, against one process.

Tiny models built from configs (tests/multiprocess/keras_hub_models.py): the decoder LLMs
that ship a `get_layout_map` run ModelParallel under their own map on a
(1, 2) ("batch", "model") mesh; the others run DataParallel. fit, evaluate,
predict and greedy generate must give one process's numbers (tokens
exactly), and LoRA weights saved on 2 processes must load back.

keras-hub is installed without its declared dependencies (they pull in
TensorFlow): `.ci/run` installs it; without it these tests are skipped.
"""

import numpy as np
import pytest

pytest.importorskip(
    "keras_hub",
    reason="keras_hub is not installed; .ci/run installs it with: pip install "
    "--no-deps keras-hub==0.32.0 (the test extra holds what it needs)",
)

import keras_hub_models  # noqa: E402  (its directory is on sys.path under pytest)

# Families whose backbone ships get_layout_map (keras_hub 0.32). Gemma's
# config puts 1 key/value head on a model axis of 2.
MODEL_PARALLEL = ["gemma", "gemma2", "llama", "llama3", "qwen", "qwen_moe", "qwen3_moe"]
DATA_PARALLEL = ["mistral", "phi3", "gpt2", "gemma3"]
# Float noise: Adam turns reduction-order differences of ~1e-7 into ~2e-5.
RTOL = ATOL = 1e-4


def _reference(family, directory=None, steps=None):
    import keras

    keras.backend.clear_session()
    try:
        return keras_hub_models.run(family, None, directory, **_steps(steps))
    finally:
        keras.backend.clear_session()


def _steps(steps):
    return {} if steps is None else {"steps": steps}


def run_recording_warnings(family, kind, directory=None, steps=None):
    """keras_hub_models.run on a rank, with the torch warnings it raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = keras_hub_models.run(family, kind, directory, **_steps(steps))
    out["warnings"] = sorted({str(w.message) for w in caught})
    return out


def _check(results, reference, family):
    for rank, got in enumerate(results):
        where = f"{family} rank {rank}"
        for key in ("fit", "evaluate", "predict"):
            if key in reference:
                np.testing.assert_allclose(
                    got[key], reference[key], rtol=RTOL, atol=ATOL, err_msg=f"{where} {key}"
                )
        for path, value in reference.get("weights", {}).items():
            np.testing.assert_allclose(
                got["weights"][path], value, rtol=RTOL, atol=ATOL, err_msg=f"{where} {path}"
            )
        if "generate" in reference:
            np.testing.assert_array_equal(
                got["generate"], reference["generate"], err_msg=f"{where} generate"
            )
        # DTensor's warning for a (1,)-shaped plain tensor meeting a DTensor.
        # keras_hub's MoE load-balancing loss divides its expert-sharded
        # router probabilities (its layout map's "feedforward_gate_dense"
        # also matches the router) by a (1,)-shaped token count: that one
        # is keras_hub's, the package makes no such tensors.
        if family not in ("qwen_moe", "qwen3_moe"):
            assert not [w for w in got["warnings"] if "numel=1" in w], (where, got["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("family", MODEL_PARALLEL)
def test_model_parallel_under_own_layout_map_matches_one_process(pool2, family):
    reference = _reference(family)
    results = pool2.run(run_recording_warnings, family, "model", timeout=600)
    _check(results, reference, family)


@pytest.mark.parametrize("family", DATA_PARALLEL)
def test_data_parallel_matches_one_process(pool2, family):
    # Gemma 3's generate() fails on one process too with preprocessor=None
    # (keras_hub 0.32 concatenates its None image outputs).
    steps = ("fit", "evaluate", "predict") if family == "gemma3" else None
    reference = _reference(family, steps=steps)
    results = pool2.run(run_recording_warnings, family, "data", steps=steps, timeout=600)
    _check(results, reference, family)


@pytest.mark.slow
@pytest.mark.parametrize("family, kind", [("llama", "model"), ("gpt2", "data")])
def test_lora_weights_saved_on_two_processes_load_back(pool2, tmp_path, family, kind):
    """save_lora_weights writes through Keras' H5 store on every rank: rank 0
    writes the file, and every rank can load it as soon as it returns."""
    (tmp_path / "one").mkdir()
    reference = _reference(family, str(tmp_path / "one"), steps=())
    shared = tmp_path / "two"
    shared.mkdir()
    results = pool2.run(run_recording_warnings, family, kind, str(shared), steps=(), timeout=600)
    assert sorted(p.name for p in shared.iterdir()) == [f"{family}.lora.h5"]
    want_tuned, want_reloaded = reference["lora"]
    np.testing.assert_allclose(want_reloaded, want_tuned, rtol=1e-6, atol=1e-6)
    for rank, got in enumerate(results):
        tuned, reloaded = got["lora"]
        np.testing.assert_allclose(tuned, want_tuned, rtol=RTOL, atol=ATOL, err_msg=f"rank {rank}")
        np.testing.assert_allclose(reloaded, tuned, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank}")
    # The file rank 0 wrote loads in one process.
    import keras

    keras.backend.clear_session()
    model = keras_hub_models.build(family)
    model.backbone.enable_lora(rank=2)
    model.backbone.load_lora_weights(str(shared / f"{family}.lora.h5"))
    x, _, _ = keras_hub_models.data()
    np.testing.assert_allclose(
        np.asarray(model.predict(x, batch_size=keras_hub_models.ROWS, verbose=0)),
        want_tuned, rtol=RTOL, atol=ATOL,
    )
