"""Ranks agree before they train: one small all-gather names what differs.

At the start of `fit` / `evaluate` / `predict` under a distribution on
several processes, every rank describes what must match -- the call, its
arguments, the input's rows, the distribution and mesh, and every
variable's path, shape, dtype and layout -- and the ranks compare a digest
of it (`agreement.compare`: one all-gather of a few bytes). When they
differ, every rank raises the same error naming the first difference and
the ranks on each side. Under per-process inputs, a warning when every
replica passes the same rows.
"""

import hashlib

import keras
import numpy as np
import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import agreement
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._variables import copies

# Rows of an input sampled (evenly spaced) for its digest: enough to tell
# one process's part of a dataset from another's, cheap for any size.
_SAMPLED_ROWS = 64


def _rows(value):
    """Rows of an array-like input (its first leaf), else a type name."""
    if value is None:
        return None
    leaves = [t for t in keras.tree.flatten(value) if t is not None]
    if leaves and hasattr(leaves[0], "shape") and len(leaves[0].shape):
        return int(leaves[0].shape[0])
    return type(value).__name__


def describe(method, model, args, kwargs):
    """What must be the same on every rank, as (name, text) pairs."""
    distribution = _keras.current_distribution()
    x = args[0] if args else kwargs.get("x")
    y = args[1] if len(args) > 1 else kwargs.get("y")
    settings = {
        k: v
        for k, v in kwargs.items()
        if k
        in (
            "batch_size",
            "epochs",
            "steps_per_epoch",
            "steps",
            "initial_epoch",
            "validation_split",
            "validation_steps",
            "validation_batch_size",
            "validation_freq",
            "shuffle",
        )
    }
    items = [
        ("call", method),
        ("arguments", repr(sorted(settings.items()))),
        ("rows of x", repr(_rows(x))),
        ("rows of y", repr(_rows(y))),
        ("distribution", type(distribution).__name__),
        ("mesh", _mesh_text(distribution)),
        ("batch axis", repr(getattr(distribution, "batch_dim_name", None))),
    ]
    return items + copies.variable_items(model.variables)


def _mesh_text(distribution):
    mesh = getattr(distribution, "device_mesh", None)
    if mesh is None:
        return "None"
    return f"{tuple(mesh.shape)} {list(mesh.axis_names)}"


def input_digest(x):
    """A digest of the rows of an array input (numpy arrays, tensors, and
    dicts / lists / tuples of them), from evenly spaced sampled rows and the
    shapes; None for other inputs (generators, datasets)."""
    leaves = (
        [t for t in keras.tree.flatten(x) if t is not None]
        if x is not None
        else []
    )
    if not leaves or not all(
        hasattr(t, "shape") and len(t.shape) for t in leaves
    ):
        return None
    if not all(isinstance(t, np.ndarray) or torch.is_tensor(t) for t in leaves):
        return None
    digest = hashlib.sha256()
    for leaf in leaves:
        rows = int(leaf.shape[0])
        picked = np.unique(
            np.linspace(0, rows - 1, min(rows, _SAMPLED_ROWS)).astype(int)
        )
        if torch.is_tensor(leaf):
            picked = torch.as_tensor(picked)
        sample = np.ascontiguousarray(_keras.convert_to_numpy(leaf[picked]))
        digest.update(repr((tuple(leaf.shape), sample.dtype.str)).encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()[:16]


def _warn_if_replicas_repeat(method, gathered):
    """Per-process inputs (auto_shard_dataset=False) are each replica's part
    of the global batch: when every replica passes the same rows, warn."""
    group = replicas.current()
    if (
        not group.is_distributed
        or _keras.current_distribution().auto_shard_dataset
    ):
        return
    by_replica = {index: data for _, _, data, index in gathered}
    digests = set(by_replica.values())
    if len(by_replica) > 1 and 0 not in digests and len(digests) == 1:
        warn_once(
            ("replicas-repeat-input", method, digests.pop()),
            "%s(): every one of the %d data-parallel replicas passed the same "
            "rows (auto_shard_dataset=False makes each process's input its "
            "replica's part of the global batch), so every row is used %d "
            "times per step and the numbers differ from one process on that "
            "data. Pass each process its part (e.g. x[replica::%d], one "
            "replica per coordinate of the mesh's batch axis), or leave "
            "auto_shard_dataset=True and pass the whole data on every process.",
            method,
            group.count,
            group.count,
            group.count,
        )


def check(method, model, args, kwargs):
    """Raise RanksDisagreeError on every rank when the ranks' descriptions of
    this call differ. Under per-process inputs, warn when every replica
    passes the same rows. One small all-gather. Collective: call on every
    rank."""
    distribution = _keras.current_distribution()
    if distribution is None or not runtime.is_multi_process():
        return
    x = args[0] if args else kwargs.get("x")
    data = None if distribution.auto_shard_dataset else input_digest(x)
    gathered = agreement.compare(
        f"model.{method}()", describe(method, model, args, kwargs), data
    )
    _warn_if_replicas_repeat(method, gathered)
