"""The keras_hub Llama of benchmarks/fsdp.py's `llama` case, and a raw torch
model of the same shapes for FSDP2.

Keras: `keras_hub.models.LlamaCausalLM` (no preprocessor) on a tiny
config; torch: the same layers (token embedding, per decoder block an RMS
norm, q / k / v / output projections without bias, rotary position
embedding, causal grouped-query attention, an RMS norm and a SiLU-gated
feed-forward of gate / up / down projections; a final RMS norm and an
untied output projection), the same parameter count. Losses: sparse
categorical cross-entropy of the next token, from logits.
"""

from typing import NamedTuple

import numpy as np


class Shape(NamedTuple):
    """A Llama configuration and the global batch it is trained on."""

    vocab: int = 2048
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 384
    seq: int = 64
    global_batch: int = 8

    def parameters(self):
        """Parameters of both models (untied embedding and output)."""
        head_dim = self.hidden // self.heads
        attention = (
            self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        )
        block = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return 2 * self.vocab * self.hidden + self.layers * block + self.hidden


TINY = Shape()
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, SEQ, GLOBAL_BATCH = TINY
EPS = 1e-6


def arrays(seed=0, shape=TINY):
    """Token ids of the global batch: inputs (global_batch, seq) and the
    next-token targets."""
    ids = np.random.default_rng(seed).integers(
        1, shape.vocab, (shape.global_batch, shape.seq + 1)
    )
    return ids[:, :-1].astype("int32"), ids[:, 1:].astype("int32")


def keras_causal_lm(keras, keras_hub, shape=TINY):
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=shape.vocab,
        num_layers=shape.layers,
        num_query_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        hidden_dim=shape.hidden,
        intermediate_dim=shape.ffn,
        layer_norm_epsilon=EPS,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def keras_inputs(token_ids):
    return {
        "token_ids": token_ids,
        "padding_mask": np.ones(token_ids.shape, bool),
    }


def torch_causal_lm(shape=TINY):
    """The torch model: `.blocks` are the decoder blocks (what FSDP2
    wraps one by one)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, SEQ, _ = shape  # noqa: N806
    head_dim = HIDDEN // HEADS

    def rotary(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = nn.RMSNorm(HIDDEN, eps=EPS)
            self.query = nn.Linear(HIDDEN, HEADS * head_dim, bias=False)
            self.key = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
            self.value = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
            self.attention_output = nn.Linear(
                HEADS * head_dim, HIDDEN, bias=False
            )
            self.ffn_norm = nn.RMSNorm(HIDDEN, eps=EPS)
            self.gate = nn.Linear(HIDDEN, FFN, bias=False)
            self.up = nn.Linear(HIDDEN, FFN, bias=False)
            self.down = nn.Linear(FFN, HIDDEN, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            h = self.attention_norm(x)
            q = self.query(h).view(b, t, HEADS, head_dim).transpose(1, 2)
            k = self.key(h).view(b, t, KV_HEADS, head_dim).transpose(1, 2)
            v = self.value(h).view(b, t, KV_HEADS, head_dim).transpose(1, 2)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            attention = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
            x = x + self.attention_output(
                attention.transpose(1, 2).reshape(b, t, HIDDEN)
            )
            h = self.ffn_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.RMSNorm(HIDDEN, eps=EPS)
            self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
            inverse = 1.0 / (
                10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
            )
            angles = torch.outer(torch.arange(SEQ).float(), inverse)
            angles = torch.cat([angles, angles], dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

        def forward(self, token_ids):
            x = self.embedding(token_ids)
            for block in self.blocks:
                x = block(x, self.cos, self.sin)
            return self.output(self.norm(x))

    return CausalLM()


def torch_train_step(model, optimizer, x, y):
    """A raw-torch causal-LM training step: next-token cross-entropy from
    logits (Keras' SparseCategoricalCrossentropy(from_logits=True)); the
    step's loss is kept in `step.last_loss`."""
    import torch.nn.functional as F

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        loss.backward()
        optimizer.step()
        step.last_loss = loss

    return step
