"""What `ktd report CHECKPOINT` prints: each variable's blocks and their
writers, after checking the checkpoint is intact (no process group needed).

Reading goes through the same restricted metadata reader as `load`, and
every file is verified against the size and CRC-32 its writer recorded, so
a damaged checkpoint is reported as damaged (DamagedCheckpointError listing
every damaged file and the rank that wrote it), never shown as healthy.

A model variable written whole (one block) by a checkpoint of several
processes, above `left_whole.SHARE` of the model's bytes, is marked
WHOLE: every rank held it whole (see `_variables.left_whole`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from typing import Any

import torch

import keras_torch_distribution.checkpoint._checksums as _checksums
import keras_torch_distribution.checkpoint._location as _location
import keras_torch_distribution.checkpoint._unpickler as _unpickler
from keras_torch_distribution._log import grouped
from keras_torch_distribution._log import human_bytes
from keras_torch_distribution._log import ranks_text
from keras_torch_distribution._variables import left_whole
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._keys import MODEL_PREFIX
from keras_torch_distribution.checkpoint.callbacks import latest

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def verify(
    path: str | os.PathLike[str],
) -> tuple[str, dict[str, Any], Metadata]:
    """Check every file of the checkpoint at `path` (reads them all): raise
    DamagedCheckpointError naming each damaged file and its writer; return
    (directory, marker, metadata) of an intact one."""
    directory, marker = _location.locate(path)
    damaged = _checksums.problems(directory, marker)
    if len(damaged) == 1:
        raise damaged[0]
    if damaged:
        raise DamagedCheckpointError(
            f"Checkpoint {directory!r} is damaged: {len(damaged)} files differ "
            "from what their writers recorded:\n"
            + "\n".join(f"- {error}" for error in damaged),
            directory,
            damaged[0].rank,
        )
    return directory, marker, _unpickler.read_metadata(directory, marker)


class CheckpointRows(list):
    """`checkpoint_table`'s rows, with the checkpoint they come from:
    `directory`, its `marker`, and `newest_of` ((folder, number of
    checkpoints) where a ShardedCheckpoint folder was given, else None)."""

    directory = None
    marker = None
    newest_of = None


def newest(path: str | os.PathLike[str]) -> tuple[str, Any]:
    """(checkpoint, newest_of): `path` itself where it is a checkpoint;
    the newest complete checkpoint of a folder `ShardedCheckpoint` wrote
    in, with (folder, how many it holds); else NotACheckpointError (from
    `_files.locate`, naming `path`)."""
    if _location.is_checkpoint(path) or not os.path.isdir(path):
        return str(path), None
    found = latest(path)
    if found is None:
        return str(path), None  # locate() names what is wrong
    count = sum(
        _location.is_checkpoint(os.path.join(path, name))
        for name in os.listdir(path)
    )
    return found, (str(path), count)


def checkpoint_table(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Per-variable rows of an intact sharded checkpoint: key, global shape,
    dtype, the blocks each writing rank stored, and whether its files were
    verified (False for a checkpoint written before checksums). `path` is
    a checkpoint, or a ShardedCheckpoint folder (its newest checkpoint).
    A `CheckpointRows` list."""
    path, newest_of = newest(path)
    directory, marker, metadata = verify(path)
    verified = bool(_checksums.file_entries(marker))
    writers = {}
    for index, info in metadata.storage_data.items():
        rank = _checksums.writer_of(
            marker, os.path.basename(info.relative_path)
        )
        writers[(index.fqn, tuple(index.offset or ()))] = (rank, info.length)
    rows = []
    for key, entry in sorted(metadata.state_dict_metadata.items()):
        blocks = []
        for chunk in entry.chunks:
            rank, nbytes = writers.get(
                (key, tuple(chunk.offsets)), (None, None)
            )
            blocks.append(
                {
                    "rank": rank,
                    "offsets": tuple(chunk.offsets),
                    "shape": tuple(chunk.sizes),
                    "bytes": nbytes,
                }
            )
        rows.append(
            {
                "key": key,
                "shape": tuple(entry.size),
                "dtype": str(entry.properties.dtype).replace("torch.", ""),
                "blocks": blocks,
                "verified": verified,
            }
        )
    _mark_whole(rows, marker)
    rows = CheckpointRows(rows)
    rows.directory, rows.marker, rows.newest_of = directory, marker, newest_of
    return rows


def _mesh_axes(marker: dict[str, Any]) -> tuple[dict[str, int], str | None]:
    """({axis name: size}, batch axis) of the mesh the checkpoint was
    written under (its marker's `mesh`), or, for a checkpoint without one,
    every process on one axis named "batch"."""
    mesh = marker.get("mesh")
    if isinstance(mesh, dict) and mesh.get("axis_names"):
        sizes = dict(zip(mesh["axis_names"], mesh["shape"], strict=True))
        return sizes, mesh.get("batch_axis")
    return {"batch": marker.get("num_processes", 1)}, "batch"


def _mark_whole(rows: list[dict[str, Any]], marker: dict[str, Any]) -> None:
    """Set row["whole"] for large model variables written as one block by
    a checkpoint of several processes (held whole on every rank), with the
    axes fit's warning names for them (on the mesh the checkpoint was
    written under)."""
    num_processes = marker.get("num_processes", 1)
    mesh_axes, batch_axis = _mesh_axes(marker)
    model_rows = [r for r in rows if r["key"].startswith(MODEL_PREFIX)]
    sizes = {
        r["key"]: left_whole.global_bytes(
            r["shape"], getattr(torch, r["dtype"])
        )
        for r in model_rows
    }
    total = sum(sizes.values())
    for row in model_rows:
        blocks = row["blocks"]
        one_block = len(blocks) == 1 and tuple(blocks[0]["shape"]) == tuple(
            row["shape"]
        )
        axes = left_whole.suggested_axes(row["shape"], mesh_axes, batch_axis)
        if (
            num_processes > 1
            and one_block
            and axes is not None
            and sizes[row["key"]] > left_whole.SHARE * total
        ):
            row["whole"] = {
                "share": sizes[row["key"]] / total,
                "key": left_whole.layout_map_key(
                    row["key"][len(MODEL_PREFIX) :]
                ),
                "axes": axes,
            }


def format_checkpoint_table(rows: list[dict[str, Any]]) -> str:
    """The text `ktd report CHECKPOINT` prints for `checkpoint_table`'s
    rows: which checkpoint (the newest of a folder), its epoch and step,
    each variable's blocks with the ranks that wrote equal ones grouped,
    the bytes each group of ranks wrote, readable. Nothing is cut."""
    lines = _about(rows)
    table = [("variable", "global shape", "dtype", "blocks")]
    totals = {}
    for row in rows:
        mark = "  WHOLE" if row.get("whole") else ""
        table.append(
            (
                row["key"],
                str(row["shape"]),
                row["dtype"],
                _blocks_text(row) + mark,
            )
        )
        for b in row["blocks"]:
            totals[b["rank"]] = totals.get(b["rank"], 0) + (b["bytes"] or 0)
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for i, cells in enumerate(table):
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(cells[:3], widths))
            + "  "
            + cells[3]
        )
        if i == 0:
            lines.append("-" * (sum(widths) + 6 + len("blocks")))
    marker = getattr(rows, "marker", None)
    if marker and _checksums.file_entries(marker):  # every file, by its writer
        totals = {}
        for entry in _checksums.file_entries(marker).values():
            rank = entry.get("rank")
            totals[rank] = totals.get(rank, 0) + entry["bytes"]
    known = {r: n for r, n in totals.items() if r is not None}
    groups = [
        f"{ranks_text(ranks)}: {human_bytes(n)}"
        + (" each" if len(ranks) > 1 else "")
        for ranks, n in grouped(known)
    ]
    if None in totals:
        groups.append(f"writer unknown: {human_bytes(totals[None])}")
    lines.append("bytes written: " + "; ".join(groups))
    for row in rows:
        whole = row.get("whole")
        if whole:
            lines.append(
                f"WHOLE: {row['key']} was whole on every rank "
                f"({100 * whole['share']:.1f}% of the model's bytes); "
                f"{left_whole.advice(whole['key'], whole['axes'])} would "
                "shard it"
            )
    if rows and all(row.get("verified") for row in rows):
        lines.append(
            "intact: every file has the size and CRC-32 its writer recorded"
        )
    elif rows:
        lines.append(
            "not verified: written before checkpoints carried checksums"
        )
    return "\n".join(lines)


def _blocks_text(row: dict[str, Any]) -> str:
    """A variable's blocks, ranks with equal block shapes grouped: "ranks
    0-3: (3, 20) each, split on dim 0", "rank 0: whole"."""
    shape = tuple(row["shape"])
    blocks = row["blocks"]
    if len(blocks) == 1 and tuple(blocks[0]["shape"]) == shape:
        rank = blocks[0]["rank"]
        return f"{ranks_text([rank]) if rank is not None else 'rank ?'}: whole"
    by_rank, unknown = {}, []
    for b in blocks:
        if b["rank"] is None:
            unknown.append(tuple(b["shape"]))
        else:
            by_rank.setdefault(b["rank"], []).append(tuple(b["shape"]))
    parts = []
    for ranks, shapes in grouped(by_rank):
        text = ", ".join(str(s) for s in shapes)
        parts.append(
            f"{ranks_text(ranks)}: {text}" + (" each" if len(ranks) > 1 else "")
        )
    if unknown:
        parts.append("writer unknown: " + ", ".join(str(s) for s in unknown))
    split = sorted(
        {d for b in blocks for d, n in enumerate(b["shape"]) if n < shape[d]}
    )
    where = f", split on dim{'s' if len(split) > 1 else ''} " + ", ".join(
        map(str, split)
    )
    return "; ".join(parts) + (where if split else "")


def _about(rows: list[dict[str, Any]]) -> list[str]:
    """The header lines: which checkpoint, its epoch, step and size."""
    directory = getattr(rows, "directory", None)
    if directory is None:
        return []
    marker = rows.marker
    extra = marker.get("extra") if isinstance(marker.get("extra"), dict) else {}
    where = f"checkpoint {directory}"
    if rows.newest_of:
        folder, count = rows.newest_of
        where += f" (the newest of {count} in {folder})"
    facts = [
        f"{name} {extra[name]}"
        for name in ("epoch", "step", "batch")
        if name in extra
    ]
    facts.append(f"written by {marker.get('num_processes', 1)} process(es)")
    size = sum(e["bytes"] for e in _checksums.file_entries(marker).values())
    if size:
        facts.append(human_bytes(size))
    return [where, ", ".join(facts), ""]
