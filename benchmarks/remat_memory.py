"""Rematerialization under FSDP: the memory a training step holds, on 2 CPU
processes, the package against FSDP2 with torch's activation checkpointing.

    python benchmarks/remat_memory.py            # ~1.5 min (--seq, --layers)

Cases (each 2 fresh torchrun processes, gloo, a keras_hub Llama of
llama_shapes.py's layers with a longer sequence, see SHAPE):

  keras_fsdp        keras_hub LlamaCausalLM under FSDP: a (2, 1) ("batch",
                    "model") mesh and keras_hub's own layout map (its
                    kernels sharded on the batch axis), fsdp.py's set-up
  keras_fsdp_remat  the same model built in `keras.RematScope(mode="full")`
                    (every layer's call rematerialized: backward recomputes
                    it, FSDP groups gathered again in the recompute)
  torch_fsdp2       the torch model of the same shapes, `fully_shard` on
                    each decoder block and the root (fsdp.py's)
  torch_fsdp2_ac    the same, each block wrapped in torch's non-reentrant
                    `checkpoint_wrapper` before `fully_shard` (torchtitan's
                    order and granularity)

What is measured, per rank, over one training step after two warm-up steps
(Keras: its per-step function on the rank's rows, as fsdp.py times it;
torch: zero_grad, forward, cross-entropy, backward, Adam): every tensor the
step's aten ops create is recorded by a `TorchDispatchMode` (its storage,
by a weak reference, so its bytes count until it is freed; views and
in-place results are not counted twice; a DTensor counts its local
tensor). From these:

- `saved_at_backward_bytes`: the bytes alive when backward starts (the
  first op autograd's engine runs): the activations forward saved for
  backward, and the logits and loss; for FSDP, any gathered weight forward
  kept. This is what rematerialization is for.
- `peak_bytes`: the most bytes alive at once during the step (above what
  was alive before it: weights, optimizer state), the CPU counterpart of
  `torch.cuda.max_memory_allocated()`: on a GPU, the caching allocator
  would hold about this much for the step.

Why not RSS: with a model this small (a few MiB of activations per rank),
glibc's arenas keep freed blocks and RSS moves by its own page-sized
steps, so peak RSS mostly measures the allocator; tensor bytes are exact and
the same from run to run. Ratios (`ratios`): each case's figure over its
framework's case without rematerialization, and the package's over
FSDP2's. Results: benchmarks/results/remat_memory.json.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
import fsdp  # noqa: E402  (the FSDP set-up of both frameworks)
import llama_shapes  # noqa: E402

CASES = ("keras_fsdp", "keras_fsdp_remat", "torch_fsdp2", "torch_fsdp2_ac")
PROCESSES = 2
WARMUP = 2
# llama_shapes' tiny Llama with a 4x longer sequence and a smaller
# vocabulary: activations (which rematerialization trades for compute)
# rather than the logits dominate the step.
SHAPE = llama_shapes.Shape(vocab=512, seq=256)


class LiveTensorBytes:
    """A TorchDispatchMode counting the bytes of the storages the ops it
    sees create, while they are alive: the peak, and the bytes alive when
    autograd's engine runs its first op (the start of backward)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tracker._before_op()
                out = func(*args, **(kwargs or {}))
                tracker._record(out)
                return out

        self.mode = Mode()
        self.live = {}  # storage key -> (StorageWeakRef, bytes)
        self.live_bytes = 0
        self.peak = 0
        self.at_backward = None

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def _before_op(self):
        import torch

        self._forget_freed()
        if self.at_backward is None and torch._C._current_graph_task_id() >= 0:
            self.at_backward = self.live_bytes

    def _forget_freed(self):
        freed = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for key in freed:
            self.live_bytes -= self.live.pop(key)[1]

    def _record(self, out):
        from torch.multiprocessing.reductions import StorageWeakRef

        for tensor in _plain_tensors(out):
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.live_bytes += storage.nbytes()
        self.peak = max(self.peak, self.live_bytes)


def _plain_tensors(out):
    """The plain tensors of an op's output (a DTensor's local tensor)."""
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(out):
        if not isinstance(leaf, torch.Tensor):
            continue
        if hasattr(leaf, "__tensor_flatten__"):
            names, _ = leaf.__tensor_flatten__()
            yield from _plain_tensors([getattr(leaf, n) for n in names])
        else:
            yield leaf


def _measure(step, barrier):
    """Two warm-up steps, then one step counted by LiveTensorBytes."""
    import gc

    for _ in range(WARMUP):
        step()
    gc.collect()
    barrier()
    started = time.perf_counter()
    with LiveTensorBytes() as live:
        step()
    return {
        "peak_bytes": live.peak,
        "saved_at_backward_bytes": live.at_backward,
        "tracked_step_s": round(time.perf_counter() - started, 3),
    }


def _keras_worker(remat):
    import contextlib

    import keras
    import keras_hub
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401

    torch.set_num_threads(1)
    keras.distribution.initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    keras.distribution.set_distribution(
        fsdp.llama_distribution(
            keras, keras_hub, keras.distribution.list_devices()
        )
    )
    keras.utils.set_random_seed(0)
    scope = keras.RematScope(mode="full") if remat else contextlib.nullcontext()
    with scope:
        model = llama_shapes.keras_causal_lm(keras, keras_hub, SHAPE)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    x, y = llama_shapes.arrays(shape=SHAPE)
    function, batch = fsdp.keras_step(
        keras, model, llama_shapes.keras_inputs(x), y, rank, world
    )
    result = _measure(lambda: function(batch), dist.barrier)
    model.reset_metrics()
    logs = function(batch)
    result.update(
        rank=rank,
        final_loss=float(keras.ops.convert_to_numpy(logs["loss"])),
    )
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def _torch_worker(remat):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = llama_shapes.torch_causal_lm(SHAPE)
    if remat:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            )
    fsdp.fully_shard_llama(
        model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = (
        torch.as_tensor(fsdp._rows(a, rank, world)).long()
        for a in llama_shapes.arrays(shape=SHAPE)
    )
    step = llama_shapes.torch_train_step(model, optimizer, x, y)
    result = _measure(step, dist.barrier)
    step()
    loss = step.last_loss.detach().clone()
    dist.all_reduce(loss)
    result.update(rank=rank, final_loss=float(loss) / world)
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def worker(case):
    remat = case.endswith(("_remat", "_ac"))
    if case.startswith("keras"):
        _keras_worker(remat)
    else:
        _torch_worker(remat)


def _mib(n):
    return None if n is None else round(n / 2**20, 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=SHAPE.seq)
    parser.add_argument("--layers", type=int, default=SHAPE.layers)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    shape = SHAPE._replace(seq=args.seq, layers=args.layers)
    env = {"BENCH_SEQ": str(shape.seq), "BENCH_LAYERS": str(shape.layers)}
    cases = {}
    for case in args.cases.split(","):
        ranks = _launch.launch(
            os.path.abspath(__file__),
            case,
            PROCESSES,
            timeout=150,
            extra_env=env,
        )
        cases[case] = {
            "ranks": ranks,
            "peak_mib": max(_mib(r["peak_bytes"]) for r in ranks),
            "saved_at_backward_mib": max(
                _mib(r["saved_at_backward_bytes"]) for r in ranks
            ),
            "final_loss": ranks[0]["final_loss"],
        }
    ratios = {}
    for key in ("peak_mib", "saved_at_backward_mib"):
        for base, remat in (
            ("keras_fsdp", "keras_fsdp_remat"),
            ("torch_fsdp2", "torch_fsdp2_ac"),
        ):
            if base in cases and remat in cases:
                ratios[f"{remat}/{base} {key}"] = round(
                    cases[remat][key] / cases[base][key], 3
                )
        for keras_case, torch_case in (
            ("keras_fsdp", "torch_fsdp2"),
            ("keras_fsdp_remat", "torch_fsdp2_ac"),
        ):
            if keras_case in cases and torch_case in cases:
                ratios[f"{keras_case}/{torch_case} {key}"] = round(
                    cases[keras_case][key] / cases[torch_case][key], 3
                )
    print(f"\nLlama {shape}, {PROCESSES} processes, worst rank:")
    print(f"{'case':<18} {'peak MiB':>9} {'at backward MiB':>16} {'loss':>8}")
    for case, entry in cases.items():
        print(
            f"{case:<18} {entry['peak_mib']:>9.2f} "
            f"{entry['saved_at_backward_mib']:>16.2f} "
            f"{entry['final_loss']:>8.4f}"
        )
    for name, value in ratios.items():
        print(f"  {name}: {value}")
    _launch.save(
        "remat_memory",
        {
            "machine": _launch.machine(),
            "shape": shape._asdict(),
            "parameters": shape.parameters(),
            "processes": PROCESSES,
            "cases": cases,
            "ratios": ratios,
        },
    )


def _shape_from_env():
    global SHAPE
    if "BENCH_SEQ" in os.environ:
        SHAPE = SHAPE._replace(
            seq=int(os.environ["BENCH_SEQ"]),
            layers=int(os.environ["BENCH_LAYERS"]),
        )


if __name__ == "__main__":
    _shape_from_env()
    _launch.main_or_worker(main, worker)
