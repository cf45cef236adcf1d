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
"""

import hashlib

import keras
import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution import runtime


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
    settings = {k: v for k, v in kwargs.items() if k in (
        "batch_size", "epochs", "steps_per_epoch", "steps", "initial_epoch",
        "validation_split", "validation_steps", "validation_batch_size",
        "validation_freq", "shuffle",
    )}
    items = [
        ("call", method),
        ("arguments", repr(sorted(settings.items()))),
        ("rows of x", repr(_rows(x))),
        ("rows of y", repr(_rows(y))),
        ("distribution", type(distribution).__name__),
        ("mesh", _mesh_text(distribution)),
        ("batch axis", repr(getattr(distribution, "batch_dim_name", None))),
    ]
    for variable in model.variables:
        layout = getattr(variable, "_ktd_layout", None)
        axes = tuple(layout.axes) if layout is not None else None
        items.append(
            (f"variable {variable.path}", f"{tuple(variable.shape)} {variable.dtype} {axes}")
        )
    return items


def _mesh_text(distribution):
    mesh = getattr(distribution, "device_mesh", None)
    if mesh is None:
        return "None"
    return f"{tuple(mesh.shape)} {list(mesh.axis_names)}"


def check(method, model, args, kwargs):
    """Raise RanksDisagreeError on every rank when the ranks' descriptions of
    this call differ. Collective: call on every rank."""
    if _keras.current_distribution() is None or not runtime.is_multi_process():
        return
    items = describe(method, model, args, kwargs)
    digest = hashlib.sha256(repr(items).encode()).hexdigest()[:16]
    digests = [None] * runtime.num_processes()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    everyone = [None] * runtime.num_processes()
    dist.all_gather_object(everyone, dict(items))
    raise RanksDisagreeError(first_difference(everyone, method))


def first_difference(descriptions, method):
    """The message for the first item on which ranks' descriptions differ."""
    names = []
    for description in descriptions:
        names += [n for n in description if n not in names]
    for name in names:
        values = [d.get(name, "<absent>") for d in descriptions]
        if len(set(values)) == 1:
            continue
        groups = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        sides = "; ".join(f"ranks {ranks}: {value}" for value, ranks in groups.items())
        return (
            f"{method}() differs between ranks in {name}: {sides}. Every rank "
            "must run the same program on the same distribution, model and "
            "input sizes (per-process inputs with auto_shard_dataset=False "
            "must have the same number of rows on every rank). Make the "
            "differing value the same on every rank."
        )
    return f"{method}() differs between ranks, but no single item shows how."
