"""FSDP under mixed_bfloat16: one policy on both paths, as FSDP2's
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (GPU audit
M3): parameters are all-gathered in bfloat16 (half the bytes of float32),
gradients reduce-scattered in float32, on the grouped flat path
(`_fsdp.groups`) and on the per-variable DTensor path (`_fsdp.gathering`:
variables outside a group, everything under jit_compile). On 2 gloo processes
against one process on the global batch, with the dtype and bytes of every
collective of one training step recorded.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from keras_torch_distribution import testing  # noqa: E402
from keras_torch_distribution.plan import _collective_counts  # noqa: E402

pytestmark = pytest.mark.slow

GLOBAL_BATCH, ROWS = 16, 64
# bfloat16 compute on 8 rows per process against 16 in one: the per-process
# products round differently (about 2**-8 relative), float32 sums after.
TOL = dict(rtol=3e-2, atol=3e-2)
RULES = {  # on a 1-D ("model",) mesh the one axis is the batch axis: FSDP
    r".*up/kernel": (None, "model"),  # (8, 7): uneven over 2
    r".*up/bias": ("model",),
    r".*down/kernel": ("model", None),  # (7, 6)
}


class _Collectives(_collective_counts._Counter):
    """Counts as _collective_counts does, and records (kind, dtype, bytes)
    of the tensors each collective carries."""

    def __init__(self):
        super().__init__({})
        self.carried = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            not isinstance(func, torch._ops.HigherOrderOperator)
            and not any(t is torch.distributed.tensor.DTensor for t in types)
            and func.namespace in _collective_counts._NAMESPACES
        ):
            name = func._overloadpacket._qualified_op_name.split("::")[-1]
            kind = _collective_counts._KIND_OF.get(name)
            if kind in ("all_gather", "reduce_scatter"):
                leaves = [
                    t
                    for t in torch.utils._pytree.tree_leaves(args)
                    if isinstance(t, torch.Tensor)
                ]
                # The input: the last tensor argument of c10d's ops (output
                # first), the first of the functional ones (no output).
                carried = leaves[-1] if func.namespace == "c10d" else leaves[0]
                if isinstance(carried, list):
                    carried = carried[0]
                self.carried.append(
                    (
                        kind,
                        str(carried.dtype),
                        carried.numel() * carried.element_size(),
                    )
                )
        return super().__torch_dispatch__(func, types, args, kwargs)


def _model(jit_compile=False):
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
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        jit_compile=jit_compile,
    )
    return model


def _data():
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(ROWS, 8)).astype("float32"),
        rng.normal(size=(ROWS, 6)).astype("float32"),
    )


def _train(distributed, path="groups"):
    """fit 2 epochs under mixed_bfloat16; then one more step on this rank's
    rows with its collectives recorded. `path`: "groups" (flat gathers),
    "variables" (no group: the per-variable gathers) or "compiled"
    (jit_compile=True: the per-variable gathers, traced by torch.compile;
    its collectives are not recorded)."""
    from keras_torch_distribution._fsdp import groups
    from keras_torch_distribution._training import compiled

    x, y = _data()
    saved_policy = keras.config.dtype_policy()
    saved_spec_for = groups.spec_for
    keras.config.set_dtype_policy("mixed_bfloat16")
    if path == "variables":
        groups.spec_for = lambda layer, policy: None
    try:
        with testing.environment({"KTD_FSDP_PREFETCH": "1"}):
            if distributed:
                devices = keras.distribution.list_devices()
                mesh = keras.distribution.DeviceMesh((2,), ["model"], devices)
                layout_map = keras.distribution.LayoutMap(mesh)
                for pattern, axes in RULES.items():
                    layout_map[pattern] = axes
                keras.distribution.set_distribution(
                    keras.distribution.ModelParallel(layout_map=layout_map)
                )
            model = _model(jit_compile=path == "compiled")
            history = model.fit(
                x,
                y,
                batch_size=GLOBAL_BATCH,
                epochs=2,
                shuffle=False,
                verbose=0,
            )
            result = dict(
                loss=history.history["loss"],
                weights={v.path: np.asarray(v) for v in model.weights},
                dtypes={v.path: str(v.dtype) for v in model.weights},
            )
            if path == "compiled":
                forwards = compiled.compiled_forwards._by_model
                result["fallback"] = (
                    repr(forwards[model].error)
                    if model in forwards
                    else "the forward was never compiled"
                )
            elif distributed:
                rank = torch.distributed.get_rank()
                rows = slice(
                    rank * GLOBAL_BATCH // 2, (rank + 1) * GLOBAL_BATCH // 2
                )
                batch = [(torch.as_tensor(x[rows]), torch.as_tensor(y[rows]))]
                with _Collectives() as recorded:
                    model.train_function(batch)
                result["carried"] = recorded.carried
            return result
    finally:
        keras.config.set_dtype_policy(saved_policy)
        groups.spec_for = saved_spec_for


_reference = []


def _one_process():
    if not _reference:
        keras.backend.clear_session()
        _reference.append(_train(False))
    return _reference[0]


@pytest.mark.parametrize("path", ["groups", "variables"])
def test_gathers_in_bfloat16_and_reduces_in_float32(pool2, path):
    reference = _one_process()
    results = pool2.run(_train, True, path)
    for result in results:
        assert set(result["dtypes"].values()) == {
            "float32"
        }  # stored in float32
        np.testing.assert_allclose(result["loss"], reference["loss"], **TOL)
        for name, value in reference["weights"].items():
            np.testing.assert_allclose(
                result["weights"][name], value, err_msg=name, **TOL
            )
        kinds = {(kind, dtype) for kind, dtype, _ in result["carried"]}
        assert kinds == {
            ("all_gather", "torch.bfloat16"),
            ("reduce_scatter", "torch.float32"),
        }, result["carried"]
    if path == "groups":
        # One flat gather per group, each rank's shards in bfloat16 (up: its
        # 8 x 4 kernel block and 4 of the bias, padded; down: 4 x 6): half
        # the bytes of float32. One flat reduce-scatter per group in float32
        # (each rank's piece of the padded gradients).
        shard_elements = 8 * 4 + 4 + 4 * 6
        assert [
            n for kind, _, n in results[0]["carried"] if kind == "all_gather"
        ] == [2 * (8 * 4 + 4), 2 * 4 * 6]
        assert sum(
            n
            for kind, _, n in results[0]["carried"]
            if kind == "reduce_scatter"
        ) == (4 * shard_elements)


def test_compiled_forward_gives_one_process_numbers(pool2):
    """Under jit_compile the per-variable gather (bfloat16 gather, float32
    reduce-scatter: an autograd Function) is traced by torch.compile: no
    fallback to eager, the numbers of one process."""
    reference = _one_process()
    for result in pool2.run(_train, True, "compiled"):
        assert result["fallback"] == "None"
        np.testing.assert_allclose(result["loss"], reference["loss"], **TOL)
        for name, value in reference["weights"].items():
            np.testing.assert_allclose(
                result["weights"][name], value, err_msg=name, **TOL
            )
