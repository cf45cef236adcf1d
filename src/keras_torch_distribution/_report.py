"""Shard report: where every variable lives and what each rank holds.

Large variables that the layout map leaves whole on every rank while it
shards others (`_variables.left_whole`) are marked "WHOLE", with the LayoutMap
key that would shard them.

What `ktd report CHECKPOINT` prints for a checkpoint on disk lives with the
checkpoint package (`checkpoint.inspect`); its two functions are importable
from here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._log import grouped
from keras_torch_distribution._log import human_bytes
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import ranks_text
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._variables import left_whole
from keras_torch_distribution.checkpoint.inspect import checkpoint_table  # noqa: F401
from keras_torch_distribution.checkpoint.inspect import format_checkpoint_table  # noqa: F401

if TYPE_CHECKING:
    from collections.abc import Callable

    import keras


def _rows_for(variable: keras.Variable) -> dict[str, Any]:
    value = _keras.raw_value(variable)
    local = tensors.local_part(value)
    layout = layouts.resolved_layout(variable)
    axes = tuple(layout.axes) if layout is not None else "replicated"
    return {
        "path": variable.path,
        "shape": tuple(variable.shape),
        "layout": axes,
        "local_shape": tuple(local.shape),
        "bytes": local.numel() * local.element_size(),
    }


def shard_table(model: keras.Model) -> list[dict[str, Any]]:
    """Per-variable rows for this rank: path, global shape, layout, local
    shape and bytes; optimizer variables are included when built."""
    whole = {
        id(entry["variable"]): entry
        for entry in left_whole.left_whole(
            model.variables, _keras.current_distribution()
        )
    }
    rows = []
    for v in model.variables:
        row = dict(_rows_for(v), kind="param")
        if id(v) in whole:
            entry = whole[id(v)]
            row["left_whole"] = {
                "key": entry["key"],
                "axes": entry["axes"],
                "share": entry["share"],
            }
        rows.append(row)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        rows += [
            dict(_rows_for(v), kind="optimizer") for v in optimizer.variables
        ]
    return rows


def report(
    model: keras.Model, print_fn: Callable[[str], object] | None = None
) -> list[list[dict[str, Any]]]:
    """Show each variable's layout and per-rank bytes; rank 0 prints.

    Returns every rank's table: a list (one per rank) of row lists.
    Collective: call on every rank.

    Args:
        model: the built `keras.Model` to report on.
        print_fn: what rank 0 prints the report with (default: the
            package logger's `warning`).

    Returns:
        Every rank's rows (`shard_table`), in rank order.
    """
    rows = shard_table(model)
    tables = [rows]
    if runtime.is_multi_process():
        tables = [None] * runtime.num_processes()
        dist.all_gather_object(tables, rows, group=runtime.cpu_group())
    if runtime.process_id() == 0:
        (print_fn or logger.warning)(format_report(tables))
    return tables


def format_report(tables: list[list[dict[str, Any]]]) -> str:
    """The text `report` prints for every rank's rows: one column per
    group of ranks whose local shapes are all equal ("ranks 0-3"), names
    and layouts never cut, bytes per group of ranks, readable."""
    ranks = len(tables)
    columns = grouped(
        {r: [row["local_shape"] for row in tables[r]] for r in range(ranks)}
    )
    header = ["variable", "global shape", "layout"] + [
        f"{ranks_text(group)} shape" for group, _ in columns
    ]
    table = [header]
    for index, row in enumerate(tables[0]):
        cells = [row["path"], str(row["shape"]), str(row["layout"])]
        cells += [str(shapes[index]) for _, shapes in columns]
        if row.get("left_whole"):
            cells[-1] += "  WHOLE"
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for i, cells in enumerate(table):
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        )
        if i == 0:
            lines.append("-" * len(lines[0]))
    for kind in ("param", "optimizer"):
        totals = {
            rank: sum(r["bytes"] for r in tables[rank] if r["kind"] == kind)
            for rank in range(ranks)
        }
        if any(totals.values()):
            lines.append(
                f"{kind} bytes: "
                + "; ".join(
                    f"{ranks_text(group)}: {human_bytes(n)}"
                    + (" each" if len(group) > 1 else "")
                    for group, n in grouped(totals)
                )
            )
    for row in tables[0]:
        whole = row.get("left_whole")
        if whole:
            lines.append(
                f"WHOLE: {row['path']} is whole on every rank "
                f"({human_bytes(row['bytes'])}, {100 * whole['share']:.1f}% "
                "of the model's variables) while the layout map shards "
                f"others; {left_whole.advice(whole['key'], whole['axes'])} "
                "would shard it"
            )
    return "\n".join(lines)
