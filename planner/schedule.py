"""Schedules by name, and the two at the root of the others: GPipe and DAPPLE's early backward.

The names a plan may carry (`SCHEDULES`; `build_schedule` makes any of them):

* "gpipe": all forwards, then all backwards (K_i = M);
* "1f1b": DAPPLE's early backward (§III-B, §V-C): stage i runs K_i forwards, then strictly
  alternates one backward and one forward until its forwards are exhausted, then runs the
  remaining backwards. K_i = min(S - i, M) unless the plan's `warmup` says otherwise (the
  planner writes its choice there: policy A's depths, policy B's, capped by memory);
* "interleaved": Megatron's interleaved 1F1B over v chunks per position (`planner.interleaved`);
* "zb-h1": zero-bubble ZB-H1, backwards split into I and W (`planner.zero_bubble`); warm-up as
  "1f1b"'s.

Relaxed schedules (`RELAXED_SCHEDULES`, opt-in: stale or averaged weights) run `batches`
consecutive global batches in one list with the weight updates in it (`planner.multi_batch`):

* "pipedream": 1F1B over all their micro-batches, an update after every backward, weight
  stashing (optionally vertical sync); warm-up as "1f1b"'s;
* "2bw": PipeDream-2BW, 1F1B over all their micro-batches, an update per global batch, two
  weight versions; warm-up as "1f1b"'s;
* "avgpipe": AvgPipe's pipeline, 1F1B with `advance` forwards ahead (`planner.avgpipe`), an
  update per global batch, a flush between batches.

`build_schedule("1f1b", ..., batches=k)` is 1F1B with a flush per batch over k batches, what the
relaxed schedules are compared with; plans of the synchronous schedules run one batch.

The warm-up policies of early backward, also accepted as schedule names (plans written before
the names above; they load and run as 1F1B with that policy's depths):

* policy "A": K_i = min(S - i, M)         (PipeDream-Flush, Megatron's 1F1B; "1f1b"'s default)
* policy "B": K_i = min(2(S - i) - 1, M)

A memory limit D (micro-batches whose activations fit on a device) caps K_i further; the planner
writes the capped depths into the plan's schedule (`warmup`).

Correctness condition: K_i >= K_{i+1} >= 1 and K_i <= M. With it, replaying all stages
together never deadlocks (`planner.replay` checks this, and tests check it).

The lists hold compute actions only (`planner.actions`); `planner.lowering` adds the data
movement, and the runtime and the simulator both run its output.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

from planner.actions import (BACKWARD, BACKWARD_WEIGHT, FORWARD, Action, Schedule,
                             ScheduleError, one_chunk_per_position)
from planner.avgpipe import advance_depths
from planner.interleaved import INTERLEAVED, interleaved_schedule
from planner.multi_batch import (AVGPIPE, DEFAULT_BATCHES, PIPEDREAM, RELAXED_SCHEDULES, TWO_BW,
                                 check_batches, flushed, pipedream, two_bw)
from planner.zero_bubble import ZERO_BUBBLE_H1, zb_h1_schedule

POLICIES = ("A", "B", "gpipe")           # warm-up policies of GPipe and early backward
GPIPE, ONE_F_ONE_B = "gpipe", "1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE_H1)
EARLY_BACKWARD = (ONE_F_ONE_B, "A", "B")   # one schedule; "A" and "B" name its warm-up policies
NAMES = SCHEDULES + ("A", "B") + RELAXED_SCHEDULES   # every name a plan may carry
FORWARD_BACKWARD = (GPIPE,) + EARLY_BACKWARD   # one chunk per position, backwards unsplit
# Those a plan's `warmup` may set; all but gpipe warm up as early backward does.
WARMUP_SCHEDULES = FORWARD_BACKWARD + (ZERO_BUBBLE_H1, PIPEDREAM, TWO_BW)
RUNTIME_SCHEDULES = FORWARD_BACKWARD + (INTERLEAVED, ZERO_BUBBLE_H1) + RELAXED_SCHEDULES  # runs


def warmup_depths(policy: str, num_stages: int, micro_batches: int,
                  memory_limit: Optional[int] = None) -> List[int]:
    """K_i for every stage under `policy` ("1f1b", "zb-h1", "pipedream" and "2bw" default to
    policy A), capped by `memory_limit` (D) when given."""
    S, M = num_stages, micro_batches
    if policy in ("A", ONE_F_ONE_B, ZERO_BUBBLE_H1, PIPEDREAM, TWO_BW):
        ks = [min(S - i, M) for i in range(S)]
    elif policy == "B":
        ks = [min(2 * (S - i) - 1, M) for i in range(S)]
    elif policy == "gpipe":
        ks = [M] * S
    else:
        raise ScheduleError(f"unknown warm-up policy {policy!r}; use 'A', 'B', '1f1b' or "
                            f"'gpipe'")
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
    if policy not in FORWARD_BACKWARD:
        raise ScheduleError(f"unknown schedule {policy!r}; use one of {FORWARD_BACKWARD}")
    ks = list(warmup) if warmup is not None else warmup_depths(policy, num_stages, micro_batches)
    if len(ks) != num_stages:
        raise ScheduleError(f"{len(ks)} warmup depths for {num_stages} stages")
    check_warmup(ks, micro_batches)
    return one_chunk_per_position(
        [stage_actions(s, micro_batches, k) for s, k in enumerate(ks)], policy)


def build_schedule(name: str, num_positions: int, micro_batches: int,
                   warmup: Optional[Sequence[int]] = None,
                   virtual_stages: Optional[int] = None, batches: Optional[int] = None,
                   advance: Optional[int] = None, vertical_sync: bool = False) -> Schedule:
    """The compute actions of schedule `name` on `num_positions` positions (stages, or for
    "interleaved" devices holding `virtual_stages` chunks each); `batches` global batches of
    `micro_batches` for the relaxed schedules (default DEFAULT_BATCHES) and "1f1b". The same
    parameters give the same (immutable) schedule, so what is derived from it (its lowering,
    `planner.replay.checked_lowering`) is computed once."""
    return _built(name, num_positions, micro_batches,
                  None if warmup is None else tuple(warmup), virtual_stages, batches, advance,
                  vertical_sync)


@functools.lru_cache(maxsize=64)
def _built(name: str, num_positions: int, micro_batches: int, warmup: Optional[Tuple[int, ...]],
           virtual_stages: Optional[int], batches: Optional[int], advance: Optional[int],
           vertical_sync: bool) -> Schedule:
    if name not in NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; use one of "
                            f"{SCHEDULES + RELAXED_SCHEDULES}")
    if name in RELAXED_SCHEDULES or (batches is not None and name == ONE_F_ONE_B):
        return _over_batches(name, num_positions, micro_batches, warmup, batches, advance,
                             vertical_sync)
    if batches is not None:
        raise ScheduleError(f"schedule {name!r} runs one global batch; batches applies to "
                            f"{', '.join(RELAXED_SCHEDULES)} (and 1f1b, to compare them)")
    if warmup is not None and name not in WARMUP_SCHEDULES:
        raise ScheduleError(f"schedule {name!r} fixes its own warm-up; 'warmup' applies to "
                            f"{WARMUP_SCHEDULES} only")
    if virtual_stages not in (None, 1) and name != INTERLEAVED:
        raise ScheduleError(f"schedule {name!r} runs one chunk per position; virtual_stages "
                            f"= {virtual_stages} needs schedule {INTERLEAVED!r}")
    if name == INTERLEAVED:
        if virtual_stages is None:
            raise ScheduleError(f"schedule {INTERLEAVED!r} needs virtual_stages (chunks per "
                                f"position), e.g. 2")
        return interleaved_schedule(num_positions, micro_batches, virtual_stages)
    if name == ZERO_BUBBLE_H1:
        if warmup is not None:
            check_warmup(warmup, micro_batches)
        return zb_h1_schedule(num_positions, micro_batches, warmup)
    return pipeline_schedule(num_positions, micro_batches, name, warmup)


def _over_batches(name: str, S: int, M: int, warmup: Optional[Sequence[int]],
                  batches: Optional[int], advance: Optional[int],
                  vertical_sync: bool) -> Schedule:
    """A relaxed schedule, or 1F1B with a flush per batch, over `batches` global batches."""
    k = DEFAULT_BATCHES if batches is None else batches
    check_batches(k)
    if advance is not None and name != AVGPIPE:
        raise ScheduleError(f"advance (forwards ahead) applies to {AVGPIPE!r}, not {name!r}")
    if vertical_sync and name != PIPEDREAM:
        raise ScheduleError(f"vertical_sync applies to {PIPEDREAM!r}, not {name!r}")
    if name == AVGPIPE:
        if warmup is not None:
            raise ScheduleError(f"schedule {AVGPIPE!r} fixes its own warm-up by advance "
                                f"(forwards ahead of 1F1B's); remove warmup")
        depths = advance_depths(S, M, advance or 0)
        return flushed(pipeline_schedule(S, M, ONE_F_ONE_B, depths), k, AVGPIPE, averaging=True)
    ks = list(warmup) if warmup is not None else warmup_depths(name, S, M)
    if len(ks) != S:
        raise ScheduleError(f"{len(ks)} warmup depths for {S} stages")
    check_warmup(ks, M)
    if name == ONE_F_ONE_B:
        return flushed(pipeline_schedule(S, M, name, ks), k)
    order = pipeline_schedule(S, k * M, ONE_F_ONE_B, ks)
    return two_bw(order, M, k) if name == TWO_BW else pipedream(order, k, vertical_sync)


def plan_schedule(plan) -> Schedule:
    """The compute actions of a `planner.plan.Plan`'s schedule (its stages are the chunks)."""
    v = plan.virtual_stages if plan.schedule == INTERLEAVED else None
    positions = plan.num_stages // (v or 1)
    warmup = plan.warmup
    if warmup is None and plan.schedule in WARMUP_SCHEDULES:
        warmup = warmup_depths(plan.schedule, positions, plan.micro_batches)
    relaxed = {} if plan.schedule not in RELAXED_SCHEDULES else dict(
        batches=plan.batches, advance=plan.advance, vertical_sync=bool(plan.vertical_sync))
    return build_schedule(plan.schedule, positions, plan.micro_batches, warmup, v, **relaxed)


def first_backward_depths(schedule: Schedule) -> List[int]:
    """Per position, the forwards it runs before its first backward (B or I): the warm-up
    depth K of any schedule."""
    depths = []
    for lst in schedule.lists:
        compute = [a for a in lst if a.is_compute]
        first = next((i for i, a in enumerate(compute) if a.kind != FORWARD
                      and a.kind != BACKWARD_WEIGHT), len(compute))
        depths.append(sum(1 for a in compute[:first] if a.kind == FORWARD))
    return depths


def runtime_supported(name: str) -> bool:
    """Whether the dapple runtime (graph_rewrite) runs schedule `name` today."""
    return name in RUNTIME_SCHEDULES


def require_runtime_support(plan) -> None:
    """Raise `ScheduleError` before any building when the runtime cannot run `plan`'s schedule
    (the planner and simulator know more schedules than the runtime runs)."""
    if not runtime_supported(plan.schedule):
        raise ScheduleError(
            f"the plan's schedule {plan.schedule!r} is not one the dapple runtime runs (it runs "
            f"{', '.join(RUNTIME_SCHEDULES)}); re-plan with `dapple plan --schedule=1f1b` (or "
            f"gpipe), or set \"schedule\": {{\"name\": \"1f1b\"}} in the plan")
