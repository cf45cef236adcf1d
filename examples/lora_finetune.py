"""Fine-tune a keras_hub causal LM with LoRA on a 2 x 2 mesh, then generate.

    pip install -e ".[test]" && pip install --no-deps keras-hub==0.32.0
    ktd run -n 4 examples/lora_finetune.py [output_dir]

The mesh has a "batch" axis (2 data-parallel replicas) and a "model" axis
(2 processes share every sharded weight, Megatron style: attention sharded
on heads, the MLP column- then row-parallel, the embedding on its
vocabulary). No weights can be downloaded here, so a tiny GPT-2 with a
byte-level tokenizer is first trained briefly on a toy corpus (standing in
for a preset), then LoRA adapters are fine-tuned on a second corpus while
the base weights stay frozen. The adapters are saved with keras_hub's
`save_lora_weights` (rank 0 writes the file, every rank can read it as soon
as the call returns), loaded into a fresh model, and both generate the same
text.
"""

import os
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import keras_hub  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402

SEQUENCE_LENGTH = 24
BASE_CORPUS = [
    "the cat sat on the mat.",
    "the dog sat on the log.",
    "a cat and a dog sat.",
    "the mat is red.",
] * 4
TASK_CORPUS = ["the cat sat on the red mat.", "the dog sat on the red log."] * 8

keras.distribution.initialize()
devices = keras.distribution.list_devices()
if len(devices) % 2:
    raise SystemExit(
        "lora_finetune.py needs an even number of processes (got "
        f"{len(devices)}): run it with `ktd run -n 4 "
        "examples/lora_finetune.py`."
    )
mesh = keras.distribution.DeviceMesh(
    (len(devices) // 2, 2), ["batch", "model"], devices
)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["token_embedding/embeddings"] = ("model", None)
layout_map[r"self_attention/(query|key|value)/kernel"] = (None, "model", None)
layout_map[r"self_attention/(query|key|value)/bias"] = ("model", None)
layout_map[r"self_attention/attention_output/kernel"] = ("model", None, None)
layout_map[r"feedforward_intermediate_dense/kernel"] = (None, "model")
layout_map[r"feedforward_intermediate_dense/bias"] = ("model",)
layout_map[r"feedforward_output_dense/kernel"] = ("model", None)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
)


def say(*args):
    if ktd.process_id() == 0:
        print(*args, flush=True)


def tokenizer():
    """GPT-2's byte-level tokenizer with no merges: one token per byte."""
    from keras_hub.src.tokenizers.byte_pair_tokenizer import bytes_to_unicode

    vocabulary = {c: i for i, c in enumerate(bytes_to_unicode()[1])}
    vocabulary["<|endoftext|>"] = len(vocabulary)
    vocabulary["<|unused|>"] = len(
        vocabulary
    )  # 258: splits evenly over "model"
    return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=[])


def model():
    keras.utils.set_random_seed(0)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer(), sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=SEQUENCE_LENGTH,
        dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(
        backbone=backbone, preprocessor=preprocessor
    )


def compile_for(lm, learning_rate):
    lm.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
        sampler="greedy",
    )


def enable_lora(lm):
    lm.backbone.enable_lora(rank=4)
    # Only the adapters train (enable_lora leaves the LoRA layers' biases
    # trainable; save_lora_weights saves the adapters only).
    for variable in lm.trainable_variables:
        if "lora" not in variable.path:
            variable.trainable = False


def base_weights_path(directory):
    return os.path.join(directory, "base.weights.h5")


def main(directory):
    lm = model()
    compile_for(lm, 2e-2)
    history = lm.fit(BASE_CORPUS, batch_size=8, epochs=16, verbose=0)
    say("base loss per epoch:", [round(v, 3) for v in history.history["loss"]])
    lm.save_weights(base_weights_path(directory))

    enable_lora(lm)
    compile_for(lm, 3e-2)
    history = lm.fit(TASK_CORPUS, batch_size=8, epochs=12, verbose=0)
    say("LoRA loss per epoch:", [round(v, 3) for v in history.history["loss"]])
    generated = lm.generate(
        ["the cat sat", "the dog"], max_length=SEQUENCE_LENGTH
    )
    say("generated:", [text.strip() for text in generated])

    lora_path = os.path.join(directory, "adapters.lora.h5")
    lm.backbone.save_lora_weights(lora_path)
    fresh = model()
    fresh.load_weights(base_weights_path(directory))
    enable_lora(fresh)
    fresh.backbone.load_lora_weights(lora_path)
    compile_for(fresh, 3e-2)
    again = fresh.generate(
        ["the cat sat", "the dog"], max_length=SEQUENCE_LENGTH
    )
    say("reloaded adapters generate the same:", list(again) == list(generated))
    say("files:", sorted(os.listdir(directory)))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        main(sys.argv[1])
    else:
        # Every rank must write to (and read from) the same directory.
        shared = os.path.join(tempfile.gettempdir(), "ktd-lora-finetune")
        os.makedirs(shared, exist_ok=True)
        main(shared)
