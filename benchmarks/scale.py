"""A model no single process can hold: keras_hub Llama, FSDP on 4 processes.

    python benchmarks/scale.py [--quick] [--allocators default,mmap]
                               [--cases keras,torch] [--snapshot] [--marks]

Model: keras_hub `LlamaCausalLM` (vocabulary 32000, hidden 2048, 16 heads,
MLP 5632, 8 decoder blocks: 542 M parameters; training state, 16 bytes per
parameter for weights, gradients and Adam's m and v: 8.7 GB), float32, on a
(4, 1) ("batch", "model") mesh: `ModelParallel(batch_dim_name="batch")`
with keras_hub's own `LlamaBackbone.get_layout_map(mesh)`, plus the one key
it lacks, `token_embedding/reverse_embeddings` -> ("batch", "model") (the
map leaves that (2048, 32000) matrix whole on every rank: 0.12 of the
model; the package warns about it). Every weight but the norms is then
sharded 4 ways on the batch axis: FSDP.

Phases, each rank's peak resident memory above its baseline (RSS after
imports, process group start and the distribution set):
  build  -- the model built (born sharded) and compiled with Adam;
  fit    -- `fit` of 3 steps, global batch `--batch` x `--seq` tokens (one
            row per rank), Adam built in the first step;
  save   -- `keras_torch_distribution.checkpoint.save` (model + optimizer);
  load   -- the model deleted, a fresh one built and compiled,
            `checkpoint.load` into it (its optimizer built by load);
  resume -- 1 more `fit` step.
Raw FSDP2 on a torch model of the same shapes (`torch_llama`: embedding,
per block RMSNorm / q, k, v, o / RMSNorm / gate, up, down; final norm; an
untied LM head; `fully_shard` per decoder block and on the root, built on
the meta device and initialized shard by shard, `torch.optim.Adam`,
`torch.distributed.checkpoint` with `get_state_dict` / `set_state_dict`)
goes through the same phases.

Peaks: the larger of (a psutil thread sampling RSS every 2 ms) and (the
kernel's VmHWM, reset through /proc/self/clear_refs at each phase start),
minus the baseline. Each case runs under two allocator settings: glibc's
default (what users get: freed blocks below its dynamic mmap threshold stay
resident) and `MALLOC_MMAP_THRESHOLD_=1048576` (allocations >= 1 MiB are
their own mmaps, returned on free: RSS follows live tensors).

Where the memory is (`--snapshot`, also written to the JSON): at the end of
every phase, the live tensors found by the garbage collector, by kind
(model variables' local blocks, optimizer variables', gradients, others
with their largest shapes); within each fit step, the peak RSS between
markers (batch begin, forward done, backward done, optimizer done); and
the tensors autograd saved for backward in one training forward (those
kept, by shape, and the gathered weights replaced by regather tokens).
Each mark also has glibc's heap (`mallinfo2`: taken, in use, free;
mmapped). `--marks` adds marks before each FSDP group's regather and
around each gradient reduce-scatter (the package's internals, wrapped).

Targets (issue 18): every rank's peak <= 0.35 of the training state with
either allocator, within 10% of FSDP2's. Results:
benchmarks/results/scale.json (numbers in benchmarks/reports/).
"""

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
from fsdp import _reset_vm_hwm  # noqa: E402
from fsdp import _vm_hwm_bytes as _vm_hwm  # noqa: E402

CONFIGS = {
    "full": dict(
        vocab=32000,
        hidden=2048,
        heads=16,
        kv_heads=16,
        intermediate=5632,
        layers=8,
        seq=64,
        batch=4,
        steps=3,
    ),
    "quick": dict(
        vocab=4096,
        hidden=256,
        heads=4,
        kv_heads=4,
        intermediate=704,
        layers=2,
        seq=16,
        batch=4,
        steps=3,
    ),
}
ALLOCATORS = {
    "default": {},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
}
TARGET_OF_STATE = 0.35
TARGET_OF_FSDP2 = 1.10
PHASES = ("build", "fit", "save", "load", "resume")


def _config():
    return json.loads(os.environ["BENCH_CONFIG"])


def param_count(c):
    per_block = (
        c["hidden"] * c["heads"] * (c["hidden"] // c["heads"]) * 2  # q, o
        + c["hidden"] * c["kv_heads"] * (c["hidden"] // c["heads"]) * 2  # k, v
        + 3 * c["hidden"] * c["intermediate"]
        + 2 * c["hidden"]
    )
    return 2 * c["vocab"] * c["hidden"] + c["layers"] * per_block + c["hidden"]


# ---------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------


class Sampler:
    """RSS sampled on a thread: the peak of each phase and of each interval
    between `mark`s; the kernel's VmHWM is reset at each phase start."""

    def __init__(self, interval=0.002):
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.phase_peak = 0
        self.mark_peak = 0
        # (label, peak RSS since the previous mark, RSS now, _heap())
        self.marks = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self):
        return self._process.memory_info().rss

    def _run(self):
        limit = int(os.environ.get("BENCH_RSS_LIMIT", "0"))
        deadline = time.monotonic() + float(
            os.environ.get("BENCH_DEADLINE", "1e9")
        )
        while not self._stop.is_set():
            rss = self.rss()
            if (limit and rss > limit) or time.monotonic() > deadline:
                # torchrun starts ranks in sessions of their own, out of the
                # driver's reach on a timeout: a rank stops itself before it
                # takes the machine's memory (or time) from other work.
                sys.stderr.write(
                    f"scale.py: rank stopped itself: RSS {rss / 2**30:.2f} GiB "
                    f"(limit {limit / 2**30:.2f} GiB) or past its deadline\n"
                )
                sys.stderr.flush()
                os._exit(3)
            with self._lock:
                self.phase_peak = max(self.phase_peak, rss)
                self.mark_peak = max(self.mark_peak, rss)
            time.sleep(self._interval)

    def start_phase(self):
        _reset_vm_hwm()
        rss = self.rss()
        with self._lock:
            self.phase_peak = rss
            self.mark_peak = rss
        self.marks = []

    def end_phase(self):
        rss = self.rss()
        hwm = _vm_hwm()
        with self._lock:
            peak = max(self.phase_peak, rss)
        return max(peak, hwm or 0)

    def mark(self, label):
        rss = self.rss()
        with self._lock:
            peak = max(self.mark_peak, rss)
            self.mark_peak = rss
        self.marks.append((label, peak, rss, _heap()))

    def stop(self):
        self._stop.set()
        self._thread.join()


class Phases:
    """Runs the phases of one rank: each between barriers, its peak RSS
    above `baseline` and its seconds recorded; what was measured so far is
    written after each (`_write_partial`), with `more()`'s entries."""

    def __init__(self, sampler, case, rank, more=dict):
        import torch.distributed as dist

        self._barrier = dist.barrier
        self.sampler = sampler
        self.case, self.rank, self.more = case, rank, more
        gc.collect()
        self._barrier()
        self.baseline = sampler.rss()
        self.peaks, self.seconds, self.marks = {}, {}, {}

    def run(self, name, action):
        gc.collect()
        self._barrier()
        self.sampler.start_phase()
        started = time.perf_counter()
        result = action()
        self.seconds[name] = time.perf_counter() - started
        self.peaks[name] = self.sampler.end_phase() - self.baseline
        self.marks[name] = [
            (label, peak - self.baseline, rss - self.baseline, heap)
            for label, peak, rss, heap in self.sampler.marks
        ]
        _write_partial(
            dict(
                self.more(),
                case=self.case,
                rank=self.rank,
                peak_above_baseline=self.peaks,
                seconds=self.seconds,
            )
        )
        return result


def _storage_key(tensor):
    try:
        return (
            tensor.untyped_storage().data_ptr(),
            tensor.untyped_storage().nbytes(),
        )
    except (RuntimeError, NotImplementedError):
        return id(tensor), 0


def live_tensors(named):
    """The live tensors the garbage collector finds, by kind: `named` maps
    storage keys to a kind ("model", "optimizer", "grad"); the rest is
    "other", with its 8 largest storages. Storages counted once."""
    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
        except ReferenceError:
            continue
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        if local.layout != torch.strided:
            continue
        key = _storage_key(local)
        if key[1] and key not in seen:
            seen[key] = tuple(local.shape)
    kinds = {}
    others = []
    for key, shape in seen.items():
        kind = named.get(key, "other")
        kinds[kind] = kinds.get(kind, 0) + key[1]
        if kind == "other":
            others.append((key[1], shape))
    others.sort(reverse=True)
    return {
        "bytes_by_kind": kinds,
        "largest_other": [
            {"bytes": n, "shape": list(s)} for n, s in others[:8]
        ],
    }


def _named_storages(model_tensors, optimizer_tensors, grads):
    from torch.distributed.tensor import DTensor

    named = {}
    for kind, items in (
        ("model", model_tensors),
        ("optimizer", optimizer_tensors),
        ("grad", grads),
    ):
        for t in items:
            if t is None:
                continue
            local = t._local_tensor if isinstance(t, DTensor) else t
            named[_storage_key(local)] = kind
    return named


class SavedForBackward:
    """What autograd saves in a training forward (snapshot mode): through
    the package's regathering hooks when they run (kept tensors and regather
    tokens), by storage."""

    def __init__(self):
        self.kept = {}
        self.tokens = 0
        self.token_bytes = 0

    def install(self):
        from keras_torch_distribution._fsdp import gathering

        regatherer = getattr(gathering, "_Regatherer", None)
        if regatherer is None or not hasattr(regatherer, "pack"):
            return False
        original = regatherer.pack
        recorder = self

        def pack(self, tensor):
            packed = original(self, tensor)
            recorder.record(tensor, packed)
            return packed

        regatherer.pack = pack
        return True

    def record(self, tensor, packed):
        import torch
        from torch.distributed.tensor import DTensor

        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if packed is not tensor:
            self.tokens += 1
            self.token_bytes += local.numel() * local.element_size()
            return
        if local.layout != torch.strided:
            return
        key = _storage_key(local)
        self.kept[key] = tuple(local.shape)

    def summary(self):
        items = sorted(((k[1], s) for k, s in self.kept.items()), reverse=True)
        return {
            "kept_bytes": sum(n for n, _ in items),
            "kept_tensors": len(items),
            "kept_largest": [
                {"bytes": n, "shape": list(s)} for n, s in items[:12]
            ],
            "regather_tokens": self.tokens,
            "regather_token_view_bytes": self.token_bytes,
        }


# ---------------------------------------------------------------------------
# Keras.
# ---------------------------------------------------------------------------


def _llama(keras, keras_hub, c):
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=c["vocab"],
        num_layers=c["layers"],
        num_query_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        hidden_dim=c["hidden"],
        intermediate_dim=c["intermediate"],
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def _data(c, steps):
    import numpy as np

    ids = np.random.default_rng(0).integers(
        1, c["vocab"], (c["batch"] * steps, c["seq"] + 1)
    )
    x = {
        "token_ids": ids[:, :-1].astype("int32"),
        "padding_mask": np.ones((len(ids), c["seq"]), "int32"),
    }
    return x, ids[:, 1:].astype("int32")


def _write_partial(result):
    """What a rank measured so far (BENCH_PARTIAL/rank<r>.json), for a
    launch stopped before its end."""
    directory = os.environ.get("BENCH_PARTIAL")
    if directory:
        with open(
            os.path.join(directory, f"rank{result['rank']}.json"), "w"
        ) as f:
            json.dump(result, f)


def _heap():
    """glibc's mallinfo2, in bytes: `heap` (taken from the system by
    every arena, not mmapped), `heap_in_use`, `heap_free` (resident or
    not) and `mmapped` (blocks of their own); {} elsewhere."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return dict(
        heap=info.arena,
        heap_in_use=info.uordblks,
        heap_free=info.fordblks,
        mmapped=info.hblkhd,
    )


def _mark_groups(sampler):
    """Diagnostics: a mark before each FSDP group's regather and after
    each reduce-scatter of its gradients."""
    from keras_torch_distribution._fsdp import group_calls
    from keras_torch_distribution._fsdp import lookup_gradients

    def wrap_backward(cls, label):
        original = cls.backward

        def backward(ctx, *grads):
            sampler.mark(f"{label} backward start")
            result = original(ctx, *grads)
            sampler.mark(f"{label} reduce-scattered")
            return result

        cls.backward = staticmethod(backward)

    wrap_backward(group_calls._GroupGather, "group")
    wrap_backward(lookup_gradients._RankMajorLookup, "lookup")
    regathered = group_calls._BucketSource.regathered

    def marked(self, key):
        if self.tensors is None:
            sampler.mark("before regather")
        return regathered(self, key)

    group_calls._BucketSource.regathered = marked


def _malloc_trim():
    """glibc's malloc_trim(0): return the free pages of every arena."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def keras_worker():
    import keras
    import keras_hub
    import torch
    import torch.distributed as dist

    import keras_torch_distribution  # noqa: F401
    from keras_torch_distribution import checkpoint

    torch.set_num_threads(1)
    c = _config()
    snapshot = bool(os.environ.get("BENCH_SNAPSHOT"))
    keras.distribution.initialize()
    rank, world = dist.get_rank(), dist.get_world_size()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (world, 1), ["batch", "model"], devices
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    if os.environ.get("BENCH_SHARD_REVERSE", "1") == "1":
        # The key keras_hub's map lacks (the package's warning names it).
        layout_map["token_embedding/reverse_embeddings"] = ("batch", "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    keras.utils.set_random_seed(0)
    x, y = _data(c, c["steps"])
    x1, y1 = _data(c, 1)
    path = os.environ["BENCH_CHECKPOINT"]
    saved = SavedForBackward() if snapshot else None
    if saved is not None:
        saved.install()

    sampler = Sampler()
    if os.environ.get("BENCH_MARK_GROUPS"):
        _mark_groups(sampler)
    census, losses = {}, {}
    phases = Phases(
        sampler,
        "keras",
        rank,
        more=lambda: dict(
            marks=phases.marks,
            census=census,
            saved_for_backward=saved.summary() if saved is not None else None,
        ),
    )
    phase, baseline = phases.run, phases.baseline

    def named(model):
        optimizer = model.optimizer
        opt_vars = (
            [v.value for v in optimizer.variables] if optimizer.built else []
        )
        return _named_storages(
            [v.value for v in model.variables],
            opt_vars,
            [getattr(v.value, "grad", None) for v in model.trainable_variables],
        )

    trim = _malloc_trim if os.environ.get("BENCH_TRIM") else (lambda: None)

    class Marks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            sampler.mark(f"before step {batch}")

        def on_train_batch_end(self, batch, logs=None):
            trim()
            sampler.mark(f"step {batch}: optimizer done, to batch end")

    def instrument(model):
        compute_loss = model.compute_loss

        def marked_loss(*args, **kwargs):
            sampler.mark("forward")
            return compute_loss(*args, **kwargs)

        model.compute_loss = marked_loss
        original_apply = model.optimizer.apply

        def marked_apply(*args, **kwargs):
            sampler.mark("loss + backward")
            result = original_apply(*args, **kwargs)
            sampler.mark("optimizer apply")
            return result

        model.optimizer.apply = marked_apply

    model = phase("build", lambda: _llama(keras, keras_hub, c))
    census["build"] = live_tensors(named(model))
    instrument(model)
    # (Keras' History callback refers to the model: keep only its numbers.)
    losses["fit"] = phase(
        "fit",
        lambda: model.fit(
            x,
            y,
            batch_size=c["batch"],
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[Marks()],
        ).history["loss"],
    )
    census["fit"] = live_tensors(named(model))
    phase(
        "save", lambda: checkpoint.save(model, path, extra={"step": c["steps"]})
    )
    census["save"] = live_tensors(named(model))
    local_state = _keras_state_bytes(model)
    full_params = sum(int(v.value.numel()) for v in model.trainable_variables)

    def fresh_and_load():
        nonlocal model
        first = weakref.ref(model)
        del model
        gc.collect()
        if first() is not None:
            raise RuntimeError(
                "the first model is still referenced after `del`: "
                + ", ".join(type(r).__name__ for r in gc.get_referrers(first()))
            )
        marks_before = sampler.rss() - baseline
        keras.utils.set_random_seed(1)
        new = _llama(keras, keras_hub, c)
        instrument(new)
        extra = checkpoint.load(new, path)
        return new, extra, marks_before

    model, extra, after_delete = phase("load", fresh_and_load)
    census["load"] = live_tensors(named(model))
    losses["resume"] = phase(
        "resume",
        lambda: model.fit(
            x1,
            y1,
            batch_size=c["batch"],
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[Marks()],
        ).history["loss"],
    )
    census["resume"] = live_tensors(named(model))
    sampler.stop()
    import importlib

    report = importlib.import_module("keras_torch_distribution._report")
    whole = [
        {
            "path": row["path"],
            "shape": list(row["shape"]),
            "bytes": row["bytes"],
        }
        for row in report.shard_table(model)
        if row["kind"] == "param" and row["layout"] == "replicated"
    ]
    result = dict(
        case="keras",
        rank=rank,
        world=world,
        baseline_rss_bytes=baseline,
        peak_above_baseline=phases.peaks,
        seconds=phases.seconds,
        marks=phases.marks,
        census=census,
        rss_after_deleting_first_model=after_delete,
        losses=losses,
        extra_loaded=extra,
        params=full_params,
        local_state_bytes=local_state,
        replicated_params=whole,
        keras=keras.__version__,
        saved_for_backward=saved.summary() if saved is not None else None,
    )
    _launch.write_rank_result(result)
    dist.barrier()
    dist.destroy_process_group()


def _keras_state_bytes(model):
    from keras_torch_distribution._variables import born_sharded

    weights = sum(
        born_sharded.local_bytes(v) for v in model.trainable_variables
    )
    optimizer = sum(
        born_sharded.local_bytes(v) for v in model.optimizer.variables
    )
    return {"weights": weights, "optimizer": optimizer}


# ---------------------------------------------------------------------------
# Raw torch FSDP2.
# ---------------------------------------------------------------------------


def torch_llama(c):
    """A torch Llama of the keras_hub model's shapes (untied LM head)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    head_dim = c["hidden"] // c["heads"]

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return x * self.scale

    def rope(x):
        # x: (batch, heads, seq, head_dim)
        seq, dim = x.shape[-2], x.shape[-1]
        inv = 1.0 / (
            10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        )
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
        half = dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            h, i = c["hidden"], c["intermediate"]
            self.attention_norm = RMSNorm(h)
            self.q = nn.Linear(h, c["heads"] * head_dim, bias=False)
            self.k = nn.Linear(h, c["kv_heads"] * head_dim, bias=False)
            self.v = nn.Linear(h, c["kv_heads"] * head_dim, bias=False)
            self.o = nn.Linear(c["heads"] * head_dim, h, bias=False)
            self.mlp_norm = RMSNorm(h)
            self.gate = nn.Linear(h, i, bias=False)
            self.up = nn.Linear(h, i, bias=False)
            self.down = nn.Linear(i, h, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            y = self.attention_norm(x)
            q = self.q(y).view(b, s, c["heads"], head_dim).transpose(1, 2)
            k = self.k(y).view(b, s, c["kv_heads"], head_dim).transpose(1, 2)
            v = self.v(y).view(b, s, c["kv_heads"], head_dim).transpose(1, 2)
            attention = F.scaled_dot_product_attention(
                rope(q),
                rope(k),
                v,
                is_causal=True,
                enable_gqa=c["kv_heads"] != c["heads"],
            )
            x = x + self.o(attention.transpose(1, 2).reshape(b, s, -1))
            y = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(c["vocab"], c["hidden"])
            self.layers = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.norm = RMSNorm(c["hidden"])
            self.head = nn.Linear(c["hidden"], c["vocab"], bias=False)

        def forward(self, ids):
            x = self.embedding(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return Llama()


def torch_worker():
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    c = _config()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    path = os.environ["BENCH_CHECKPOINT"]
    x_all, y_all = _data(c, c["steps"])
    per = c["batch"] // world

    def rows(step):
        lo = step * c["batch"] + rank * per
        return (
            torch.as_tensor(x_all["token_ids"][lo : lo + per]).long(),
            torch.as_tensor(y_all[lo : lo + per]).long(),
        )

    def build(seed):
        with torch.device("meta"):
            model = torch_llama(c)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(seed * 100 + rank)
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = p.to_local()
                if name.endswith("scale"):
                    local.fill_(1.0)
                else:
                    local.normal_(0.0, 0.02, generator=generator)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        return model, optimizer

    def step(model, optimizer, index):
        ids, labels = rows(index)
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids)
        loss = F.cross_entropy(
            logits.reshape(-1, c["vocab"]), labels.reshape(-1)
        )
        loss.backward()
        optimizer.step()
        return float(loss)

    sampler = Sampler()
    phases = Phases(sampler, "torch", rank)
    phase, baseline = phases.run, phases.baseline

    model, optimizer = phase("build", lambda: build(0))
    losses = {
        "fit": phase(
            "fit",
            lambda: [step(model, optimizer, i) for i in range(c["steps"])],
        )
    }

    def save():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    phase("save", save)
    state = sum(p.to_local().numel() * 4 for p in model.parameters())
    state_optimizer = sum(
        t.to_local().numel() * t.element_size()
        if hasattr(t, "to_local")
        else t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    params = sum(p.numel() for p in model.parameters())

    def fresh_and_load():
        nonlocal model, optimizer
        del model, optimizer
        gc.collect()
        new, new_optimizer = build(1)
        model_sd, optim_sd = get_state_dict(new, new_optimizer)
        state_dict = {"model": model_sd, "optim": optim_sd}
        dcp.load(state_dict, checkpoint_id=path)
        set_state_dict(
            new,
            new_optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        return new, new_optimizer

    model, optimizer = phase("load", fresh_and_load)
    losses["resume"] = phase("resume", lambda: [step(model, optimizer, 0)])
    sampler.stop()
    _launch.write_rank_result(
        dict(
            case="torch",
            rank=rank,
            world=world,
            baseline_rss_bytes=baseline,
            peak_above_baseline=phases.peaks,
            seconds=phases.seconds,
            losses=losses,
            params=params,
            local_state_bytes={"weights": state, "optimizer": state_optimizer},
        )
    )
    dist.barrier()
    dist.destroy_process_group()


def worker(case):
    if case == "keras":
        keras_worker()
    else:
        torch_worker()


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny Llama (smoke test, seconds)",
    )
    parser.add_argument(
        "--allocators",
        default="default,mmap",
        help="comma-separated subset of " + ",".join(ALLOCATORS),
    )
    parser.add_argument("--cases", default="keras,torch")
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="also record the tensors autograd saves for backward",
    )
    parser.add_argument(
        "--keep-reverse-embeddings-whole",
        action="store_true",
        help="keras_hub's map as it is (reverse_embeddings replicated)",
    )
    parser.add_argument(
        "--trim",
        action="store_true",
        help="experiment: glibc malloc_trim(0) after every Keras step",
    )
    parser.add_argument(
        "--marks",
        action="store_true",
        help="diagnostics: mark each FSDP group's regather and "
        "gradient reduce-scatter in the fit phases' marks",
    )
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument(
        "--rss-limit-gib",
        type=float,
        default=3.4,
        help="a rank whose RSS exceeds this stops itself "
        "(4 ranks share the machine with other work)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=N",
        help="override a model/run setting, e.g. --set layers=4",
    )
    parser.add_argument("--out", default="scale", help="results/<out>.json")
    args = parser.parse_args()
    c = dict(CONFIGS["quick" if args.quick else "full"])
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in c:
            parser.error(
                f"--set {item!r}: unknown key {key!r}; choose from {sorted(c)}"
            )
        c[key] = int(value)
    params = param_count(c)
    state = 16 * params
    print(
        f"scale: keras_hub Llama {params / 1e6:.1f} M parameters, training "
        f"state {state / 1e9:.2f} GB, 4 processes, seq {c['seq']} x batch "
        f"{c['batch']}",
        flush=True,
    )
    runs, errors, payload_partial = {}, {}, {}
    directory = tempfile.mkdtemp(prefix="ktd-scale-")
    started = time.monotonic()
    try:
        for allocator in args.allocators.split(","):
            for case in args.cases.split(","):
                env = dict(
                    ALLOCATORS[allocator],
                    BENCH_CONFIG=json.dumps(c),
                    BENCH_RSS_LIMIT=str(int(args.rss_limit_gib * 2**30)),
                    BENCH_DEADLINE=str(args.timeout),
                    BENCH_CHECKPOINT=os.path.join(directory, f"{case}-ckpt"),
                    BENCH_SHARD_REVERSE="0"
                    if args.keep_reverse_embeddings_whole
                    else "1",
                )
                if args.snapshot:
                    env["BENCH_SNAPSHOT"] = "1"
                if args.trim:
                    env["BENCH_TRIM"] = "1"
                if args.marks:
                    env["BENCH_MARK_GROUPS"] = "1"
                partial = os.path.join(directory, f"{case}-{allocator}-partial")
                os.makedirs(partial)
                env["BENCH_PARTIAL"] = partial
                try:
                    runs.setdefault(allocator, {})[case] = _launch.launch(
                        os.path.abspath(__file__),
                        case,
                        4,
                        timeout=args.timeout,
                        extra_env=env,
                    )
                except RuntimeError as error:
                    errors[f"{case} {allocator}"] = str(error)[-3000:]
                    found = {}
                    for name in sorted(os.listdir(partial)):
                        with open(os.path.join(partial, name)) as f:
                            found[name] = json.load(f)
                    payload_partial.setdefault(allocator, {})[case] = found
                    for name, r in found.items():
                        print(
                            f"  partial {case} {allocator} {name}: "
                            + ", ".join(
                                f"{p} {v / state:.3f}"
                                for p, v in r["peak_above_baseline"].items()
                            ),
                            flush=True,
                        )
                    print(
                        f"  {case} {allocator} FAILED: {str(error)[-1500:]}",
                        flush=True,
                    )
                shutil.rmtree(
                    os.path.join(directory, f"{case}-ckpt"), ignore_errors=True
                )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    wall = time.monotonic() - started

    def per_rank(allocator, case):
        ranks = runs.get(allocator, {}).get(case)
        if not ranks:
            return None
        return {p: [r["peak_above_baseline"][p] for r in ranks] for p in PHASES}

    payload = {
        "benchmark": "scale",
        "machine": _launch.machine(),
        "config": c,
        "params": params,
        "training_state_bytes": state,
        "allocators": {
            k: v
            for k, v in ALLOCATORS.items()
            if k in args.allocators.split(",")
        },
        "reverse_embeddings_sharded": not args.keep_reverse_embeddings_whole,
        "targets": {
            "peak_of_training_state": TARGET_OF_STATE,
            "peak_over_fsdp2": TARGET_OF_FSDP2,
        },
        "wall_seconds": round(wall, 1),
        "overrides": args.set,
        "errors": errors,
        "partial_results_of_failed_launches": payload_partial,
    }
    first = next((a for a in ("default", "mmap") if a in runs), None)
    payload["peak_rss_bytes_per_rank"] = (
        per_rank(first, "keras") if first else None
    )
    payload["fsdp2_peak_rss_bytes_per_rank"] = (
        per_rank(first, "torch") if first else None
    )
    payload["by_allocator"] = {}
    print(
        f"\npeak RSS above baseline per rank, share of the training state "
        f"({state / 2**30:.2f} GiB); target <= {TARGET_OF_STATE}:"
    )
    for allocator in runs:
        entry = {}
        for case in runs[allocator]:
            figures = per_rank(allocator, case)
            entry[case] = {
                "peak_rss_bytes_per_rank": figures,
                "worst_share_of_state": {
                    p: round(max(v) / state, 3) for p, v in figures.items()
                },
            }
            for p in PHASES:
                print(
                    f"  {allocator:8} {case:6} {p:7} "
                    + " ".join(f"{v / state:6.3f}" for v in figures[p])
                    + f"   ({max(figures[p]) / 2**30:.2f} GiB worst)"
                )
        if "keras" in entry and "torch" in entry:
            k_worst = max(
                max(v)
                for v in entry["keras"]["peak_rss_bytes_per_rank"].values()
            )
            t_worst = max(
                max(v)
                for v in entry["torch"]["peak_rss_bytes_per_rank"].values()
            )
            entry["keras_over_fsdp2_worst_peak"] = round(k_worst / t_worst, 3)
            print(
                f"  {allocator:8} keras / FSDP2 worst peak: "
                f"{k_worst / t_worst:.3f} (target <= {TARGET_OF_FSDP2})"
            )
        payload["by_allocator"][allocator] = entry
    payload["ranks"] = runs
    print(f"whole run: {wall:.0f} s")
    _launch.save(args.out, payload)


if __name__ == "__main__":
    _launch.main_or_worker(main, worker)
