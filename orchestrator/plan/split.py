"""How one step's micro-batches are split over the data-parallel ranks, and which of them a new
generation recomputes when copies are lost mid-step (torch-free: the runtime's data order,
train/data.py, and the plan's recovery cost, plan/goodput.py, read the same definitions).

Step t's M = global_batch / micro_batch micro-batches are numbered 0..M-1; data-parallel rank r of
dp takes the contiguous run `share(M, dp, r)`. When copies are lost while a step is in flight, the
survivors keep the gradients of their own runs; the runs of the lost copies' data ranks
(`lost_microbatches`) are spread over the new generation's data ranks in order (`recompute_share`),
so the step still sums every micro-batch once."""
from __future__ import annotations


def share(microbatches: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The micro-batches of one step that data-parallel rank `dp_rank` takes: (first, count).
    Even when dp divides them; otherwise the first `microbatches % dp` ranks take one more."""
    q, extra = divmod(microbatches, dp)
    return dp_rank * q + min(dp_rank, extra), q + (1 if dp_rank < extra else 0)


def copy_ranks(index: int, dp_shard: int) -> range:
    """The data-parallel ranks of the copy at `index` in its generation's copy list."""
    return range(index * dp_shard, (index + 1) * dp_shard)


def lost_microbatches(microbatches: int, dp: int, dp_shard: int, lost_indices) -> list[int]:
    """The step's micro-batch numbers the copies at `lost_indices` (in the old generation's copy
    list) were computing: their data ranks' runs, in order."""
    out: list[int] = []
    for i in sorted(lost_indices):
        for r in copy_ranks(i, dp_shard):
            first, count = share(microbatches, dp, r)
            out.extend(range(first, first + count))
    return out


def recompute_share(lost: list[int], dp: int, dp_rank: int) -> list[int]:
    """The lost micro-batches data rank `dp_rank` of the new generation (dp ranks) recomputes."""
    first, count = share(len(lost), dp, dp_rank)
    return lost[first:first + count]


def recompute_run(lost: int, dp: int, dp_shard: int, index: int) -> int:
    """How many micro-batches every rank of the new generation's copy at `index` runs in the
    recovery pass: the most any of its data ranks recomputes (the others pad, where their
    collectives count micro-batches)."""
    return max(share(lost, dp, r)[1] for r in copy_ranks(index, dp_shard))
