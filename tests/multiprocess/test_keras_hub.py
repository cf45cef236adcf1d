"""keras_hub causal LMs under the Keras distribution API, against one process.

Tiny models built from configs (below): the decoder LLMs that ship a
`get_layout_map` run ModelParallel under their own map on a (1, 2)
("batch", "model") mesh; the others run DataParallel. fit, evaluate,
predict and greedy generate must give one process's numbers (tokens
exactly), and LoRA weights saved on 2 processes must load back.

keras-hub is installed without its declared dependencies (they pull in
TensorFlow): `.ci/run` installs it; without it these tests are skipped.
"""

import os

import numpy as np
import pytest

pytest.importorskip(
    "keras_hub",
    reason="keras_hub is not installed; .ci/run installs it with: pip install "
    "--no-deps keras-hub==0.32.0 (the test extra holds what it needs)",
)

# Families whose backbone ships get_layout_map (keras_hub 0.32). Gemma's
# config puts 1 key/value head on a model axis of 2.
MODEL_PARALLEL = [
    "gemma",
    "gemma2",
    "llama",
    "llama3",
    "qwen",
    "qwen_moe",
    "qwen3_moe",
]
DATA_PARALLEL = ["mistral", "phi3", "gpt2", "gemma3"]
# Float noise: Adam turns reduction-order differences of ~1e-7 into ~2e-5.
RTOL = ATOL = 1e-4


# ---------------------------------------------------------------------------
# Tiny keras_hub causal LMs, built from configs (no weights, no tokenizer:
# `preprocessor=None`), token data, and one function that runs fit /
# evaluate / predict / greedy generate and LoRA save/reload on one process
# or on each rank of a distribution.
# ---------------------------------------------------------------------------

VOCAB = 32
SEQ = 8  # tokens per row; the model sees SEQ - 1 of them
ROWS = 4
PROMPT = 4  # prompt tokens of each generated row

_ATTENTION = dict(
    num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32
)

# family: (backbone, task, config). Dropout is 0: one process and N
# processes draw different dropout masks.
FAMILIES = {
    "gemma": (
        "GemmaBackbone",
        "GemmaCausalLM",
        # One key/value head over a model axis of 2: keras_hub's own test
        # config, replicated by the package (see layouts.for_variable).
        dict(_ATTENTION, num_key_value_heads=1, head_dim=4),
    ),
    # Gemma 2: GemmaBackbone with soft caps, extra norms, sliding windows.
    "gemma2": (
        "GemmaBackbone",
        "GemmaCausalLM",
        dict(
            _ATTENTION,
            head_dim=4,
            query_head_dim_normalize=False,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0,
            use_sliding_window_attention=True,
            sliding_window_size=4,
        ),
    ),
    "gemma3": (
        "Gemma3Backbone",
        "Gemma3CausalLM",
        dict(_ATTENTION, head_dim=4, image_size=16, vision_encoder=None),
    ),
    "llama": ("LlamaBackbone", "LlamaCausalLM", _ATTENTION),
    "llama3": ("Llama3Backbone", "Llama3CausalLM", _ATTENTION),
    "qwen": ("QwenBackbone", "QwenCausalLM", _ATTENTION),
    "qwen_moe": (
        "QwenMoeBackbone",
        "QwenMoeCausalLM",
        dict(
            _ATTENTION,
            moe_intermediate_dim=8,
            shared_expert_intermediate_dim=16,
            num_experts=4,
            top_k=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeBackbone",
        "Qwen3MoeCausalLM",
        dict(
            _ATTENTION,
            head_dim=4,
            moe_intermediate_dim=8,
            num_experts=4,
            top_k=2,
        ),
    ),
    "mistral": ("MistralBackbone", "MistralCausalLM", _ATTENTION),
    "phi3": ("Phi3Backbone", "Phi3CausalLM", _ATTENTION),
    "gpt2": (
        "GPT2Backbone",
        "GPT2CausalLM",
        dict(
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=16,
            dropout=0.0,
        ),
    ),
}


def backbone_class(family):
    import keras_hub

    return getattr(keras_hub.models, FAMILIES[family][0])


def build(family, seed=1):
    """The family's tiny causal LM, initialised from `seed`."""
    import keras
    import keras_hub

    backbone_name, task_name, config = FAMILIES[family]
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, backbone_name)(
        vocabulary_size=VOCAB, num_layers=2, **config
    )
    return getattr(keras_hub.models, task_name)(
        backbone=backbone, preprocessor=None
    )


def data(rows=ROWS):
    """(x, y, sample_weight) for next-token training, and a prompt batch
    for generate (PROMPT tokens, then padding to SEQ - 1)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(rows, SEQ)).astype("int32")
    mask = np.ones((rows, SEQ - 1), dtype=bool)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
    y = tokens[:, 1:]
    prompt_mask = np.zeros((rows, SEQ - 1), dtype=bool)
    prompt_mask[:, :PROMPT] = True
    prompt = {
        "token_ids": np.where(prompt_mask, tokens[:, :-1], 0).astype("int32"),
        "padding_mask": prompt_mask,
    }
    return x, y, prompt


def set_distribution(family, kind):
    """kind: None (one process), "data" (DataParallel over every process) or
    "model" (ModelParallel with the backbone's own get_layout_map on a
    (1, N) ("batch", "model") mesh)."""
    import keras

    if kind is None:
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    if kind == "data":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh = keras.distribution.DeviceMesh(
            (1, len(devices)), ["batch", "model"], devices
        )
        layout_map = backbone_class(family).get_layout_map(mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    keras.distribution.set_distribution(distribution)


def run(
    family,
    kind,
    directory=None,
    steps=("fit", "evaluate", "predict", "generate"),
):
    """Everything a test compares, as numpy: losses, metrics, predictions,
    generated tokens, weights after training; and, with `directory`, the
    LoRA round trip (save_lora_weights, then load_lora_weights into a fresh
    model). Runs on one process (kind=None) or on every rank."""
    import keras

    set_distribution(family, kind)
    x, y, prompt = data()
    out = {}
    model = build(family)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
        sampler="greedy",
    )
    if "fit" in steps:
        history = model.fit(
            x, y, batch_size=ROWS, epochs=2, shuffle=False, verbose=0
        )
        out["fit"] = history.history["loss"]
        out["weights"] = {
            v.path: np.asarray(v) for v in model.trainable_weights
        }
    if "evaluate" in steps:
        out["evaluate"] = model.evaluate(x, y, batch_size=ROWS, verbose=0)
    if "predict" in steps:
        out["predict"] = np.asarray(
            model.predict(x, batch_size=ROWS, verbose=0)
        )
    if "generate" in steps:
        generated = model.generate(prompt, stop_token_ids=None)
        out["generate"] = np.asarray(generated["token_ids"])
    if directory is not None:
        out["lora"] = lora_round_trip(family, x, y, directory)
    return out


def lora_round_trip(family, x, y, directory):
    """Fine-tune a new model with LoRA, save the LoRA weights, load them
    into another new model (the same base weights): (the tuned model's
    predictions, the reloaded model's predictions)."""
    import keras

    model = build(family)
    model.backbone.enable_lora(rank=2)
    # Train only what save_lora_weights saves (enable_lora leaves the
    # biases of the LoRA layers trainable, e.g. GPT-2's query/value).
    for variable in model.trainable_variables:
        if "lora" not in variable.path:
            variable.trainable = False
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(directory, f"{family}.lora.h5")
    model.backbone.save_lora_weights(path)
    tuned = np.asarray(model.predict(x, batch_size=ROWS, verbose=0))
    fresh = build(family)
    fresh.backbone.enable_lora(rank=2)
    fresh.backbone.load_lora_weights(path)
    reloaded = np.asarray(fresh.predict(x, batch_size=ROWS, verbose=0))
    return tuned, reloaded


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def _reference(family, directory=None, steps=None):
    import keras

    keras.backend.clear_session()
    try:
        return run(family, None, directory, **_steps(steps))
    finally:
        keras.backend.clear_session()


def _steps(steps):
    return {} if steps is None else {"steps": steps}


def run_recording_warnings(family, kind, directory=None, steps=None):
    """`run` on a rank, with the torch warnings it raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(family, kind, directory, **_steps(steps))
    out["warnings"] = sorted({str(w.message) for w in caught})
    return out


def _check(results, reference, family):
    for rank, got in enumerate(results):
        where = f"{family} rank {rank}"
        for key in ("fit", "evaluate", "predict"):
            if key in reference:
                np.testing.assert_allclose(
                    got[key],
                    reference[key],
                    rtol=RTOL,
                    atol=ATOL,
                    err_msg=f"{where} {key}",
                )
        for path, value in reference.get("weights", {}).items():
            np.testing.assert_allclose(
                got["weights"][path],
                value,
                rtol=RTOL,
                atol=ATOL,
                err_msg=f"{where} {path}",
            )
        if "generate" in reference:
            np.testing.assert_array_equal(
                got["generate"],
                reference["generate"],
                err_msg=f"{where} generate",
            )
        # DTensor's warning for a (1,)-shaped plain tensor meeting a DTensor.
        # keras_hub's MoE load-balancing loss divides its expert-sharded
        # router probabilities (its layout map's "feedforward_gate_dense"
        # also matches the router) by a (1,)-shaped token count: that one
        # is keras_hub's, the package makes no such tensors.
        if family not in ("qwen_moe", "qwen3_moe"):
            assert not [w for w in got["warnings"] if "numel=1" in w], (
                where,
                got["warnings"],
            )


@pytest.mark.slow
@pytest.mark.parametrize("family", MODEL_PARALLEL)
def test_model_parallel_under_own_layout_map_matches_one_process(pool2, family):
    reference = _reference(family)
    results = pool2.run(run_recording_warnings, family, "model")
    _check(results, reference, family)


@pytest.mark.parametrize("family", DATA_PARALLEL)
def test_data_parallel_matches_one_process(pool2, family):
    # Gemma 3's generate() fails on one process too with preprocessor=None
    # (keras_hub 0.32 concatenates its None image outputs).
    steps = ("fit", "evaluate", "predict") if family == "gemma3" else None
    reference = _reference(family, steps=steps)
    results = pool2.run(
        run_recording_warnings, family, "data", steps=steps, timeout=600
    )
    _check(results, reference, family)


@pytest.mark.slow
@pytest.mark.parametrize("family, kind", [("llama", "model"), ("gpt2", "data")])
def test_lora_weights_saved_on_two_processes_load_back(
    pool2, tmp_path, family, kind
):
    """save_lora_weights writes through Keras' H5 store on every rank: rank 0
    writes the file, and every rank can load it as soon as it returns."""
    (tmp_path / "one").mkdir()
    reference = _reference(family, str(tmp_path / "one"), steps=())
    shared = tmp_path / "two"
    shared.mkdir()
    results = pool2.run(
        run_recording_warnings, family, kind, str(shared), steps=(), timeout=600
    )
    assert sorted(p.name for p in shared.iterdir()) == [f"{family}.lora.h5"]
    want_tuned, want_reloaded = reference["lora"]
    np.testing.assert_allclose(want_reloaded, want_tuned, rtol=1e-6, atol=1e-6)
    for rank, got in enumerate(results):
        tuned, reloaded = got["lora"]
        np.testing.assert_allclose(
            tuned, want_tuned, rtol=RTOL, atol=ATOL, err_msg=f"rank {rank}"
        )
        np.testing.assert_allclose(
            reloaded, tuned, rtol=1e-6, atol=1e-6, err_msg=f"rank {rank}"
        )
    # The file rank 0 wrote loads in one process.
    import keras

    keras.backend.clear_session()
    model = build(family)
    model.backbone.enable_lora(rank=2)
    model.backbone.load_lora_weights(str(shared / f"{family}.lora.h5"))
    x, _, _ = data()
    np.testing.assert_allclose(
        np.asarray(model.predict(x, batch_size=ROWS, verbose=0)),
        want_tuned,
        rtol=RTOL,
        atol=ATOL,
    )


# ---------------------------------------------------------------------------
# Preemption: a tiny Llama under its own layout map, SIGTERM on rank 1 in
# the middle of an epoch, resumed by BackupAndRestore at that batch.
# ---------------------------------------------------------------------------

PREEMPT_ROWS = 16  # 4 batches of ROWS per epoch


def _preempted_llama(directory, signal_at):
    """fit 2 epochs (shuffled) with BackupAndRestore(directory); with
    `signal_at` (a global step), rank 1 SIGTERMs itself after it and the
    fit is run again. (exit codes, batches trained, weights)."""
    import signal

    import keras

    from keras_torch_distribution import Preempted
    from keras_torch_distribution._processes import runtime

    set_distribution("llama", "model")
    x, y, _ = data(PREEMPT_ROWS)
    seen, codes = [], []

    class Signal(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)
            if len(seen) == signal_at and runtime.process_id() == 1:
                signal.raise_signal(signal.SIGTERM)

    for attempt in range(2 if signal_at else 1):
        model = build("llama")
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        try:
            model.fit(
                x,
                y,
                batch_size=ROWS,
                epochs=2,
                verbose=0,
                callbacks=[
                    keras.callbacks.BackupAndRestore(directory),
                    Signal(),
                ],
            )
            codes.append(0)
        except Preempted as preempted:
            codes.append(preempted.code)
    weights = {v.path: np.asarray(v) for v in model.trainable_weights}
    return codes, seen, weights


@pytest.mark.slow
def test_preempted_llama_resumes_with_uninterrupted_weights(pool2, tmp_path):
    (_, seen, reference), _ = pool2.run(
        _preempted_llama, str(tmp_path / "reference"), None, timeout=600
    )
    assert seen == [0, 1, 2, 3] * 2
    results = pool2.run(
        _preempted_llama, str(tmp_path / "backup"), 6, timeout=600
    )
    for codes, seen, weights in results:
        assert codes == [143, 0]
        # 6 batches, then the rest: epoch 1 from its batch 2 on.
        assert seen == [0, 1, 2, 3, 0, 1] + [2, 3]
        assert sorted(weights) == sorted(reference)
        for path in reference:
            np.testing.assert_array_equal(weights[path], reference[path], path)
