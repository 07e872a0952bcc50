"""Which rows of the global batch each (stage, replica, micro-batch) unit works on.

The global batch of N rows is split into M micro-batches of n = N / M rows; a stage with R
replicas splits each micro-batch evenly (the runtime requires N divisible by M x R for every
stage; the Plan format also admits slices that differ by one row, which the planner uses to
express paper plans such as 15:1 of a 2048 batch, but the runtime refuses them), replica r taking rows [r n/R, (r+1) n/R) of it
(DAPPLE §V-B2). Rows are contiguous, so a boundary between stages of different replica counts
moves row ranges: a concat (many-to-one), a split (one-to-many), or both (many-to-many), and
nothing at all when the counts are equal (the ranges line up).
"""
from __future__ import annotations

from typing import List, Tuple


class BatchSplitError(ValueError):
    pass


def check_divisible(global_batch: int, micro_batches: int, replicas: List[int]) -> None:
    for s, r in enumerate(replicas):
        unit = micro_batches * r
        if global_batch % unit:
            raise BatchSplitError(
                f"global batch {global_batch} does not divide into {micro_batches} micro-batches "
                f"x {r} replicas of stage {s} (= {unit} equal slices): use a batch size that is a "
                f"multiple of {unit}, or a plan with other micro_batches (`dapple plan "
                f"--even_slices` only proposes plans whose slices are equal)")


def unit_rows(global_batch: int, micro_batches: int, replicas: int, micro_batch: int,
              replica: int) -> Tuple[int, int]:
    """[start, stop) rows of the global batch for one unit."""
    n = global_batch // micro_batches
    size = n // replicas
    start = micro_batch * n + replica * size
    return start, start + size


def overlaps(wanted: Tuple[int, int], pieces: List[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
    """For a wanted row range, the (piece index, start, stop) rows to take from each piece,
    start/stop relative to that piece, in row order."""
    a, b = wanted
    out = []
    for i, (lo, hi) in enumerate(pieces):
        lo2, hi2 = max(a, lo), min(b, hi)
        if lo2 < hi2:
            out.append((i, lo2 - lo, hi2 - lo))
    covered = sum(hi - lo for _, lo, hi in out)
    if covered != b - a:
        raise BatchSplitError(f"rows {wanted} are not covered by the sending replicas {pieces}")
    return out
