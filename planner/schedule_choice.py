"""Choosing a plan's schedule: every schedule on the same device groups and micro-batches,
simulated with the cost model's durations, its memory per device from its action lists; `auto`
takes the fastest that fits in device memory.

The search (`planner.plan_space`) plans under early backward ("1f1b"); the others are derived
from its plan: "gpipe" and "zb-h1" keep the stages, "interleaved" re-cuts the layers into
chunks (`planner.chunking`). Each is finished (`planner.finish.finish_plan`: estimate, memory),
then simulated (`planner.simulator`), so all are compared by simulated iterations, the formula
(eq. 1-3) describing early backward only. Memory per device is the cost model's
(`PlanCosts.memory`): weights, then the peak of what the schedule's lists hold
(`planner.schedule_memory`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from planner.chunking import interleave_plan
from planner.cost_model import PlanCosts
from planner.finish import finish_plan
from planner.plan import Plan, PlanError
from planner.profile import Profile
from planner.schedule import (EARLY_BACKWARD, GPIPE, INTERLEAVED, ONE_F_ONE_B, SCHEDULES,
                              ZERO_BUBBLE_H1, runtime_supported)
from planner.simulator import SimulationResult

AUTO = "auto"
CHOICES = (AUTO,) + SCHEDULES
DEFAULT_VIRTUAL_STAGES = 2
# Equal iterations: the schedule the runtime runs, then the one holding less.
TIE_ORDER = (ONE_F_ONE_B, GPIPE, ZERO_BUBBLE_H1, INTERLEAVED)


@dataclass
class ScheduleOption:
    """One schedule for one plan; `plan` None when it cannot be made (`note` says why)."""
    name: str
    plan: Optional[Plan] = None
    simulation: Optional[SimulationResult] = None
    memory_bytes: List[float] = field(default_factory=list)    # per device group
    device_memory_bytes: float = 0.0
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None and all(m <= self.device_memory_bytes
                                              for m in self.memory_bytes)

    @property
    def iteration_ms(self) -> Optional[float]:
        return self.simulation.iteration_ms if self.simulation is not None else None

    @property
    def runtime_supported(self) -> bool:
        return runtime_supported(self.name)


def with_schedule(plan: Plan, name: str) -> Plan:
    """`plan` (one stage per device group) under gpipe, 1f1b or zb-h1: the same stages, the
    warm-up depths of early backward kept between 1f1b and zb-h1 (the same held micro-batches),
    no estimate. Needs no cost model: per-stage costs stay valid."""
    if plan.num_positions != plan.num_stages:
        raise PlanError(f"the plan is interleaved ({plan.num_stages} chunks on "
                        f"{plan.num_positions} device groups); plan again for another schedule")
    if name not in (GPIPE, ONE_F_ONE_B, ZERO_BUBBLE_H1):
        raise PlanError(f"with_schedule takes gpipe, 1f1b or zb-h1, not {name!r}")
    keep = plan.schedule in EARLY_BACKWARD + (ZERO_BUBBLE_H1,) and name != GPIPE
    return dataclasses.replace(plan, schedule=name, warmup=plan.warmup_depths() if keep else None,
                               virtual_stages=None, estimate=None)


def schedule_plan(plan: Plan, name: str, profile: Profile, topology,
                  virtual_stages: Optional[int] = None) -> Tuple[Plan, PlanCosts]:
    """(`plan`, one stage per device group, under schedule `name`, finished; its costs)."""
    if name == INTERLEAVED:
        if plan.num_positions != plan.num_stages:
            raise PlanError("the plan is interleaved already; plan again to re-cut it")
        variant = interleave_plan(plan, profile, topology,
                                  virtual_stages or DEFAULT_VIRTUAL_STAGES)
    elif name in SCHEDULES:
        variant = with_schedule(plan, name)
    else:
        raise PlanError(f"unknown schedule {name!r}; use one of {CHOICES}")
    costs = PlanCosts(variant, profile, topology)
    return finish_plan(variant, profile, topology, keep_warmup=True, costs=costs), costs


def schedule_options(plan: Plan, profile: Profile, topology,
                     virtual_stages: Optional[int] = None,
                     names: Sequence[str] = SCHEDULES) -> List[ScheduleOption]:
    """Each schedule of `names` on `plan`'s device groups, simulated and sized."""
    out = []
    for name in names:
        option = ScheduleOption(name, device_memory_bytes=topology.device_memory_bytes)
        try:
            option.plan, costs = schedule_plan(plan, name, profile, topology, virtual_stages)
        except PlanError as e:
            option.note = str(e)
            out.append(option)
            continue
        option.memory_bytes = costs.memory()[:option.plan.num_positions]
        option.simulation = costs.simulation()
        if not option.fits:
            worst = max(range(len(option.memory_bytes)), key=option.memory_bytes.__getitem__)
            option.note = (f"needs {option.memory_bytes[worst] / 2**30:.2f} GiB per device on "
                           f"device group {worst}, more than the "
                           f"{topology.device_memory_bytes / 2**30:.2f} GiB available")
        out.append(option)
    return out


def fastest(options: Sequence[ScheduleOption]) -> ScheduleOption:
    """The option with the least simulated iteration among those that fit (ties: TIE_ORDER)."""
    fitting = [o for o in options if o.fits]
    if not fitting:
        raise PlanError("no schedule fits in device memory: " +
                        "; ".join(f"{o.name}: {o.note}" for o in options))
    best = min(o.iteration_ms for o in fitting)
    tied = [o for o in fitting if o.iteration_ms <= best * (1 + 1e-9)]
    return min(tied, key=lambda o: TIE_ORDER.index(o.name))


def choose_schedule(plan: Plan, profile: Profile, topology, schedule: str = ONE_F_ONE_B,
                    virtual_stages: Optional[int] = None
                    ) -> Tuple[Plan, List[ScheduleOption]]:
    """(`plan` under `schedule`, or under the fastest that fits for "auto"; every option
    compared). An explicit schedule that does not fit in memory is a PlanError."""
    if schedule not in CHOICES:
        raise PlanError(f"unknown schedule {schedule!r}; use one of {CHOICES}")
    if virtual_stages is not None and schedule not in (AUTO, INTERLEAVED):
        raise PlanError(f"virtual_stages applies to the interleaved schedule, not {schedule!r}")
    options = schedule_options(plan, profile, topology, virtual_stages)
    if schedule == AUTO:
        return fastest(options).plan, options
    chosen = next(o for o in options if o.name == schedule)
    if not chosen.fits:
        raise PlanError(f"schedule {schedule!r} on this plan ({plan.shape()}, "
                        f"{plan.micro_batches} micro-batches): {chosen.note}")
    return chosen.plan, options
