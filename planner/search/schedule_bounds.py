"""A lower bound on a synchronous schedule's simulated iteration from its durations alone, so
that `planner.search.schedule_choice` need not simulate a schedule that cannot beat one it has.

A position runs one action at a time, so the iteration lasts at least, on every position p,
start + work + after:

* start: p's first action is a forward, which waits for the forwards (and the forward
  transfers between positions) of every earlier chunk, for one micro-batch;
* work: the forwards and backwards of p's chunks, every micro-batch, and their allreduces;
* after: once p's last backward (of some chunk c on p) ends, the backwards of chunks c-1 .. 0
  of that micro-batch (and the backward transfers between positions) follow, then chunk 0's
  allreduce: the least of that over p's chunks, or p's allreduces when they take longer (they
  are in `work` but may all come last). A split backward may end in W, which nothing waits
  for: then only the allreduces count.

Every transfer lasts at least its duration whatever the link model, and a rendezvous only
delays it, so the bound holds for every link model (`planner.estimate.simulator`).
"""
from __future__ import annotations

from typing import Sequence

from planner.estimate.pipeline_costs import PipelineCosts


def iteration_lower_bound(costs: PipelineCosts, placement: Sequence[int], micro_batches: int,
                          split_backward: bool = False) -> float:
    """Least simulated iteration (ms) of `micro_batches` through chunks placed on positions by
    `placement` (chunk -> position), whatever the order of each position's list."""
    C = len(placement)
    crosses = [placement[c] != placement[c + 1] for c in range(C - 1)]
    start, back = [0.0] * C, [0.0] * C     # before chunk c's first forward; after its backward
    for c in range(1, C):
        start[c] = start[c - 1] + costs.forward_ms[c - 1] + \
            (costs.send_forward_ms[c - 1] if crosses[c - 1] else 0.0)
        back[c] = back[c - 1] + costs.backward_ms[c - 1] + \
            (costs.send_backward_ms[c - 1] if crosses[c - 1] else 0.0)
    bound = 0.0
    for p in sorted(set(placement)):
        chunks = [c for c in range(C) if placement[c] == p]
        work = sum(micro_batches * (costs.forward_ms[c] + costs.backward_ms[c])
                   for c in chunks)
        allreduce = sum(costs.allreduce_ms[c] for c in chunks)
        after = allreduce if split_backward else \
            max(allreduce, min(back[c] for c in chunks) + costs.allreduce_ms[0])
        bound = max(bound, start[chunks[0]] + work + after)
    return bound
