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
from keras_torch_distribution._variables import left_whole
from keras_torch_distribution.checkpoint._errors import DamagedCheckpointError
from keras_torch_distribution.checkpoint._keys import MODEL_PREFIX

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


def checkpoint_table(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Per-variable rows of an intact sharded checkpoint: key, global shape,
    dtype, the blocks each writing rank stored, and whether its files were
    verified (False for a checkpoint written before checksums)."""
    _, marker, metadata = verify(path)
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
    _mark_whole(rows, marker.get("num_processes", 1))
    return rows


def _mark_whole(rows: list[dict[str, Any]], num_processes: int) -> None:
    """Set row["whole"] for large model variables written as one block by
    a checkpoint of several processes (held whole on every rank)."""
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
        axes = left_whole.suggested_axes(
            row["shape"], {"batch": num_processes}, "batch"
        )
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
    """The text `ktd report CHECKPOINT` prints for `checkpoint_table`'s rows."""
    header = (
        f"{'variable':44} {'global shape':>16} {'dtype':>9}  "
        "blocks (rank: offsets + shape)"
    )
    lines = [header, "-" * len(header)]
    totals = {}
    for row in rows:
        blocks = "; ".join(
            f"{b['rank']}: {b['offsets']}+{b['shape']}" for b in row["blocks"]
        )
        mark = "  WHOLE" if row.get("whole") else ""
        lines.append(
            f"{row['key'][:44]:44} {str(row['shape']):>16} "
            f"{row['dtype']:>9}  {blocks}{mark}"
        )
        for b in row["blocks"]:
            totals[b["rank"]] = totals.get(b["rank"], 0) + (b["bytes"] or 0)
    lines.append(
        "bytes written per rank: "
        + ", ".join(
            f"rank {r}: {n:,}"
            for r, n in sorted(totals.items(), key=lambda kv: str(kv[0]))
        )
    )
    for row in rows:
        whole = row.get("whole")
        if whole:
            lines.append(
                f"WHOLE: {row['key']} was whole on every rank "
                f"({100 * whole['share']:.1f}% of the model's bytes); a "
                "LayoutMap key would shard it, e.g. "
                f"layout_map[{whole['key']!r}] = "
                f"{whole['axes']} (the batch axis named as in your mesh)"
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
