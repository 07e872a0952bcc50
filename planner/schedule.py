"""The schedules of today's plans as action lists: GPipe and DAPPLE's early backward.

Early backward (DAPPLE §III-B, §V-C): stage i runs K_i forwards, then strictly alternates one
backward and one forward until its forwards are exhausted, then runs the remaining backwards.

* policy "A": K_i = min(S - i, M)
* policy "B": K_i = min(2(S - i) - 1, M)
* "gpipe":    K_i = M (all forwards, then all backwards)

A memory limit D (micro-batches whose activations fit on a device) caps K_i further; the planner
writes the capped depths into the plan's schedule (`warmup`).

Correctness condition: K_i >= K_{i+1} >= 1 and K_i <= M. With it, replaying all stages
together never deadlocks (`planner.replay` checks this, and tests check it).

The lists hold compute actions only (`planner.actions`); `planner.lowering` adds the data
movement, and the runtime and the simulator both run its output.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from planner.actions import (BACKWARD, FORWARD, Action, Schedule, ScheduleError,
                             one_chunk_per_position)

POLICIES = ("A", "B", "gpipe")


def warmup_depths(policy: str, num_stages: int, micro_batches: int,
                  memory_limit: Optional[int] = None) -> List[int]:
    """K_i for every stage under `policy`, capped by `memory_limit` (D) when given."""
    S, M = num_stages, micro_batches
    if policy == "A":
        ks = [min(S - i, M) for i in range(S)]
    elif policy == "B":
        ks = [min(2 * (S - i) - 1, M) for i in range(S)]
    elif policy == "gpipe":
        ks = [M] * S
    else:
        raise ScheduleError(f"unknown schedule policy {policy!r}; use 'A', 'B' or 'gpipe'")
    if memory_limit is not None:
        if memory_limit < 1:
            raise ScheduleError(f"memory limit D must allow at least one micro-batch, got "
                                f"{memory_limit}")
        ks = [min(k, memory_limit) for k in ks]
    return ks


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
    out = [Action(stage, FORWARD, m) for m in range(K)]
    next_forward, next_backward = K, 0
    while next_backward < M:
        out.append(Action(stage, BACKWARD, next_backward))
        next_backward += 1
        if next_forward < M:
            out.append(Action(stage, FORWARD, next_forward))
            next_forward += 1
    return out


def pipeline_schedule(num_stages: int, micro_batches: int, policy: str = "A",
                      warmup: Optional[Sequence[int]] = None) -> Schedule:
    """GPipe or early backward for `num_stages` stages (stage s runs on position s)."""
    if policy not in POLICIES:
        raise ScheduleError(f"unknown schedule {policy!r}; use one of {POLICIES}")
    ks = list(warmup) if warmup is not None else warmup_depths(policy, num_stages, micro_batches)
    if len(ks) != num_stages:
        raise ScheduleError(f"{len(ks)} warmup depths for {num_stages} stages")
    check_warmup(ks, micro_batches)
    return one_chunk_per_position(
        [stage_actions(s, micro_batches, k) for s, k in enumerate(ks)], policy)


def plan_schedule(plan) -> Schedule:
    """The compute actions of a `planner.plan.Plan`'s schedule."""
    return pipeline_schedule(plan.num_stages, plan.micro_batches, plan.schedule,
                             plan.warmup_depths())
