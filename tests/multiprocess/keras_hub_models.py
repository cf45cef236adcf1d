"""Tiny keras_hub causal LMs for tests and examples: built from configs (no
weights, no tokenizer: `preprocessor=None`), token data, and one function
that runs fit / evaluate / predict / greedy generate and LoRA save/reload
on one process or on each rank of a distribution."""

import os

import numpy as np

VOCAB = 32
SEQ = 8  # tokens per row; the model sees SEQ - 1 of them
ROWS = 4
PROMPT = 4  # prompt tokens of each generated row

_ATTENTION = dict(num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)

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
        dict(_ATTENTION, head_dim=4, moe_intermediate_dim=8, num_experts=4, top_k=2),
    ),
    "mistral": ("MistralBackbone", "MistralCausalLM", _ATTENTION),
    "phi3": ("Phi3Backbone", "Phi3CausalLM", _ATTENTION),
    "gpt2": (
        "GPT2Backbone",
        "GPT2CausalLM",
        dict(num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=16, dropout=0.0),
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
    return getattr(keras_hub.models, task_name)(backbone=backbone, preprocessor=None)


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
        mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
        layout_map = backbone_class(family).get_layout_map(mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    keras.distribution.set_distribution(distribution)


def run(family, kind, directory=None, steps=("fit", "evaluate", "predict", "generate")):
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
        history = model.fit(x, y, batch_size=ROWS, epochs=2, shuffle=False, verbose=0)
        out["fit"] = history.history["loss"]
        out["weights"] = {v.path: np.asarray(v) for v in model.trainable_weights}
    if "evaluate" in steps:
        out["evaluate"] = model.evaluate(x, y, batch_size=ROWS, verbose=0)
    if "predict" in steps:
        out["predict"] = np.asarray(model.predict(x, batch_size=ROWS, verbose=0))
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
