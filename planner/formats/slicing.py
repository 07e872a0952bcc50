"""Which rows of a global batch each (stage, replica, micro-batch) unit holds: one rule for the
plan, the planner and both runtimes.

A global batch of N rows is cut into M micro-batches of n = N / M rows; a stage with R replicas
gives replica r the rows [r n // R, (r + 1) n // R) of each micro-batch (DAPPLE §V-B2). Slices
differ by at most one row, which lets plans express the paper's 15:1 of a 2048 batch; the
runtimes need them equal (N divisible by M x R for every stage, `check_even`). Rows are
contiguous, so a boundary between stages of different replica counts moves row ranges: a
concat, a split, both, or nothing when the counts are equal (`overlaps`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

Rows = Tuple[int, int]          # [start, stop)


class BatchSplitError(ValueError):
    """A batch that cannot be cut as the plan says; the message says what to change."""


def replica_rows(rows: int, replicas: int, replica: int) -> Rows:
    """[start, stop) of `replica`'s share of a micro-batch of `rows` rows."""
    return replica * rows // replicas, (replica + 1) * rows // replicas


def slice_sizes(rows: int, replicas: int) -> List[int]:
    """Rows of each replica's share of a micro-batch of `rows` rows."""
    return [hi - lo for lo, hi in (replica_rows(rows, replicas, r) for r in range(replicas))]


def unit_rows(global_batch: int, micro_batches: int, replicas: int, micro_batch: int,
              replica: int) -> Rows:
    """[start, stop) rows of the global batch for one unit."""
    n = global_batch // micro_batches
    lo, hi = replica_rows(n, replicas, replica)
    return micro_batch * n + lo, micro_batch * n + hi


def check_even(global_batch: int, micro_batches: int, replicas: Sequence[int]) -> None:
    """Refuse a global batch that does not cut into equal slices for every stage."""
    for s, r in enumerate(replicas):
        unit = micro_batches * r
        if global_batch % unit:
            raise BatchSplitError(
                f"global batch {global_batch} does not divide into {micro_batches} micro-batches "
                f"x {r} replicas of stage {s} (= {unit} equal slices): use a batch size that is a "
                f"multiple of {unit}, or a plan with other micro_batches (`dapple plan "
                f"--even_slices` only proposes plans whose slices are equal)")


def overlaps(wanted: Rows, pieces: List[Rows]) -> List[Tuple[int, int, int]]:
    """For a wanted row range, the (piece index, start, stop) rows to take from each piece,
    start/stop relative to that piece, in row order."""
    a, b = wanted
    out = []
    for i, (lo, hi) in enumerate(pieces):
        lo2, hi2 = max(a, lo), min(b, hi)
        if lo2 < hi2:
            out.append((i, lo2 - lo, hi2 - lo))
    if sum(hi - lo for _, lo, hi in out) != b - a:
        raise BatchSplitError(f"rows {wanted} are not covered by the sending replicas {pieces}")
    return out


def overlap(a: Rows, b: Rows) -> int:
    """How many rows two ranges share."""
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))
