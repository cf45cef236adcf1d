"""A training step of a keras_hub Llama makes no host sync, under no
distribution, DataParallel, tensor parallel, FSDP and a 2-D mesh, eager
and with `jit_compile=True` (repeated blocks compiled once), and the
compiled step gives the eager step's numbers with one graph per block
class.

Counted on the CPU with a `TorchDispatchMode` (`testing.count_ops`): the
ops that would make the host wait for a GPU (a device value read on the
host, host data copied to the device) in one `fit` step after two, its
batch-end callbacks included. The counts are exact and the same on every
machine. Under tensor parallelism torch's own DTensor code reads one
thing on the host that a GPU run keeps there (see `TORCH_HOST_SITES`): it
is allowed, by where it is issued, and nothing else is (torch's zeroing
of a vocabulary-sharded lookup's other rows, a boolean `index_put_` that
syncs on a GPU, is replaced: `_distributed/masked_lookup.py`).
"""

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 8
ROWS = 3 * GLOBAL_BATCH  # three steps per epoch: the third is counted
COUNTED_BATCH = 2

# Reads of host data inside torch's DTensor code, which on a GPU run stay
# on the host: `_StridedShard` offsets come from a CPU `torch.arange`
# (`.tolist()`).
TORCH_HOST_SITES = ("torch/distributed/tensor/placement_types.py",)


def _llama(heads, kv_heads, jit_compile):
    import keras

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_dim=16,
        intermediate_dim=32,
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=jit_compile,
    )
    return model


def _data():
    ids = np.random.default_rng(0).integers(1, VOCAB, (ROWS, SEQ + 1))
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((ROWS, SEQ), bool)}
    return x, ids[:, 1:]


def _set_distribution(kind):
    import keras

    devices = keras.distribution.list_devices()
    if kind == "none":
        keras.distribution.set_distribution(None)
        return
    if kind == "data":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
        return
    n = len(devices)
    shape = {"model": (1, n), "fsdp": (n, 1), "2d": (2, n // 2)}[kind]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )


def counted_fit(kind, jit_compile=False, heads=4, kv_heads=2):
    """One fit of 2 epochs: the syncs of its third step (by where they were
    issued), its losses and weights, and torch's compile counters."""
    import keras
    import torch
    from torch._dynamo.utils import counters

    from keras_torch_distribution import testing

    torch._dynamo.reset()
    counters.clear()
    _set_distribution(kind)
    model = _llama(heads, kv_heads, jit_compile)
    counted = {}

    class CountThirdStep(keras.callbacks.Callback):
        reads_batch_logs = False

        def on_train_batch_begin(self, batch, logs=None):
            if batch == COUNTED_BATCH and "counts" not in counted:
                self.block = testing.count_ops()
                counted["counts"] = self.block.__enter__()

        def on_train_batch_end(self, batch, logs=None):
            if batch == COUNTED_BATCH and not counted.get("done"):
                self.block.__exit__(None, None, None)
                counted["done"] = True

    x, y = _data()
    history = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[CountThirdStep()],
    )
    keras.distribution.set_distribution(None)
    counts = counted["counts"]
    return dict(
        sources=dict(counts.sync_sources),
        kernels=counts.kernels,
        loss=history.history["loss"],
        weights={v.path: np.asarray(v, "float32") for v in model.weights},
        graphs=counters["stats"].get("unique_graphs", 0),
        breaks=sum(counters["graph_break"].values()),
    )


def _device_syncs(result):
    return {
        (op, site): n
        for (op, site), n in result["sources"].items()
        if not site.startswith(TORCH_HOST_SITES)
    }


_references = {}


def _reference(heads=4, kv_heads=2):
    key = (heads, kv_heads)
    if key not in _references:
        _references[key] = counted_fit("none", heads=heads, kv_heads=kv_heads)
    return _references[key]


def _same_training(result, reference):
    np.testing.assert_allclose(result["loss"], reference["loss"], rtol=1e-5)
    for path, value in reference["weights"].items():
        np.testing.assert_allclose(
            result["weights"][path], value, rtol=1e-4, atol=2e-6, err_msg=path
        )


def test_one_process_step_makes_no_host_sync():
    result = _reference()
    assert result["sources"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["data", "model", "fsdp"])
def test_distributed_step_makes_no_host_sync(pool2, kind):
    results = pool2.run(counted_fit, kind)
    for result in results:
        assert _device_syncs(result) == {}
        _same_training(result, _reference())


@pytest.mark.slow
def test_2d_step_makes_no_host_sync(pool4):
    results = pool4.run(counted_fit, "2d", False, 4, 4)
    for result in results:
        assert _device_syncs(result) == {}


def test_compiled_blocks_give_eager_numbers_in_one_graph_without_syncs():
    result = counted_fit("none", jit_compile=True)
    _same_training(result, _reference())
    assert result["sources"] == {}
    # The two decoder blocks share one graph (forward and backward), the
    # optimizer update has its own; the training flag of evaluation would
    # add one more. No graph breaks.
    assert result["graphs"] == 2, result["graphs"]
    assert result["breaks"] == 0


@pytest.mark.slow
def test_compiled_data_parallel_gives_eager_numbers(pool2):
    results = pool2.run(counted_fit, "data", True)
    for result in results:
        _same_training(result, _reference())
        assert _device_syncs(result) == {}
        assert result["breaks"] == 0
