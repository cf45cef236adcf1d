"""QLoRA under FSDP: what a rank holds during a training step, on 2 CPU
processes (issue 47).

    python benchmarks/qlora_memory.py            # ~2 min on 2 quiet cores

A keras_hub Llama (llama_shapes' tiny one, `--hidden` / `--ffn` to grow
it) under FSDP (fsdp.py's set-up: a (2, 1) mesh, keras_hub's own layout
map), `quantize("int8")`, `backbone.enable_lora(4)`, Adam. Cases:

  package     the package's int8 call (`_training.quantized`): the int8
              kernel gathered again in backward, not kept from forward
  keras_call  Keras' own `Dense._int8_call` / `EinsumDense._int8_call`,
              whose custom gradient keeps the kernel it was given (the
              gathered one) until its backward

Per rank, over one step after two warm-up steps, every tensor the step's
ops create is recorded (its storage, while alive: remat_memory.py's
method, by dtype):

- `int8_at_peak_bytes`: int8 bytes alive at the step's peak (gathered
  kernels: the rank's own int8 blocks are its variables, made before the
  step, and not counted); `int8_most_alive_bytes`: the most int8 bytes
  alive at any moment of the step;
- `largest_group_int8_bytes`: the int8 bytes of the largest FSDP group
  (a decoder block's kernels, or the token embedding, whole;
  `groups_int8_bytes` each group's);
- `int8_blocks_bytes`: this rank's stored int8 blocks (its share of
  every int8 kernel);
- `peak_bytes`: every byte alive at the peak above what was alive before.

Results: benchmarks/results/qlora_memory.json.
"""

import argparse
import gc
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
import fsdp  # noqa: E402
import llama_shapes  # noqa: E402

CASES = ("package", "keras_call")
PROCESSES = 2
WARMUP = 2


class LiveBytesByDtype:
    """Bytes of the storages the ops inside the block create, while alive:
    the peak, and the bytes by dtype alive at it."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tracker._forget_freed()
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self.mode = Mode()
        self.live = {}
        self.total = 0
        self.peak = 0
        self.at_peak = {}
        self.by_dtype = {}  # dtype -> bytes alive now
        self.most_by_dtype = {}  # dtype -> the most bytes alive at once

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def _forget_freed(self):
        for key in [k for k, entry in self.live.items() if entry[0].expired()]:
            _, nbytes, dtype = self.live.pop(key)
            self.total -= nbytes
            self.by_dtype[dtype] -= nbytes

    def _record(self, out):
        import torch
        from torch.distributed.tensor import DTensor
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if isinstance(leaf, DTensor):
                leaf = leaf._local_tensor
            if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            key = storage._cdata
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = (
                StorageWeakRef(storage),
                storage.nbytes(),
                str(leaf.dtype).replace("torch.", ""),
            )
            self.total += storage.nbytes()
            dtype = self.live[key][2]
            alive = self.by_dtype.get(dtype, 0) + storage.nbytes()
            self.by_dtype[dtype] = alive
            self.most_by_dtype[dtype] = max(
                self.most_by_dtype.get(dtype, 0), self.by_dtype[dtype]
            )
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {}
            for _, nbytes, dtype in self.live.values():
                self.at_peak[dtype] = self.at_peak.get(dtype, 0) + nbytes


def _worker(case, shape):
    import keras
    import keras_hub
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution import _install
    from keras_torch_distribution import _keras

    torch.set_num_threads(1)
    keras.distribution.initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    keras.distribution.set_distribution(
        fsdp.llama_distribution(
            keras, keras_hub, keras.distribution.list_devices()
        )
    )
    keras.utils.set_random_seed(0)
    model = llama_shapes.keras_causal_lm(keras, keras_hub, shape)
    model.quantize("int8")
    model.backbone.enable_lora(4)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    if case == "keras_call":
        for patch in _install._installed:
            if patch.name == "_int8_call":
                setattr(patch.owner, patch.name, patch.original)
    x, y = llama_shapes.arrays(shape=shape)
    function, batch = fsdp.keras_step(
        keras, model, llama_shapes.keras_inputs(x), y, rank, world
    )
    losses = [float(function(batch)["loss"]) for _ in range(WARMUP)]
    gc.collect()
    dist.barrier()
    with LiveBytesByDtype() as live:
        losses.append(float(function(batch)["loss"]))
    int8 = [v for v in model.weights if "int8" in str(v.dtype)]
    blocks = {}
    for variable in int8:
        block = variable.path.split("/")[0]  # a decoder block, the embedding
        blocks[block] = blocks.get(block, 0) + math.prod(variable.shape)
    local = 0
    for variable in int8:
        value = _keras.raw_value(variable)
        local += value.to_local().nbytes if hasattr(value, "to_local") else 0
    _launch.write_rank_result(
        {
            "rank": rank,
            "losses": losses,
            "peak_bytes": live.peak,
            "at_peak_bytes": live.at_peak,
            "int8_at_peak_bytes": live.at_peak.get("int8", 0),
            "int8_most_alive_bytes": live.most_by_dtype.get("int8", 0),
            "groups_int8_bytes": blocks,
            "largest_group_int8_bytes": max(blocks.values()),
            "int8_kernels_bytes": sum(math.prod(v.shape) for v in int8),
            "int8_blocks_bytes": local,
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=llama_shapes.HIDDEN)
    parser.add_argument("--ffn", type=int, default=llama_shapes.FFN)
    args = parser.parse_args()
    results = {}
    for case in CASES:
        results[case] = _launch.launch(
            os.path.abspath(__file__),
            case,
            PROCESSES,
            timeout=600,
            extra_env={
                "QLORA_HIDDEN": str(args.hidden),
                "QLORA_FFN": str(args.ffn),
            },
        )
        for row in results[case]:
            print(
                f"{case:10} rank {row['rank']}: int8 at the peak "
                f"{row['int8_at_peak_bytes']:,} B, the most at once "
                f"{row['int8_most_alive_bytes']:,} B (largest group "
                f"{row['largest_group_int8_bytes']:,} B, every kernel "
                f"{row['int8_kernels_bytes']:,} B, this rank's blocks "
                f"{row['int8_blocks_bytes']:,} B); peak "
                f"{row['peak_bytes']:,} B; losses {row['losses']}"
            )
    _launch.save("qlora_memory", results)


if __name__ == "__main__":
    case = os.environ.get("BENCH_WORKER")
    if case:
        _worker(
            case,
            llama_shapes.Shape(
                hidden=int(os.environ["QLORA_HIDDEN"]),
                ffn=int(os.environ["QLORA_FFN"]),
            ),
        )
    else:
        main()
