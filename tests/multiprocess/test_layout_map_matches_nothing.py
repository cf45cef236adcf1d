"""A LayoutMap that shards nothing is said once (issue 48, item 2).

Keys are matched against whole variable paths (`re.fullmatch`):
`layout_map["up/kernel"]` matches nothing in a Sequential, whose kernel is
`sequential/up/kernel`, and the model trains fully replicated. `fit` (and
`evaluate`) then log one warning on rank 0: the keys that matched nothing,
a few real paths and the `.*` key that would match. With `.*up/kernel`,
nothing of the kind is said and the kernel is sharded.
"""

import logging

import keras
import numpy as np

from helpers import LogRecords


def _fit(prefix, outputs_only=False):
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2,), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    if outputs_only:  # as a sequence axis's keys: activations only
        layout_map[f"{prefix}up/output"] = ("model", None)
    else:
        layout_map[f"{prefix}up/kernel"] = (None, "model")
        layout_map[f"{prefix}down/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="model"
        )
    )
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, name="up"),
            keras.layers.Dense(2, name="down"),
        ]
    )
    model.compile("adam", "mse")
    x = np.ones((16, 8), "float32")
    records = LogRecords()
    logger = logging.getLogger("keras_torch_distribution")
    logger.addHandler(records)
    try:
        model.fit(x, x[:, :2], batch_size=8, epochs=2, verbose=0)
        model.evaluate(x, x[:, :2], batch_size=8, verbose=0)
    finally:
        logger.removeHandler(records)
        keras.distribution.set_distribution(None)
    kernel = model.get_layer("up").kernel.value
    return (
        [m for m in records.messages if "shards none" in m],
        type(kernel).__name__,
    )


def test_a_map_whose_keys_match_nothing_warns_once_with_the_fix(pool2):
    (said, kernel), (said_1, _) = pool2.run(_fit, "")
    assert said_1 == []  # rank 0 speaks for the job
    assert said == [
        "The LayoutMap of this ModelParallel shards none of the model's "
        "variables: every one is whole on every rank, with its gradient and "
        "optimizer slots. Its keys 'up/kernel', 'down/kernel' match no "
        "variable's path: a key must match the whole path (re.fullmatch), and "
        "the paths here are like 'sequential/up/kernel', "
        "'sequential/down/kernel', 'sequential/up/bias'. A key that starts "
        "with '.*' matches any start of a path: write "
        "layout_map['.*up/kernel'] instead of layout_map['up/kernel']."
    ], said
    assert kernel != "DTensor"


def test_a_map_that_shards_says_nothing_of_the_kind(pool2):
    (said, kernel), _ = pool2.run(_fit, ".*")
    assert said == []
    assert kernel in ("Parameter", "DTensor"), kernel


def test_a_map_of_output_keys_only_says_nothing_of_the_kind(pool2):
    """Output keys lay out activations (context parallelism's map has no
    other): no variable was meant to be sharded."""
    (said, kernel), _ = pool2.run(_fit, ".*", True)
    assert said == []
    assert kernel != "DTensor"
