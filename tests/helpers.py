"""Small helpers shared by the tests (models, data, comparisons)."""

import numpy as np


def data(rows=64, features=6, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = rng.normal(size=(rows, outputs)).astype("float32")
    return x, y


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in zip(a, b))
