"""The lists GPipe and early backward share (and the schedules built on 1F1B's order): each stage
runs K_i forwards, then alternates one backward and one forward until its forwards are
exhausted, then the remaining backwards. K_i = M is GPipe; the warm-up policies of early
backward (DAPPLE §III-B, §V-C) choose smaller depths:

* policy A: K_i = min(S - i, M)         (PipeDream-Flush, Megatron's 1F1B; "1f1b"'s default)
* policy B: K_i = min(2(S - i) - 1, M)

A memory limit D (micro-batches whose activations fit on a device) caps K_i further.
Correctness condition: K_i >= K_{i+1} >= 1 and K_i <= M. With it, replaying all stages together
never deadlocks (`planner.schedules.replay` checks this, and tests check it).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from planner.schedules.actions import BACKWARD, FORWARD, Action, Schedule, ScheduleError, \
    one_chunk_per_position, micro_batch_actions
from planner.schedules.base import ScheduleSpec


def policy_a_depths(num_stages: int, micro_batches: int) -> List[int]:
    return [min(num_stages - i, micro_batches) for i in range(num_stages)]


def policy_b_depths(num_stages: int, micro_batches: int) -> List[int]:
    return [min(2 * (num_stages - i) - 1, micro_batches) for i in range(num_stages)]


def check_warmup(warmup: Sequence[int], micro_batches: int) -> None:
    for i, k in enumerate(warmup):
        if not 1 <= k <= micro_batches:
            raise ScheduleError(f"warmup K_{i} = {k} must be between 1 and micro_batches "
                                f"({micro_batches})")
    for i in range(len(warmup) - 1):
        if warmup[i] < warmup[i + 1]:
            raise ScheduleError(
                f"warmup K_{i} = {warmup[i]} < K_{i + 1} = {warmup[i + 1]}: a stage must warm "
                f"up at least as deep as the next one, or stage {i} waits for a backward "
                f"that needs a forward it has not run yet")


def stage_actions(stage: int, micro_batches: int, warmup: int) -> List[Action]:
    """One stage's list: `warmup` forwards, then alternate B/F, then the remaining Bs."""
    M, K = micro_batches, warmup
    if not 1 <= K <= M:
        raise ScheduleError(f"warmup depth {K} must be in 1..{M}")
    forward, backward = (micro_batch_actions(stage, kind, M) for kind in (FORWARD, BACKWARD))
    out = forward[:K]
    next_forward, next_backward = K, 0
    while next_backward < M:
        out.append(backward[next_backward])
        next_backward += 1
        if next_forward < M:
            out.append(forward[next_forward])
            next_forward += 1
    return out


def checked_depths(warmup: Sequence[int], num_stages: int, micro_batches: int) -> List[int]:
    ks = list(warmup)
    if len(ks) != num_stages:
        raise ScheduleError(f"{len(ks)} warmup depths for {num_stages} stages")
    check_warmup(ks, micro_batches)
    return ks


def given_or_default(spec: "ScheduleSpec", warmup: Optional[Sequence[int]], num_stages: int,
                     micro_batches: int) -> List[int]:
    """`warmup` if given, else `spec`'s default depths; checked either way."""
    return checked_depths(warmup if warmup is not None else
                          spec.default_warmup(num_stages, micro_batches),
                          num_stages, micro_batches)


def forward_backward_schedule(num_stages: int, micro_batches: int, warmup: Sequence[int],
                              name: str) -> Schedule:
    """Stage s (on position s) warms up K_s = warmup[s] deep, then alternates B and F."""
    ks = checked_depths(warmup, num_stages, micro_batches)
    return one_chunk_per_position(
        [stage_actions(s, micro_batches, k) for s, k in enumerate(ks)], name)


class ForwardBackwardSpec(ScheduleSpec):
    """GPipe or early backward: one chunk per position, backwards whole, eq. 1-3 apply."""

    takes_warmup = True
    formula = True

    def actions(self, num_positions: int, micro_batches: int,
                warmup: Optional[Sequence[int]] = None,
                virtual_stages: Optional[int] = None) -> Schedule:
        ks = given_or_default(self, warmup, num_positions, micro_batches)
        return forward_backward_schedule(num_positions, micro_batches, ks, self.name)
