"""Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): every backward
splits into I, the input gradient the previous stage waits for, and W, the weight gradient,
which nothing downstream waits for. Stages run I as soon as they can and move W into what
would be bubbles.

Stage s of S runs 1F1B's order (K_s forwards, then one backward and one forward in turn) with
each backward replaced by I, and the W of micro-batch j placed right after the I of micro-batch
j + s (the remaining Ws at the end):

    F0 .. F(K-1), then for j = 0 .. M-1:  I(j), W(j - s) when j >= s, F(K + j) when one is left

K_s is 1F1B's warm-up depth: the paper's min(S - s, M) by default, or the depths a plan gives
(the planner gives zb-h1 those it chose for early backward, DAPPLE's policy B when transfers are
slow); I and F keep 1F1B's order, so whatever warm-up 1F1B runs without deadlock, ZB-H1 does.

The last stage, which 1F1B keeps busiest at the end, defers the most Ws; the first defers none.
With F = I = W the bubble is (S - 1)(F + I - W) = (S - 1) F per stage, a third of 1F1B's
(S - 1)(F + B). Micro-batches whose forward ran and whose I has not (the full activations) peak
at K_s on stage s, as in 1F1B with the same depths; up to s + 1 more await their W (s of them deferred), holding only
what W reads (the layers' inputs and output gradients, `planner.schedules.memory`). Counted from
forward to W, with the default depths every stage has min(S, M) micro-batches in flight, 1F1B's
first-stage peak.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from planner.schedules.actions import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action, Schedule,
                             ScheduleError, micro_batch_actions)
from planner.schedules.base import ScheduleSpec
from planner.schedules.forward_backward import check_warmup, policy_a_depths


def stage_actions(stage: int, micro_batches: int, warmup: int) -> List[Action]:
    """Stage `stage`'s ZB-H1 list after `warmup` forwards (see the module docstring)."""
    M, K = micro_batches, warmup
    forward, input_gradient, weight_gradient = (
        micro_batch_actions(stage, kind, M) for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
    out = forward[:K]
    weights_done = 0
    for j in range(M):
        out.append(input_gradient[j])
        if j >= stage:           # W waits `stage` micro-batches behind its I
            out.append(weight_gradient[weights_done])
            weights_done += 1
        if K + j < M:
            out.append(forward[K + j])
    out += weight_gradient[weights_done:]
    return out


def zb_h1_schedule(num_stages: int, micro_batches: int,
                   warmup: Optional[Sequence[int]] = None,
                   name: Optional[str] = None) -> Schedule:
    """ZB-H1 for `num_stages` stages (stage s runs on position s) after `warmup` forwards per
    stage (default min(S - s, M); other depths as `planner.schedules.by_name.check_warmup` accepts);
    named as the spec below unless `name` says otherwise."""
    for what, value in (("stages", num_stages), ("micro-batches", micro_batches)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"zb-h1 schedule: {what} must be a positive integer, "
                                f"got {value!r}")
    ks = list(warmup) if warmup is not None else \
        [min(num_stages - s, micro_batches) for s in range(num_stages)]
    if len(ks) != num_stages:
        raise ScheduleError(f"{len(ks)} warmup depths for {num_stages} stages")
    lists = tuple(tuple(stage_actions(s, micro_batches, k)) for s, k in enumerate(ks))
    return Schedule(name or ZeroBubbleH1.name, tuple(range(num_stages)), lists)


class ZeroBubbleH1(ScheduleSpec):
    name = "zb-h1"
    summary = "zero bubble H1: backwards split into input (I) and weight (W) gradients"
    takes_warmup = True
    planner_warmup = True
    split_backward = True
    tie_rank = 2

    def default_warmup(self, num_stages: int, micro_batches: int) -> List[int]:
        return policy_a_depths(num_stages, micro_batches)

    def actions(self, num_positions: int, micro_batches: int,
                warmup: Optional[Sequence[int]] = None,
                virtual_stages: Optional[int] = None) -> Schedule:
        if warmup is not None:
            check_warmup(warmup, micro_batches)
        return zb_h1_schedule(num_positions, micro_batches, warmup, self.name)


ZERO_BUBBLE_H1 = ZeroBubbleH1()
