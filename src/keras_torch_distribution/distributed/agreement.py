"""Ranks agree before they train: one small all-gather names what differs.

Ranks that run different programs (a rank-dependent LayoutMap or model,
per-process inputs of different lengths, other batch sizes or epochs) used
to end in a gloo "collective mismatch" abort or, worse, train silently on
inconsistent rows. At the start of `fit` / `evaluate` / `predict` under a
distribution on several processes, every rank describes what must match --
the call, its arguments, the input's rows, the distribution and mesh, and
every variable's path, shape, dtype and layout -- and the ranks compare a
digest of it in one all-gather of a few bytes. Only when digests differ is
the description gathered, and every rank raises the same error naming the
first difference and the ranks on each side.

The same all-gather (`compare`) starts the broadcast that makes a build's
copies equal (`copies`), with what is being done in it: a rank that builds
a model the others do not build meets their fit / evaluate / predict, or
their build of another model, and every rank raises an error naming what
each side was doing, instead of waiting forever in a broadcast.
"""

import hashlib

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution._processes import runtime
from keras_torch_distribution.distributed import layouts
from keras_torch_distribution.distributed import replicas
from keras_torch_distribution.log import warn_once

# Rows of an input sampled (evenly spaced) for its digest: enough to tell
# one process's part of a dataset from another's, cheap for any size.
_SAMPLED_ROWS = 64


class RanksDisagreeError(RuntimeError):
    """Ranks called fit / evaluate / predict with different programs."""


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
    return items + variable_items(model.variables)


def variable_items(variables):
    """Each variable's path, shape, dtype and layout, as (name, text) pairs."""
    items = []
    for variable in variables:
        layout = layouts.resolved_layout(variable)
        axes = tuple(layout.axes) if layout is not None else None
        items.append(
            (
                f"variable {variable.path}",
                f"{tuple(variable.shape)} {variable.dtype} {axes}",
            )
        )
    return items


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
    gathered = compare(
        f"{method}()", describe(method, model, args, kwargs), data
    )
    _warn_if_replicas_repeat(method, gathered)


def compare(doing, items, data=None):
    """Raise RanksDisagreeError on every rank when ranks are doing other
    things (`doing`: "fit()", "the build of ...") or describe it with other
    `items` ((name, text) pairs); return every rank's (doing's kind, items'
    digest, `data` (a 16-hex-digit digest or None), replica index), as
    integers. One all-gather of 32 bytes (a CPU tensor, on
    `runtime.cpu_group()`), and one more of the descriptions when they
    differ. Collective: call on every rank."""
    digest = hashlib.sha256(repr(items).encode()).hexdigest()[:16]
    header = torch.tensor(
        [
            _code(_kind(doing)),
            _code(digest),
            _code(data),
            replicas.current().index,
        ],
        dtype=torch.int64,
    )
    group = runtime.cpu_group()
    gathered = [
        torch.empty_like(header) for _ in range(runtime.num_processes())
    ]
    dist.all_gather(gathered, header, group=group)
    gathered = [tuple(int(v) for v in entry) for entry in gathered]
    if len({entry[:2] for entry in gathered}) == 1:
        return gathered
    everyone = [None] * runtime.num_processes()
    dist.all_gather_object(everyone, (doing, dict(items)), group=group)
    if len({_kind(d) for d, _ in everyone}) > 1:
        raise RanksDisagreeError(_different_programs([d for d, _ in everyone]))
    raise RanksDisagreeError(
        first_difference([i for _, i in everyone], _kind(doing))
    )


def _code(text):
    """A text (or a hex digest) as a signed 64-bit integer; None as 0."""
    if text is None:
        return 0
    value = int(hashlib.sha256(text.encode()).hexdigest()[:16], 16)
    return value - (1 << 64) if value >= (1 << 63) else value


def _kind(doing):
    """What kind of thing `doing` is: "fit()" is itself, "the build of 2
    variables (...)" is "the build"."""
    return doing.split(" of ", 1)[0]


def _sides(values):
    """Ranks grouped by their value: "ranks [0]: a; ranks [1, 2]: b"."""
    groups = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(
        f"ranks {ranks}: {value}" for value, ranks in groups.items()
    )


def _different_programs(doings):
    return (
        f"Ranks are running different programs: {_sides(doings)}. Under a "
        "distribution, every rank must build the same models in the same order "
        "and call fit / evaluate / predict together (building a model on some "
        "ranks only makes a collective that the others never join). Make the "
        "differing step the same on every rank, or build a model meant for one "
        "rank only outside the distribution (before "
        "keras.distribution.set_distribution, or after set_distribution(None))."
    )


def first_difference(descriptions, doing):
    """The message for the first item on which ranks' descriptions of
    `doing` ("fit()", "the build") differ."""
    names = []
    for description in descriptions:
        names += [n for n in description if n not in names]
    for name in names:
        values = [d.get(name, "<absent>") for d in descriptions]
        if len(set(values)) == 1:
            continue
        return (
            f"{doing} differs between ranks in {name}: {_sides(values)}. Every "
            "rank must run the same program on the same distribution, model "
            "and input sizes (per-process inputs with auto_shard_dataset=False "
            "must have the same number of rows on every rank). Make the "
            "differing value the same on every rank."
        )
    return f"{doing} differs between ranks, but no single item shows how."
