"""Tensor (model) parallelism: a small transformer language model whose
variables are sharded over 2 processes by a LayoutMap, Megatron style.

    ktd run -n 2 examples/transformer_lm.py

- token embedding: sharded on the vocabulary (each rank holds half the rows;
  the lookup is a partial sum, reduced once at the layer's boundary);
- attention: query/key/value kernels sharded on heads, the output projection
  on its heads dim (row-parallel);
- MLP: the first Dense column-parallel, the second row-parallel;
- the output layer column-parallel on the vocabulary (each rank computes
  half the logits; the loss is one process's);
- layer norms and position embeddings replicated (small).

Every sharded variable is born sharded: no rank ever holds it whole. The
task is synthetic: continue sequences that count up modulo the vocabulary.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution as ktd  # noqa: E402

VOCAB, SEQ, DIM, HEADS, HIDDEN, BLOCKS = 64, 16, 32, 4, 64, 2

keras.distribution.initialize()
devices = keras.distribution.list_devices()
# A batch axis of size 1: every process computes on the whole batch and the
# "model" axis is pure tensor parallelism. (On a 1-D ("model",) mesh that axis
# would also be the batch axis, as on JAX: FSDP, each process on its rows.)
mesh = keras.distribution.DeviceMesh(
    (1, len(devices)), ["batch", "model"], devices
)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[r".*token_embedding/embeddings"] = ("model", None)  # vocabulary
layout_map[r".*attention/(query|key|value)/kernel"] = (
    None,
    "model",
    None,
)  # heads
layout_map[r".*attention/(query|key|value)/bias"] = ("model", None)
layout_map[r".*attention/attention_output/kernel"] = ("model", None, None)
layout_map[r".*mlp_up/kernel"] = (None, "model")  # column-parallel
layout_map[r".*mlp_up/bias"] = ("model",)
layout_map[r".*mlp_down/kernel"] = ("model", None)  # row-parallel
layout_map[r"logits/kernel"] = (None, "model")  # vocabulary-parallel output
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
)


def say(*args):
    if ktd.process_id() == 0:
        print(*args, flush=True)


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position (replicated: no rule shards it)."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]),
            initializer="random_normal",
            name="positions",
        )

    def call(self, x):
        return x + self.positions


def block(x, index):
    name = f"block{index}"
    h = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
    h = keras.layers.MultiHeadAttention(
        HEADS, DIM // HEADS, name=f"{name}_attention"
    )(h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(name=f"{name}_ln2")(x)
    h = keras.layers.Dense(HIDDEN, activation="gelu", name=f"{name}_mlp_up")(h)
    h = keras.layers.Dense(DIM, name=f"{name}_mlp_down")(h)
    return x + h


def make_model():
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for index in range(BLOCKS):
        x = block(x, index)
    x = keras.layers.LayerNormalization(name="final_ln")(x)
    logits = keras.layers.Dense(VOCAB, name="logits")(x)
    return keras.Model(tokens, logits, name="lm")


rng = np.random.default_rng(0)
starts = rng.integers(0, VOCAB, size=(384, 1))
steps = rng.integers(1, 4, size=(384, 1))  # each sequence counts by 1, 2 or 3
sequences = (starts + steps * np.arange(SEQ + 1)) % VOCAB
x, y = sequences[:, :-1].astype("int32"), sequences[:, 1:].astype("int32")

keras.utils.set_random_seed(0)
model = make_model()
ktd.report(
    model, print_fn=say
)  # each rank's shards; collective: every rank calls it
model.compile(
    keras.optimizers.Adam(3e-3),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
history = model.fit(x, y, batch_size=64, epochs=8, verbose=0)
say("loss per epoch:", [round(v, 4) for v in history.history["loss"]])
say("accuracy per epoch:", [round(v, 4) for v in history.history["accuracy"]])
