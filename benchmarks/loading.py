"""Loading a keras_hub preset shard by shard: per-rank peak and bytes read.

    python benchmarks/loading.py [--worlds 2 4] [--scale 1.0] [--quick] [--hf]

Model: a keras_hub Llama shaped like a 0.5 B-parameter one (hidden 896,
14 query / 2 key-value heads, feed-forward 4864, untied output embedding),
scaled down for a small machine: by default 8 layers and a vocabulary of
32768, 178 M parameters, 0.71 GB in float32 (`--scale` multiplies the
layers and the vocabulary). One process saves it as a preset
(`save_to_preset`: `config.json` + `model.weights.h5`); then, in fresh
processes (torchrun), every rank sets ModelParallel with the backbone's own
`get_layout_map` on a (1, N) ("batch", "model") mesh plus the key it lacks
(`token_embedding/reverse_embeddings`) and calls
`LlamaBackbone.from_preset(preset)`.

Cases:
  shard  -- the package as it is: each rank reads only the blocks it keeps
            (`StoredValue`, h5py hyperslabs).
  whole  -- the same with Keras' own weight store reads (every dataset read
            whole, then cut): the package before loading shard by shard.
  one    -- one process, no distribution (the whole model).
With --hf, the same weights as a Hugging Face checkpoint (transformers'
`config.json` + `model.safetensors`, written by the same process), which
keras_hub converts (its `SafetensorLoader` and Llama converter, what
`from_preset` of that directory runs):
  hf-shard -- the package: each tensor handed to keras_hub's transposes and
              reshapes unread, this rank's block read (`TensorFileValue`,
              positioned reads of the file, not its memory map).
  hf-whole -- keras_hub's own `port_weight` put back: every tensor read
              whole on every rank, transformed, then cut.

Per rank: the peak RSS (sampled every 0.5 ms) minus the RSS before
`from_preset`, as a fraction of the model's bytes (and the same of the
anonymous memory alone, RssAnon: without mapped files' pages), for the
build alone (born sharded) and for the whole `from_preset` (build +
load); the bytes read from the weights file (counted by the stored-value
readers; the `whole` cases read every tensor whole: the file's size)
against the bytes the rank keeps; and a checksum of the logits of 8
tokens (equal to one process's).
Target (issue 40): at world 4 the worst rank's peak <= 0.35 of the model,
bytes read <= the rank's share plus one block of the largest variable.
World 8 without 8 processes' memory: `ktd plan` gives each rank's bytes,
which is what it reads (see the report).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
from creation_memory import PeakSampler  # noqa: E402

TARGET_WORLD_4 = 0.35


class AnonPeakSampler(PeakSampler):
    """PeakSampler of the process's anonymous memory (RssAnon): without the
    pages of files it maps, which are the page cache's (safetensors reads
    through a memory map of the whole file: the pages a rank touches count
    in its RSS, though they are shared and given back under pressure; the
    package reads its blocks with positioned reads instead, keras_hub's
    whole reads of variables not sharded go through the map)."""

    def _run(self):
        while not self._stop.is_set():
            rss = self.rss()
            self.samples += 1
            self.peak = max(self.peak, rss)
            time.sleep(self._interval)

    def rss(self):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0


def _shape():
    scale = float(os.environ.get("BENCH_SCALE", "1.0"))
    return dict(
        vocabulary_size=int(32768 * scale),
        num_layers=max(1, int(8 * scale)),
        num_query_heads=14,
        num_key_value_heads=2,
        hidden_dim=896,
        intermediate_dim=4864,
    )


TOKENS = [[11, 7, 300, 5, 99, 1234, 17, 2]]


def _logits_checksum(keras, backbone):
    import numpy as np

    ids = np.asarray(TOKENS, "int32")
    hidden = backbone(
        {"token_ids": ids, "padding_mask": np.ones(ids.shape, bool)}
    )
    logits = keras.ops.convert_to_numpy(
        backbone.token_embedding(hidden, reverse=True)
    )
    return float(np.abs(logits).astype("float64").sum())


def _save_preset(directory, hf_directory=None):
    """One process: build the model from seed 0 and save it as a preset
    (and, with `hf_directory`, as a Hugging Face checkpoint)."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(**_shape())
    backbone.save_to_preset(directory)
    if hf_directory:
        _save_hf(backbone, hf_directory)
    return backbone.count_params()


def _save_hf(backbone, directory):
    """The backbone's weights in transformers' Llama names and layouts
    (projections (out, in)), with its `config.json`: keras_hub's
    converter gives back exactly these weights."""
    import numpy as np
    from safetensors.numpy import save_file

    shape = _shape()
    tensors = {
        "model.embed_tokens.weight": backbone.token_embedding.embeddings,
        "lm_head.weight": np.transpose(
            backbone.token_embedding.reverse_embeddings
        ),
        "model.norm.weight": backbone.get_layer(
            "sequence_output_layernorm"
        ).scale,
    }
    for i in range(shape["num_layers"]):
        layer = backbone.get_layer(f"transformer_layer_{i}")
        attention = layer._self_attention_layer
        name = f"model.layers.{i}."
        for hf, kernel in (
            ("self_attn.q_proj", attention._query_dense.kernel),
            ("self_attn.k_proj", attention._key_dense.kernel),
            ("self_attn.v_proj", attention._value_dense.kernel),
        ):
            kernel = np.asarray(kernel)
            tensors[name + hf + ".weight"] = np.transpose(
                kernel.reshape(kernel.shape[0], -1)
            )
        kernel = np.asarray(attention._output_dense.kernel)
        tensors[name + "self_attn.o_proj.weight"] = np.transpose(
            kernel.reshape(-1, kernel.shape[-1])
        )
        for hf, dense in (
            ("mlp.gate_proj", layer._feedforward_gate_dense),
            ("mlp.up_proj", layer._feedforward_intermediate_dense),
            ("mlp.down_proj", layer._feedforward_output_dense),
        ):
            tensors[name + hf + ".weight"] = np.transpose(dense.kernel)
        tensors[name + "input_layernorm.weight"] = (
            layer._self_attention_layernorm.scale
        )
        tensors[name + "post_attention_layernorm.weight"] = (
            layer._feedforward_layernorm.scale
        )
    tensors = {
        k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()
    }
    os.makedirs(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": shape["vocabulary_size"],
        "hidden_size": shape["hidden_dim"],
        "intermediate_size": shape["intermediate_dim"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_query_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _set_distribution(keras, keras_hub):
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ["batch", "model"], devices
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    layout_map["token_embedding/reverse_embeddings"] = ("batch", "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )


def _keras_reads():
    """Put Keras' own `H5IOStore.__getitem__` back (the `whole` case)."""
    from keras_torch_distribution import _install

    for patch in _install._installed:
        if patch.name == "__getitem__":
            setattr(patch.owner, patch.name, patch.original)


def _keras_hub_reads():
    """Put keras_hub's own `SafetensorLoader.port_weight` back (the
    `hf-whole` case)."""
    from keras_torch_distribution import _install

    for patch in _install._installed:
        if patch.name == "port_weight":
            setattr(patch.owner, patch.name, patch.original)


def _convert(keras_hub, backbone, checkpoint):
    """Convert the Hugging Face checkpoint's weights into the backbone as
    `from_preset` does (keras_hub's loader and Llama converter)."""
    from keras_hub.src.utils.preset_utils import get_preset_loader
    from keras_hub.src.utils.transformers import safetensor_utils

    loader = get_preset_loader(checkpoint)
    with safetensor_utils.SafetensorLoader(checkpoint) as files:
        loader.converter.convert_weights(backbone, files, loader.config)


def worker(case):
    import keras
    import keras_hub
    import torch

    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution._distributed import stored_values
    from keras_torch_distribution._variables import born_sharded
    from keras_torch_distribution._variables import left_whole

    torch.set_num_threads(1)
    preset = os.environ["BENCH_PRESET"]
    if case != "one":
        import torch.distributed as dist

        keras.distribution.initialize()
        _set_distribution(keras, keras_hub)
        if case == "whole":
            _keras_reads()
        barrier = dist.barrier
    else:
        barrier = lambda: None  # noqa: E731
    gc.collect()
    barrier()
    stored_values.reads.clear()
    source = os.environ["BENCH_HF"] if case.startswith("hf") else preset
    with PeakSampler() as build, AnonPeakSampler() as anon_build:
        baseline = build.rss()
        anon_baseline = anon_build.rss()
        backbone = keras_hub.models.Backbone.from_preset(
            source, load_weights=False
        )
    built = build.peak - baseline
    anon_built = anon_build.peak - anon_baseline
    if case == "hf-whole":
        _keras_hub_reads()
    gc.collect()
    with PeakSampler() as load, AnonPeakSampler() as anon_load:
        start = time.perf_counter()
        if case.startswith("hf"):
            _convert(keras_hub, backbone, source)
        else:
            backbone.load_weights(os.path.join(preset, "model.weights.h5"))
        seconds = time.perf_counter() - start
    loaded = max(load.peak - baseline, built)
    anon_loaded = max(anon_load.peak - anon_baseline, anon_built)
    model_bytes = sum(
        left_whole.global_bytes(v.shape, v.dtype) for v in backbone.weights
    )
    kept = sum(born_sharded.local_bytes(v) for v in backbone.weights)
    largest_block = max(born_sharded.local_bytes(v) for v in backbone.weights)
    read = stored_values.reads.bytes
    if case in ("whole", "one", "hf-whole"):
        read = model_bytes  # Keras reads every dataset whole
    checksum = _logits_checksum(keras, backbone)
    _launch.write_rank_result(
        {
            "case": case,
            "model_bytes": model_bytes,
            "kept_bytes": kept,
            "largest_block_bytes": largest_block,
            "read_bytes": read,
            "build_peak_bytes": built,
            "peak_bytes": loaded,
            "anon_build_peak_bytes": anon_built,
            "anon_peak_bytes": anon_loaded,
            "load_seconds": round(seconds, 2),
            "logits_checksum": checksum,
        }
    )


def _row(case, world, results):
    model = results[0]["model_bytes"]
    worst = max(r["peak_bytes"] for r in results)
    build = max(r["build_peak_bytes"] for r in results)
    anon = max(r["anon_peak_bytes"] for r in results)
    anon_build = max(r["anon_build_peak_bytes"] for r in results)
    read = max(r["read_bytes"] for r in results)
    kept = max(r["kept_bytes"] for r in results)
    block = max(r["largest_block_bytes"] for r in results)
    print(
        f"{case:>6} x{world}: peak {worst / model:.3f} of the model "
        f"(build alone {build / model:.3f}; anonymous {anon / model:.3f}, "
        f"build alone {anon_build / model:.3f}), "
        f"read {read / 2**20:,.0f} MiB "
        f"(keeps {kept / 2**20:,.0f}, share + block "
        f"{(model / world + block) / 2**20:,.0f}), "
        f"load {max(r['load_seconds'] for r in results):.1f} s",
        flush=True,
    )
    return {
        "case": case,
        "world": world,
        "worst_peak_of_model": round(worst / model, 4),
        "worst_build_peak_of_model": round(build / model, 4),
        "worst_anon_peak_of_model": round(anon / model, 4),
        "worst_anon_build_peak_of_model": round(anon_build / model, 4),
        "worst_read_bytes": read,
        "worst_kept_bytes": kept,
        "share_plus_block_bytes": model // world + block,
        "ranks": results,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument(
        "--quick", action="store_true", help="the shard case(s) only"
    )
    parser.add_argument(
        "--hf",
        action="store_true",
        help="also a Hugging Face checkpoint of the same weights",
    )
    args = parser.parse_args()
    os.environ["BENCH_SCALE"] = str(args.scale)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ktd-loading-") as directory:
        preset = os.path.join(directory, "preset")
        hf = os.path.join(directory, "hf") if args.hf else None
        started = time.monotonic()
        params = _launch_save(preset, hf)
        size = os.path.getsize(os.path.join(preset, "model.weights.h5"))
        print(
            f"preset: {params / 1e6:.0f} M parameters, model.weights.h5 "
            f"{size / 2**30:.2f} GiB, saved in "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        env = {"BENCH_PRESET": preset, "BENCH_SCALE": str(args.scale)}
        cases = ["shard"] if args.quick else ["shard", "whole"]
        if hf:
            env["BENCH_HF"] = hf
            cases += ["hf-shard"] if args.quick else ["hf-shard", "hf-whole"]
        if not args.quick:
            rows.append(
                _row("one", 1, _launch.launch(__file__, "one", 1, 600, env))
            )
        for world in args.worlds:
            for case in cases:
                results = _launch.launch(__file__, case, world, 900, env)
                rows.append(_row(case, world, results))
    reference = [r for r in rows if r["case"] == "one"]
    for row in rows:
        sums = {r["logits_checksum"] for r in row["ranks"]}
        if reference:
            expected = reference[0]["ranks"][0]["logits_checksum"]
            row["logits_match_one_process"] = all(
                abs(s - expected) <= 1e-5 * abs(expected) for s in sums
            )
    for row in rows:
        if row["case"] in ("shard", "hf-shard") and row["world"] == 4:
            ok = row["worst_peak_of_model"] <= TARGET_WORLD_4
            print(
                f"{row['case']}: world 4 worst peak "
                f"{row['worst_peak_of_model']:.3f} "
                f"(target <= {TARGET_WORLD_4}): {'met' if ok else 'NOT met'}"
            )
    _launch.save(
        "loading",
        {"machine": _launch.machine(), "shape": _shape(), "rows": rows},
    )
    print(
        json.dumps(
            [{k: v for k, v in r.items() if k != "ranks"} for r in rows],
            indent=1,
        )
    )


def _launch_save(preset, hf=None):
    """Save the preset (and the Hugging Face checkpoint) in a process of
    its own (its memory is given back)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_save_preset, (preset, hf))


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
