"""A keras_hub causal LM built from its published config (no weights),
under its own layout map, compiled with Adam and fit on a few tokens: the
script `docs/plan.md` plans with `ktd plan --world N`.

    ktd plan --world 64 examples/plan_keras_hub.py llama3_8b fsdp

MODEL: llama3_8b | gemma2_9b | qwen1.5_moe_a2.7b
LAYOUT: fsdp (mesh (N, 1): every weight sharded on the batch axis),
        tp (mesh (1, N): tensor parallel), 2d (mesh (N/8, 8)).
On real devices (`ktd run -n N`) it would train one step on random tokens.
"""

import sys

import keras
import keras_hub
import numpy as np

import keras_torch_distribution  # noqa: F401

CONFIGS = {
    # Meta Llama 3 8B (keras_hub preset llama3_8b_en)
    "llama3_8b": (
        keras_hub.models.LlamaBackbone,
        keras_hub.models.LlamaCausalLM,
        dict(
            vocabulary_size=128256,
            num_layers=32,
            num_query_heads=32,
            num_key_value_heads=8,
            hidden_dim=4096,
            intermediate_dim=14336,
            rope_max_wavelength=500000,
            layer_norm_epsilon=1e-5,
        ),
    ),
    # Google Gemma 2 9B (keras_hub preset gemma2_9b_en)
    "gemma2_9b": (
        keras_hub.models.GemmaBackbone,
        keras_hub.models.GemmaCausalLM,
        dict(
            vocabulary_size=256000,
            num_layers=42,
            num_query_heads=16,
            num_key_value_heads=8,
            hidden_dim=3584,
            intermediate_dim=28672,
            head_dim=256,
            query_head_dim_normalize=True,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0,
            use_sliding_window_attention=True,
            sliding_window_size=4096,
        ),
    ),
    # Qwen1.5-MoE-A2.7B (keras_hub preset qwen1.5_moe_2.7b_en)
    "qwen1.5_moe_a2.7b": (
        keras_hub.models.QwenMoeBackbone,
        keras_hub.models.QwenMoeCausalLM,
        dict(
            vocabulary_size=151936,
            num_layers=24,
            num_query_heads=16,
            num_key_value_heads=16,
            hidden_dim=2048,
            intermediate_dim=5632,
            moe_intermediate_dim=1408,
            shared_expert_intermediate_dim=5632,
            num_experts=60,
            top_k=4,
        ),
    ),
}

name, layout = sys.argv[1], sys.argv[2]
backbone_class, causal_lm_class, config = CONFIGS[name]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
n = len(devices)
shape = {"fsdp": (n, 1), "tp": (1, n), "2d": (max(n // 8, 1), min(n, 8))}[
    layout
]
mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(
        layout_map=backbone_class.get_layout_map(mesh),
        batch_dim_name="batch",
    )
)
backbone = backbone_class(**config)
model = causal_lm_class(backbone=backbone, preprocessor=None)
model.compile(
    optimizer=keras.optimizers.Adam(1e-5),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    weighted_metrics=[],
)
rows, tokens = shape[0], 16
ids = np.random.default_rng(0).integers(1, 1000, (rows, tokens + 1))
x = {
    "token_ids": ids[:, :-1],
    "padding_mask": np.ones((rows, tokens), dtype=bool),
}
model.fit(x, ids[:, 1:], batch_size=rows, epochs=1, verbose=0)
