"""A training script `ktd plan` plans and the tests also run for real.

    python plan_train.py MODEL LAYOUT
    MODEL: mlp | llama | qwen_moe | qwen_moe3 (tiny keras_hub models from
           their configs; qwen_moe3 has 3 experts, uneven on a model axis
           of 2, as Qwen1.5 MoE's 60 on 8)
    LAYOUT: dp (DataParallel) | tp (mesh (1, N)) | fsdp (mesh (N, 1)) |
            2d (mesh (N/2, 2)); the keras_hub models take their own
            layout maps.

tests/multiprocess/test_plan.py compares the plan's per-rank bytes and
collectives with a real run of this script on 2 and 4 processes.
"""

import sys

import keras
import numpy as np

import keras_torch_distribution  # noqa: F401

# MODEL -> (backbone class, causal LM class, extra config) in keras_hub
KERAS_HUB = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", {}),
    "qwen_moe": (
        "QwenMoeBackbone",
        "QwenMoeCausalLM",
        dict(
            moe_intermediate_dim=8,
            shared_expert_intermediate_dim=16,
            num_experts=4,
            top_k=2,
        ),
    ),
}
KERAS_HUB["qwen_moe3"] = (
    *KERAS_HUB["qwen_moe"][:2],
    dict(KERAS_HUB["qwen_moe"][2], num_experts=3),
)
model_name, layout = sys.argv[1], sys.argv[2]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
n = len(devices)
if layout == "dp":
    distribution = keras.distribution.DataParallel(devices=devices)
else:
    shape = {"tp": (1, n), "fsdp": (n, 1), "2d": (n // 2, 2)}[layout]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    if model_name in KERAS_HUB:
        import keras_hub

        backbone_class = getattr(keras_hub.models, KERAS_HUB[model_name][0])
        layout_map = backbone_class.get_layout_map(mesh)
    else:
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[r".*dense_0/kernel"] = ("batch", "model")
        layout_map[r".*dense_0/bias"] = ("model",)
        layout_map[r".*dense_1/kernel"] = ("model", "batch")
        layout_map[r".*dense_2/kernel"] = ("batch", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
keras.distribution.set_distribution(distribution)
keras.utils.set_random_seed(0)
rows = 8
if model_name in KERAS_HUB:
    import keras_hub

    backbone_name, causal_lm_name, extra = KERAS_HUB[model_name]
    backbone = getattr(keras_hub.models, backbone_name)(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        **extra,
    )
    model = getattr(keras_hub.models, causal_lm_name)(
        backbone=backbone, preprocessor=None
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ids = np.random.default_rng(0).integers(1, 64, (rows, 9))
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": np.ones((rows, 8), dtype=bool),
    }
    y = ids[:, 1:]
else:
    model = keras.Sequential(
        [keras.Input((12,))]
        + [
            keras.layers.Dense(width, name=f"dense_{i}")
            for i, width in enumerate((20, 10, 3))
        ]
    )
    loss = "mse"
    x = np.random.default_rng(0).normal(size=(rows, 12)).astype("float32")
    y = np.random.default_rng(1).normal(size=(rows, 3)).astype("float32")
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
model.fit(x, y, batch_size=rows, epochs=2, verbose=0)
