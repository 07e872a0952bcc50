"""Schedules by name: the compute actions of a name or a plan, and the warm-up depths of one.

Every schedule is a spec in `planner.schedules` (one module each, one registry); this module
is what the rest of dapple calls with a name or a plan:

* "gpipe": all forwards, then all backwards (K_i = M);
* "1f1b": DAPPLE's early backward (§III-B, §V-C): stage i runs K_i forwards, then strictly
  alternates one backward and one forward until its forwards are exhausted, then runs the
  remaining backwards. K_i = min(S - i, M) unless the plan's `warmup` says otherwise (the
  planner writes its choice there: policy A's depths, policy B's, capped by memory);
* "interleaved": Megatron's interleaved 1F1B over v chunks per position
  (`planner.schedules.interleaved`);
* "zb-h1": zero-bubble ZB-H1, backwards split into I and W (`planner.schedules.zb_h1`); warm-up as
  "1f1b"'s.

Relaxed schedules (opt-in: stale or averaged weights) run `batches` consecutive global batches
in one list with the weight updates in it (`planner.schedules.relaxed_lists`):

* "pipedream": 1F1B over all their micro-batches, an update after every backward, weight
  stashing (optionally vertical sync); warm-up as "1f1b"'s;
* "2bw": PipeDream-2BW, 1F1B over all their micro-batches, an update per global batch, two
  weight versions; warm-up as "1f1b"'s;
* "avgpipe": AvgPipe's pipeline, 1F1B with `advance` forwards ahead (`planner.schedules.avgpipe_pipelines`), an
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
together never deadlocks (`planner.schedules.replay` checks this, and tests check it).

The lists hold compute actions only (`planner.schedules.actions`); `planner.schedules.lowering` adds the data
movement, and the runtime and the simulator both run its output.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

from planner import schedules
from planner.schedules.actions import BACKWARD_WEIGHT, FORWARD, Schedule, ScheduleError
from planner.schedules.forward_backward import (  # noqa: F401  (imported from here)
    check_warmup, forward_backward_schedule, stage_actions)

SCHEDULES = schedules.names(relaxed=False)   # the synchronous schedules, in the registry's order


def warmup_depths(policy: str, num_stages: int, micro_batches: int,
                  memory_limit: Optional[int] = None) -> List[int]:
    """K_i for every stage under `policy` (a schedule that takes a warm-up: "1f1b", "zb-h1",
    "pipedream" and "2bw" default to policy A), capped by `memory_limit` (D) when given."""
    spec = schedules.find(policy)
    ks = spec.default_warmup(num_stages, micro_batches) if spec is not None else None
    if ks is None:
        raise ScheduleError(f"unknown warm-up policy {policy!r}; use one of "
                            f"{', '.join(map(repr, schedules.takers('warmup')))}")
    if memory_limit is not None:
        if memory_limit < 1:
            raise ScheduleError(f"memory limit D must allow at least one micro-batch, got "
                                f"{memory_limit}")
        ks = [min(k, memory_limit) for k in ks]
    return ks


def pipeline_schedule(num_stages: int, micro_batches: int, policy: str = "A",
                      warmup: Optional[Sequence[int]] = None) -> Schedule:
    """GPipe or early backward for `num_stages` stages (stage s runs on position s)."""
    spec = schedules.find(policy)
    if spec is None or not spec.formula:
        raise ScheduleError(f"unknown schedule {policy!r}; use one of "
                            f"{schedules.names(legacy=True, formula=True)}")
    return spec.actions(num_stages, micro_batches, warmup)


def build_schedule(name, num_positions: int, micro_batches: int,
                   warmup: Optional[Sequence[int]] = None,
                   virtual_stages: Optional[int] = None, batches: Optional[int] = None,
                   advance: Optional[int] = None, vertical_sync: bool = False) -> Schedule:
    """The compute actions of schedule `name` (a name or a spec) on `num_positions` positions
    (stages, or for "interleaved" devices holding `virtual_stages` chunks each); `batches`
    global batches of `micro_batches` for the relaxed schedules (default DEFAULT_BATCHES) and
    "1f1b". The same parameters give the same (immutable) schedule, so what is derived from it
    (its lowering, `planner.schedules.replay.checked_lowering`) is computed once."""
    key = name.name if isinstance(name, schedules.ScheduleSpec) else name
    return _built(key, num_positions, micro_batches,
                  None if warmup is None else tuple(warmup), virtual_stages, batches, advance,
                  vertical_sync)


@functools.lru_cache(maxsize=64)
def _built(name: str, num_positions: int, micro_batches: int, warmup: Optional[Tuple[int, ...]],
           virtual_stages: Optional[int], batches: Optional[int], advance: Optional[int],
           vertical_sync: bool) -> Schedule:
    return schedules.build(name, num_positions, micro_batches, warmup, virtual_stages, batches,
                           advance, vertical_sync)


def plan_schedule(plan) -> Schedule:
    """The compute actions of a `planner.formats.plan.Plan`'s schedule (its stages are the chunks)."""
    spec = schedules.get(plan.schedule)
    v = plan.virtual_stages if spec.takes("virtual_stages") else None
    positions = plan.num_stages // (v or 1)
    warmup = plan.warmup
    if warmup is None and spec.takes_warmup:
        warmup = spec.default_warmup(positions, plan.micro_batches)
    relaxed = {} if not spec.relaxed else dict(
        batches=plan.batches, advance=plan.advance, vertical_sync=bool(plan.vertical_sync))
    return build_schedule(spec, positions, plan.micro_batches, warmup, v, **relaxed)


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


def runtime_supported(name, runtime: Optional[str] = None) -> bool:
    """Whether a dapple runtime (`runtime`, else any) runs schedule `name` today."""
    spec = schedules.coerce(name)
    return bool(spec.runtimes) and (runtime is None or runtime in spec.runtimes)


def require_runtime_support(plan, runtime: Optional[str] = None) -> None:
    """Raise `ScheduleError` before any building when the runtime cannot run `plan`'s schedule
    (the planner and simulator may know more schedules than the runtime runs)."""
    if not runtime_supported(plan.schedule, runtime):
        runs = [s.name for s in schedules.specs(legacy=True)
                if runtime is None or runtime in s.runtimes]
        default = schedules.DEFAULT.name
        others = ", ".join(schedules.names(formula=True, early_backward=False))
        raise ScheduleError(
            f"the plan's schedule {schedules.coerce(plan.schedule).name!r} is not one the dapple "
            f"runtime runs (it runs {', '.join(runs)}); re-plan with `dapple plan "
            f"--schedule={default}` (or {others}), or set \"schedule\": {{\"name\": "
            f"\"{default}\"}} in the plan")
