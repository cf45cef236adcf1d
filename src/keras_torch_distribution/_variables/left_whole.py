"""Say what a layout map leaves whole.

A `ModelParallel` LayoutMap shards the variables its keys match; any other
variable is whole (replicated) on every rank, with its gradient and its
optimizer slots. A map written for a model family can miss a large one:
keras_hub's Llama map has no key for `token_embedding/reverse_embeddings`
(hidden x vocabulary, an eighth of a 500 M-parameter Llama), so every rank
holds it whole, and nothing said so.

When the map shards some of a model's variables and leaves one whole whose
bytes exceed `SHARE` of the model's, `warn_if_left_whole` logs one warning
for it, naming the variable, its bytes per rank and the LayoutMap key (with
axes) that would shard it: its largest dim on the mesh's largest axis (the
batch axis on a tie), i.e. FSDP when that axis is the batch axis (stored
1/N, gathered for use; the numbers do not change). The trainer calls it when
`fit`, `evaluate` or `predict` first sees the model's variables (they are all
built by then), once per variable and process; `_report.report` and
`ktd report CHECKPOINT` mark such variables too.

When the map shards none of them (`shards_nothing`; its output keys
aside: keys written for another model, or `up/kernel` where the path is
`sequential/up/kernel`: keys must match a whole path), every variable is
whole, and one warning names the keys that matched nothing, a few real
paths and the `.*` prefix that matches any path's start.
"""

import math
import re

import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._variables import born_sharded

# A whole variable above this share of the model's bytes is worth a warning.
SHARE = 0.05


def global_bytes(shape, dtype):
    """Bytes of a whole tensor of `shape` and `dtype` (a Keras dtype name or
    a torch dtype)."""
    if not isinstance(dtype, torch.dtype):
        dtype = _keras.to_torch_dtype(dtype)
    return (
        math.prod(int(n) for n in shape)
        * torch.empty((), dtype=dtype).element_size()
    )


def suggested_axes(shape, mesh_axes, batch_axis):
    """The layout axes that would shard a variable of `shape` on a mesh of
    `mesh_axes` ({axis name: size}, in mesh order): its largest dim on the
    largest axis (`batch_axis` on a tie); None when every axis has size 1
    or the variable is a scalar."""
    if not shape or max(mesh_axes.values(), default=1) <= 1:
        return None
    axis = max(
        mesh_axes, key=lambda name: (mesh_axes[name], name == batch_axis)
    )
    dim = max(range(len(shape)), key=lambda d: (int(shape[d]), -d))
    return tuple(axis if d == dim else None for d in range(len(shape)))


def advice(key, axes):
    """The one line of advice fit, `ktd plan` and `ktd report` give for a
    variable left whole: the LayoutMap entry that would shard it."""
    return f"layout_map[{key!r}] = {tuple(axes)}"


def layout_map_key(path):
    """A LayoutMap key that matches the variable at `path` (its path, with
    regular-expression characters escaped)."""
    return re.escape(path).replace("\\/", "/")


def _mesh_axes(distribution):
    mesh = distribution.device_mesh
    return dict(zip(mesh.axis_names, (int(n) for n in mesh.shape)))


def left_whole(model_variables, distribution):
    """The variables a ModelParallel layout map leaves whole that exceed
    `SHARE` of the model's bytes, while it shards others: a list of dicts
    (variable, bytes per rank, share, key, axes). Empty for any other
    distribution, or when nothing is sharded. No collective."""
    if not _keras.layout_map_layouts(distribution):
        return []
    model_variables = list(model_variables)
    total = sum(global_bytes(v.shape, v.dtype) for v in model_variables)
    sharded = [
        v for v in model_variables if layouts.resolved_layout(v) is not None
    ]
    if not total or not sharded:
        return []
    mesh_axes = _mesh_axes(distribution)
    found = []
    for variable in model_variables:
        if (
            layouts.resolved_layout(variable) is not None
            or not getattr(variable, "_ktd_distributed", False)
            or _keras.raw_value(variable) is None
            # float8 scales and amax histories: their new values are the
            # maximum over the replicas, which a sharded gradient cannot
            # give (`_training.reductions`); small in any real model.
            or _keras.overwritten_with_gradient(variable)
        ):
            continue
        nbytes = born_sharded.local_bytes(variable)
        axes = suggested_axes(
            variable.shape, mesh_axes, distribution.batch_dim_name
        )
        if nbytes <= SHARE * total or axes is None:
            continue
        found.append(
            {
                "variable": variable,
                "bytes": nbytes,
                "share": nbytes / total,
                "key": layout_map_key(variable.path),
                "axes": axes,
                "ways": mesh_axes[next(a for a in axes if a is not None)],
                "sharded_count": len(sharded),
            }
        )
    return found


# Variable paths a warning names as examples.
_SHOWN_PATHS = 3


def _matches(key, path):
    """Whether LayoutMap `key` gives `path` its layout (as Keras' LayoutMap
    looks one up: the key itself, else the key as a regular expression
    matching the whole path)."""
    try:
        return key == path or re.fullmatch(key, path) is not None
    except re.error:
        return False


def shards_nothing(model_variables, distribution):
    """For a ModelParallel whose LayoutMap shards none of
    `model_variables` on a mesh that could shard them: (its keys that match
    no variable's path, the largest variables' paths, a key suggested for
    the first unmatched key or None); else None. No collective."""
    # Keys of output layouts (`<layer path>/output`: a sequence axis's
    # keys, say) lay out activations, never a variable.
    keys = [
        k
        for k in _keras.layout_map_keys(distribution)
        if not k.endswith("/output")
    ]
    if not keys or max(_mesh_axes(distribution).values(), default=1) <= 1:
        return None
    handled = [
        v
        for v in model_variables
        if getattr(v, "_ktd_distributed", False) and len(v.shape)
    ]
    if not handled or any(
        layouts.resolved_layout(v) is not None for v in handled
    ):
        return None
    paths = [v.path for v in handled]
    unmatched = [k for k in keys if not any(_matches(k, p) for p in paths)]
    largest = sorted(handled, key=lambda v: -global_bytes(v.shape, v.dtype))[
        :_SHOWN_PATHS
    ]
    suggested = next(
        (
            f".*{key}"
            for key in unmatched
            if any(_matches(f".*{key}", p) for p in paths)
        ),
        None,
    )
    return unmatched, [v.path for v in largest], suggested


def _warn_if_shards_nothing(model_variables, distribution):
    found = shards_nothing(model_variables, distribution)
    if found is None:
        return
    unmatched, examples, suggested = found
    keys = ", ".join(repr(k) for k in unmatched)
    fix = (
        f"layout_map[{suggested!r}] instead of layout_map[{unmatched[0]!r}]"
        if suggested
        else "keys that match these paths, e.g. layout_map['.*name/kernel']"
    )
    said = (
        f"Its keys {keys} match no variable's path: a key must match the "
        "whole path (re.fullmatch), and the paths here are like "
        f"{', '.join(repr(p) for p in examples)}. A key that starts with "
        f"'.*' matches any start of a path: write {fix}."
        if unmatched
        else "Every key matches a variable, but none of their layouts "
        "shards it on an axis of more than one device."
    )
    warn_once(
        ("shards-nothing", tuple(_keras.layout_map_keys(distribution))),
        "The LayoutMap of this ModelParallel shards none of the model's "
        "variables: every one is whole on every rank, with its gradient and "
        "optimizer slots. %s",
        said,
    )


def warn_if_left_whole(model_variables, distribution):
    """Warn once per variable about large variables the layout map leaves
    whole on every rank, or once when it shards none (see the module
    docstring). No collective."""
    if distribution is None:
        return
    model_variables = list(model_variables)
    _warn_if_shards_nothing(model_variables, distribution)
    for entry in left_whole(model_variables, distribution):
        variable = entry["variable"]
        warn_once(
            ("left-whole", id(variable)),
            "Variable %r (shape %s) is whole on every rank: %s bytes per rank, "
            "%.1f%% of the model's variables, with its gradient and optimizer "
            "slots, while the LayoutMap shards %d other variables. No "
            "LayoutMap key shards it. To store it 1/%d per rank, add "
            "%s before building the model.",
            variable.path,
            tuple(variable.shape),
            f"{entry['bytes']:,}",
            100 * entry["share"],
            entry["sharded_count"],
            entry["ways"],
            advice(entry["key"], entry["axes"]),
        )
