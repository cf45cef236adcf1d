"""Each rank's FSDP figure: the gathered weights it holds at once.

Measured where a step was simulated (`_gathered`: rank 0's step, watched
at the dispatcher): `fsdp_gathered_bytes` is the most bytes of gathered
weights held at once (the group in use with those prefetched beside it,
regathers for backward, a flat buffer with its copies while both exist),
`fsdp_largest_gather_bytes` the largest single all-gather. Every rank runs
the same step, so a rank whose gathered blocks of every FSDP variable have
rank 0's sizes holds exactly rank 0's figure; a rank whose blocks differ
(a model axis that splits a gathered variable unevenly) gets rank 0's
figure scaled by its share of the gathered bytes: estimated, and said so.

Without a step (--step no, or a step that could not run), estimated from
the layers (`_shards.fsdp_peak`: each outermost layer's variables one group,
in layer order; the largest with the `prefetch` next ones).
"""

from keras_torch_distribution.plan import _shards


def figures(groups, measured, rank, prefetch):
    """The FSDP fields of `rank`'s row (empty without FSDP groups):
    `fsdp_gathered_bytes`, `fsdp_largest_gather_bytes`, `fsdp_figure`
    ("measured" or "estimated"), and `fsdp_largest_group` for an
    estimate."""
    if not groups:
        return {}
    if measured is None:
        name, size, ahead = _shards.fsdp_peak(groups, rank, prefetch)
        return {
            "fsdp_gathered_bytes": size + ahead,
            "fsdp_largest_gather_bytes": size,
            "fsdp_largest_group": name,
            "fsdp_figure": "estimated",
        }
    members = [[member] for _, group in groups for member in group]
    mine = [_shards.gathered_bytes(one, rank) for one in members]
    rank0 = [_shards.gathered_bytes(one, 0) for one in members]
    if mine == rank0 or rank == 0:
        return {
            "fsdp_gathered_bytes": measured.peak_bytes,
            "fsdp_largest_gather_bytes": measured.largest_bytes,
            "fsdp_figure": "measured",
        }
    share = sum(mine) / max(sum(rank0), 1)
    return {
        "fsdp_gathered_bytes": round(measured.peak_bytes * share),
        "fsdp_largest_gather_bytes": round(measured.largest_bytes * share),
        "fsdp_figure": "estimated",
    }
