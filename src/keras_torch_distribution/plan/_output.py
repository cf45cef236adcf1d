"""The plan as text (`format_text`) and as JSON (`write_json`).

The JSON holds the plan's dict: `format_version` (1: this layout),
`world`, `per_rank` (one object per set of
identical ranks: `rank`, the first of them, `ranks`, all of them,
`params_bytes`, `grads_bytes`, `optimizer_bytes`, `total_bytes` (their sum),
under FSDP `fsdp_gathered_bytes` (gathered weights held at once),
`fsdp_largest_gather_bytes` and `fsdp_figure` ("measured" or "estimated":
see `_fsdp_figure`), `peak_bytes` (the total plus FSDP's gathered
weights)), `worst_rank`, `step_simulated`, `step_kind` ("real" or "fake":
see `_fake_step`), `collectives_per_step` (kind -> count and bytes of one
training step on rank 0; every rank issues the same collectives; those a
CUDA mesh issues, `collectives_backend` "nccl": all_to_all where a CPU
mesh issues an all-gather),
`fsdp_prefetch` (the depth simulated), `accelerate_estimate`
(Accelerate's `estimate-memory` method: the model's bytes, and 4x for
training with Adam), `left_whole`, `peak_rss_bytes`, `wall_seconds`.
"""

import json
import sys

from keras_torch_distribution._log import human_bytes
from keras_torch_distribution._log import rank_ranges
from keras_torch_distribution._variables import left_whole


def format_text(plan):
    mesh = plan["mesh"]
    lines = [
        f"ktd plan: {' '.join(plan['script'])} at world {plan['world']}"
        f" (stopped at {plan['stopped_at']})",
        f"distribution {plan['distribution']}"
        + (
            f", mesh {tuple(mesh['shape'])} {tuple(mesh['axis_names'])}"
            if mesh
            else ""
        )
        + f"; {plan['parameters']:,} parameters, "
        + human_bytes(plan["model_bytes"])
        + (f"; optimizer {plan['optimizer']}" if plan["optimizer"] else ""),
        "",
    ]
    fsdp = plan["fsdp_groups"] > 0
    header = ["ranks", "params", "grads", "optimizer", "total"]
    if fsdp:
        header += ["FSDP held", "largest gather", "peak"]
    table = [header]
    for row in plan["per_rank"]:
        cells = [
            rank_ranges(row["ranks"]),
            human_bytes(row["params_bytes"]),
            human_bytes(row["grads_bytes"]),
            human_bytes(row["optimizer_bytes"]),
            human_bytes(row["total_bytes"]),
        ]
        if fsdp:
            mark = "" if row["fsdp_figure"] == "measured" else " (est.)"
            cells += [
                human_bytes(row["fsdp_gathered_bytes"]) + mark,
                human_bytes(row["fsdp_largest_gather_bytes"]) + mark,
                human_bytes(row["peak_bytes"]) + mark,
            ]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths))
            )
        )
    worst = next(r for r in plan["per_rank"] if r["rank"] == plan["worst_rank"])
    if len(plan["per_rank"]) > 1:
        lines.append(
            f"worst rank: {plan['worst_rank']} "
            f"({human_bytes(worst['peak_bytes'])})"
        )
    if fsdp:
        lines.append(_fsdp_line(plan, worst))
    lines.append("")
    if plan["collectives_per_step"] is not None:
        lines.append(
            "collectives per training step (every rank, as a CUDA mesh "
            "issues them: an all_to_all where a CPU mesh all-gathers), "
            f"counted in a step on {_STEP_KINDS[plan['step_kind']]}:"
        )
        for kind, entry in plan["collectives_per_step"].items():
            lines.append(
                f"  {kind:16} {entry['count']:6}  {human_bytes(entry['bytes'])}"
            )
    else:
        lines.append(f"collectives: not simulated ({plan['no_step_reason']})")
    estimate = plan["accelerate_estimate"]
    lines.append(
        f"Accelerate's estimate-memory (whole model, every device): "
        f"{human_bytes(estimate['model_bytes'])}; training with Adam "
        f"{human_bytes(estimate['training_adam_bytes'])}"
    )
    for entry in plan["left_whole"]:
        lines.append(
            f"WHOLE: {entry['path']} is whole on every rank "
            f"({human_bytes(entry['bytes'])}); "
            f"{left_whole.advice(entry['key'], entry['axes'])} would shard it"
        )
    lines.append(
        f"planned in {plan['wall_seconds']} s, peak RSS "
        f"{human_bytes(plan['peak_rss_bytes'])}"
    )
    return "\n".join(lines)


_STEP_KINDS = {
    "real": "rank 0's own tensors",
    "fake": "fake tensors (nothing allocated)",
}


def _fsdp_line(plan, worst):
    prefetch = (
        f"{plan['fsdp_prefetch']} group(s) prefetched (KTD_FSDP_PREFETCH; "
        "CUDA's default 1)"
    )
    if worst["fsdp_figure"] == "measured":
        return (
            "FSDP: gathered weights held at once measured in the simulated "
            f"step, {prefetch}"
        )
    if "fsdp_largest_group" in worst:
        return (
            f"FSDP (estimated, no step): the largest of {plan['fsdp_groups']} "
            f"layer groups ({worst['fsdp_largest_group']}) with {prefetch}"
        )
    return (
        "FSDP: rank 0's measured figure scaled by this rank's gathered "
        "blocks (estimated: its blocks differ from rank 0's)"
    )


def write_json(plan, path):
    """The plan as JSON in the file `path`, or on stdout for "-"."""
    if path == "-":
        json.dump(plan, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as file:
        json.dump(plan, file, indent=2)
        file.write("\n")
