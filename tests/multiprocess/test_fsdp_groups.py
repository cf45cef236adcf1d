"""FSDP by group (issue 18): one flat all-gather per group of variables
sharded on the batch axis, one flat reduce-scatter of their gradients,
gathers prefetched; on 2 gloo processes against one process on the global
batch, with the collectives each rank issues per training step counted.

The model has uneven FSDP dims (7 over 2 processes: padded in the flat
buffers as FSDP2 pads them), a kernel and a bias in one group, and
replicated variables (the norm, the last bias) beside them.
"""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from keras_torch_distribution import testing  # noqa: E402
from keras_torch_distribution.plan import _collective_counts  # noqa: E402

GLOBAL_BATCH, ROWS = 16, 64
TOL = dict(rtol=2e-5, atol=2e-5)
# On a 1-D ("model",) mesh the one axis is the batch axis: all FSDP.
RULES = {
    r".*up/kernel": (None, "model"),  # (8, 7): dim 1 uneven over 2
    r".*up/bias": ("model",),  # (7,): uneven
    r".*down/kernel": ("model", None),  # (7, 6): dim 0 uneven
}


def _model(metrics=None):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(7, activation="relu", name="up"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(6, name="down"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=metrics
    )
    return model


def _data():
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(ROWS, 8)).astype("float32"),
        rng.normal(size=(ROWS, 6)).astype("float32"),
    )


def _train(distributed, policy="block", prefetch="1", metrics=None):
    """fit 2 epochs; then one more step on this rank's rows, its
    collectives counted. One process when not `distributed`."""
    x, y = _data()
    with testing.environment(
        {"KTD_FSDP_GROUP": policy, "KTD_FSDP_PREFETCH": prefetch}
    ):
        if distributed:
            devices = keras.distribution.list_devices()
            mesh = keras.distribution.DeviceMesh((2,), ["model"], devices)
            layout_map = keras.distribution.LayoutMap(mesh)
            for pattern, axes in RULES.items():
                layout_map[pattern] = axes
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(layout_map=layout_map)
            )
        model = _model(metrics)
        history = model.fit(
            x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
        )
        result = dict(
            loss=history.history["loss"],
            mae=history.history.get("mae"),
            weights={v.path: np.asarray(v) for v in model.weights},
        )
        if distributed:
            rank = torch.distributed.get_rank()
            rows = slice(
                rank * GLOBAL_BATCH // 2, (rank + 1) * GLOBAL_BATCH // 2
            )
            model.make_train_function()
            batch = [(torch.as_tensor(x[rows]), torch.as_tensor(y[rows]))]
            model.train_function(batch)  # records the order of the groups
            with _collective_counts.counting() as counts:
                model.train_function(batch)
            result["counts"] = counts
        return result


_reference = {}


def _one_process(metrics=None):
    key = f"mlp-{metrics}"
    if key not in _reference:
        keras.backend.clear_session()
        _reference[key] = _train(False, metrics=metrics)
    return _reference[key]


def _assert_matches(result, reference):
    np.testing.assert_allclose(result["loss"], reference["loss"], **TOL)
    if reference["mae"] is not None:
        np.testing.assert_allclose(result["mae"], reference["mae"], **TOL)
    for path, value in reference["weights"].items():
        np.testing.assert_allclose(
            result["weights"][path], value, err_msg=path, **TOL
        )


# Per step, with groups up (kernel and bias in one flat buffer) and down:
# forward one gather per group; backward none (up's kernel is not needed
# for the gradient of an input that needs none, and down, the last group,
# keeps its gathered kernel for backward); one reduce-scatter per group;
# one all-reduce of the replicated gradients (norm, down's bias), which
# carries the metric states (`metric_states`: no all-reduce of their own).
# One gather and one reduce-scatter per variable (what
# FSDP did before groups) would be 4 gathers (down's kernel regathered)
# and 3 reduce-scatters.
EXPECTED = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}


@pytest.mark.parametrize(
    "policy, prefetch",
    [("block", "1"), ("block", "0"), ("layer", "2")],
    ids=["block-prefetch-1", "block-no-prefetch", "layer-prefetch-2"],
)
def test_grouped_gathers_give_one_process_numbers(pool2, policy, prefetch):
    results = pool2.run(_train, True, policy, prefetch)
    reference = _one_process()
    for result in results:
        _assert_matches(result, reference)
        assert result["counts"] == EXPECTED, result["counts"]


def test_metric_updated_after_the_optimizer_is_summed_on_its_own(pool2):
    """A compiled metric (mae) updates its states after the optimizer, so
    the states the gradient all-reduce carried are stale by the step's
    end: they are summed again in an all-reduce of their own, and loss and
    mae are one process's."""
    results = pool2.run(_train, True, "block", "0", ["mae"])
    reference = _one_process(["mae"])
    for result in results:
        _assert_matches(result, reference)
        assert result["counts"] == dict(EXPECTED, all_reduce=2), result[
            "counts"
        ]


def _tiny_llama(keras_hub, layers, **backbone_options):
    """A tiny keras_hub LlamaCausalLM (seed 0), compiled with Adam and sparse
    cross-entropy from logits."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64,
        num_layers=layers,
        num_query_heads=2,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        **backbone_options,
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def _count_one_step(layers):
    """keras_hub Llama with `layers` decoder blocks under its own layout
    map on a (2, 1) mesh: the collectives of one training step."""
    keras_hub = pytest.importorskip("keras_hub")
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"], devices)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )
    )
    model = _tiny_llama(keras_hub, layers)
    ids = np.random.default_rng(0).integers(1, 64, (4, 9))
    x = {
        "token_ids": torch.as_tensor(ids[:, :-1]),
        "padding_mask": torch.ones((4, 8), dtype=torch.bool),
    }
    y = torch.as_tensor(ids[:, 1:])
    model.make_train_function()
    model.train_function([(x, y)])  # builds Adam; records the group order
    model.train_function([(x, y)])
    with _collective_counts.counting() as counts:
        model.train_function([(x, y)])
    return counts


@pytest.mark.slow
def test_keras_hub_llama_issues_a_few_collectives_per_block(pool2):
    """Groups: the token embedding and each decoder block (the map leaves
    the norms and the output projection replicated). Forward: one gather
    per group. Backward: every block but the last (which keeps its gathered
    weights) is gathered again; the embedding lookup needs no weight in
    backward. One reduce-scatter per group; one all-reduce of the
    replicated gradients, which carries the metric states. (One collective
    per variable: 53 + 29 + 2 with 4 blocks; FSDP2 wrapping each block:
    9 + 5.)"""
    layers = 4
    expected = {
        "all_gather": (1 + layers) + (layers - 1),
        "reduce_scatter": 1 + layers,
        "all_reduce": 1,
    }
    for counts in pool2.run(_count_one_step, layers):
        assert counts == expected, counts


def _llama_output_projection_sharded(distributed, layers=2):
    """keras_hub Llama under its own map plus a key that shards
    `reverse_embeddings` on the batch axis (as benchmarks/scale.py does):
    the token embedding layer then gathers in its first call (the lookup)
    and its last (the output projection). fit 2 epochs of 2 steps; then,
    distributed, one more step on this rank's rows, its collectives
    counted."""
    keras_hub = pytest.importorskip("keras_hub")
    if distributed:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (2, 1), ["batch", "model"], devices
        )
        layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
        layout_map["token_embedding/reverse_embeddings"] = ("batch", "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
    model = _tiny_llama(keras_hub, layers, tie_word_embeddings=False)
    ids = np.random.default_rng(0).integers(1, 64, (8, 9))
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((8, 8), bool)}
    y = ids[:, 1:]
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    result = dict(
        loss=history.history["loss"],
        weights={v.path: np.asarray(v, "float32") for v in model.weights},
    )
    rows = slice(0, 2)
    if distributed:
        rank = torch.distributed.get_rank()
        rows = slice(rank * 2, rank * 2 + 2)
    batch = [
        (
            {k: torch.as_tensor(v[rows]) for k, v in x.items()},
            torch.as_tensor(y[rows]),
        )
    ]
    model.make_train_function()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _collective_counts.counting() as counts, _AtenOps() as ops:
            model.train_function(batch)
    result["counts"] = counts
    result["ops"] = ops.seen
    result["future_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, FutureWarning)
    ]
    return result


class _AtenOps(TorchDispatchMode):
    """The names of the aten ops run (forward and backward) in the block."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_a_layer_gathering_twice_per_forward_is_split(pool2):
    """The token embedding gathers in the lookup and in the output
    projection: after its first forward each call gathers only the
    matrix it reads (not the whole layer twice), and the numbers are one
    process's. Per step: the embeddings, each block and
    `reverse_embeddings` gathered in forward; in backward
    `reverse_embeddings` (a split layer is never kept) and every block; one
    reduce-scatter per block and per matrix; one all-reduce (the norms'
    gradients with the metric states). The last block is not kept for backward
    either: the output projection comes after it."""
    layers = 2
    keras.backend.clear_session()
    reference = _llama_output_projection_sharded(False, layers)
    results = pool2.run(
        _llama_output_projection_sharded, True, layers, timeout=600
    )
    for result in results:
        np.testing.assert_allclose(result["loss"], reference["loss"], **TOL)
        for path, value in reference["weights"].items():
            np.testing.assert_allclose(
                result["weights"][path], value, err_msg=path, **TOL
            )
        assert result["counts"] == {
            "all_gather": (1 + layers + 1) + (1 + layers),
            "reduce_scatter": layers + 2,
            "all_reduce": 1,
        }, result["counts"]
        # The lookup's gradient is made in the reduce-scatter's rank-major
        # order (lookup_gradients), never as autograd's dense gradient of
        # the (vocabulary, hidden) matrix, which one process makes.
        assert "embedding_dense_backward" not in result["ops"]
        assert "index_add_" in result["ops"]
        # torch 2.13 warns that all_gather_into_tensor and
        # reduce_scatter_tensor are deprecated; the package calls neither.
        assert result["future_warnings"] == [], result["future_warnings"]
    assert "embedding_dense_backward" in reference["ops"]
