"""Choosing a plan's schedule: every schedule on the same device groups and micro-batches,
simulated with the cost model's durations, its memory per device from its action lists; `auto`
takes the fastest that fits in device memory.

The search (`planner.search.plan_space`) plans under early backward ("1f1b"); the others are derived
from its plan: "gpipe" and "zb-h1" keep the stages, "interleaved" re-cuts the layers into
chunks (`planner.search.chunking`). Each is finished (`planner.search.plan_finishing.finish_plan`: estimate, memory),
then simulated (`planner.estimate.simulator`), so all are compared by simulated iterations, the formula
(eq. 1-3) describing early backward only. `auto` skips (neither sizes nor simulates) a
schedule whose lower bound (`planner.search.schedule_bounds`) exceeds an iteration it has simulated:
it could not be chosen, so the choice is the one simulating all would make. Memory per device is the cost model's
(`PlanCosts.memory`): weights, then the peak of what the schedule's lists hold
(`planner.schedules.memory`).

The relaxed schedules (pipedream, 2bw, avgpipe: `planner.schedules.relaxed_lists`) are put on the same plan
and compared by simulated time per global batch over `batches` consecutive batches, but `auto`
never takes one: their weights are stale or averaged, which a user opts in to. AvgPipe's
advance is Algorithm 1's: raised one at a time while the simulated run gets faster and fits,
at most ADVANCE_STEPS times (`planner.schedules.avgpipe_pipelines.tune_advance`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

from planner import schedules
from planner.schedules.actions import ScheduleError
from planner.schedules.avgpipe_pipelines import ADVANCE_STEPS, tune_advance
from planner.search.chunking import interleave_plan
from planner.estimate.cost_model import PlanCosts
from planner.search.plan_finishing import finish_plan, settle_warmup
from planner.schedules.relaxed_lists import DEFAULT_BATCHES, check_batches
from planner.formats.plan import Plan, PlanError
from planner.formats.profile import Profile
from planner.schedules.by_name import runtime_supported
from planner.search.schedule_bounds import iteration_lower_bound
from planner.estimate.simulator import SimulationResult

AUTO = "auto"
CHOICES = (AUTO,) + schedules.names()
# Equal iterations: the schedule the runtime runs, then the one holding less (`tie_rank`).
TIE_ORDER = tuple(s.name for s in sorted((s for s in schedules.specs() if s.tie_rank is not None),
                                         key=lambda s: s.tie_rank))


class ScheduleOption:
    """One schedule for one plan; `plan` None when it cannot be made (`note` says why).

    An option from `schedule_options` computes each part when first asked for, in this order:
    the plan under the schedule and its costs (and a lower bound on its iteration,
    `planner.search.schedule_bounds`), its memory, the finished plan (estimate), the simulation.
    Choosing asks only for what the choice needs; a report asks for everything."""

    def __init__(self, name: str, plan: Optional[Plan] = None,
                 simulation: Optional[SimulationResult] = None,
                 memory_bytes: Sequence[float] = (), device_memory_bytes: float = 0.0,
                 note: str = "",
                 make: Optional[Callable[[], Tuple[Plan, PlanCosts]]] = None,
                 finish: Optional[Callable[[Plan, PlanCosts], Plan]] = None, tasks: int = 0,
                 timeline: bool = False):
        self.name, self.device_memory_bytes = name, device_memory_bytes
        self.tasks = tasks      # compute tasks its simulation runs (`schedule_tasks`)
        self.spec = schedules.get(name)
        self._plan, self._simulation, self._note = plan, simulation, note
        self._memory: Optional[List[float]] = list(memory_bytes) if make is None else None
        self._make, self._finish = make, finish
        self._costs: Optional[PlanCosts] = None
        self._timed = False         # `iteration_ms` known from `PlanCosts.timing`
        self._timeline = timeline   # the simulation wanted anyway: `iteration_ms` runs it

    def _made(self) -> Optional[Plan]:
        """The plan under this schedule, unfinished (None when it cannot be made)."""
        if self._make is not None:
            make, self._make = self._make, None
            try:
                self._plan, self._costs = make()
            except PlanError as e:
                self._note, self._memory = str(e), []
        return self._plan

    @property
    def memory_bytes(self) -> List[float]:
        """Per device group."""
        if self._memory is None and self._made() is not None:
            self._memory = self._costs.memory()[:self._plan.num_positions]
            if not self.fits:
                worst = max(range(len(self._memory)), key=self._memory.__getitem__)
                self._note = (f"needs {self._memory[worst] / 2**30:.2f} GiB per device on "
                              f"device group {worst}, more than the "
                              f"{self.device_memory_bytes / 2**30:.2f} GiB available")
        return self._memory or []

    @property
    def note(self) -> str:
        _ = self.memory_bytes       # sizing notes a plan that does not fit
        return self._note

    @property
    def fits(self) -> bool:
        return self._made() is not None and all(m <= self.device_memory_bytes
                                                for m in self.memory_bytes)

    @property
    def plan(self) -> Optional[Plan]:
        """Finished: warm-up, estimate, topology and profile filled."""
        if self._made() is not None and self._finish is not None:
            finish, self._finish = self._finish, None
            self._plan = finish(self._plan, self._costs)
        return self._plan

    @property
    def simulated(self) -> bool:
        """Whether its iteration is known (asking for `simulation` runs the simulator if
        only `iteration_ms` was asked, the same numbers)."""
        return self._simulation is not None or self._timed

    @property
    def simulation(self) -> Optional[SimulationResult]:
        if self._simulation is None and self.plan is not None and self._costs is not None:
            self._simulation = self._costs.simulation()
        return self._simulation

    @property
    def lower_bound_ms(self) -> Optional[float]:
        """No simulated iteration is shorter (None: no bound, e.g. a relaxed schedule)."""
        plan = self._made()
        if plan is None or self._costs is None or self.relaxed:
            return None
        placement = plan.schedule.placement(plan.num_positions, plan.virtual_stages)
        return iteration_lower_bound(self._costs.pipeline, list(placement), plan.micro_batches,
                                     split_backward=plan.schedule.split_backward)

    @property
    def iteration_ms(self) -> Optional[float]:
        """Simulated time per global batch (a relaxed schedule's run over its batches); a
        synchronous schedule's without the timeline (`PlanCosts.timing`) until `simulation`
        is asked for."""
        if self._simulation is None and not self._timeline and not self.relaxed and \
                self.plan is not None and self._costs is not None:
            self._timed = True
            return self._costs.timing().batch_ms
        if self._timeline and self._made() is not None and self._costs is not None:
            self._costs.simulation()    # before finishing: its estimate reads it then
        return self.simulation.batch_ms if self.simulation is not None else None

    @property
    def runtime_supported(self) -> bool:
        return runtime_supported(self.name)

    @property
    def relaxed(self) -> bool:
        return self.spec.relaxed

    @property
    def update_rule(self) -> str:
        return self.spec.update_rule

    def __repr__(self) -> str:
        return f"ScheduleOption({self.name!r}, fits={self.fits}, note={self.note!r})"


def with_schedule(plan: Plan, name: str, batches: Optional[int] = None) -> Plan:
    """`plan` (one stage per device group) under gpipe, 1f1b, zb-h1 or a relaxed schedule: the
    same stages, the warm-up depths of early backward kept among the schedules that take them
    (the same held micro-batches), no estimate; a relaxed schedule over `batches` global
    batches (default: the plan's, else DEFAULT_BATCHES), AvgPipe at advance 0 (1F1B's
    warm-up), PipeDream's vertical sync kept from a pipedream plan. Needs no cost
    model: per-stage costs stay valid (but AvgPipe's, a pipeline per replica, differ)."""
    if plan.num_positions != plan.num_stages:
        raise PlanError(f"the plan is interleaved ({plan.num_stages} chunks on "
                        f"{plan.num_positions} device groups); plan again for another schedule")
    spec = schedules.find(name)
    if spec is None or spec.legacy or spec.rechunks:
        raise PlanError(f"with_schedule takes {', '.join(schedules.names(rechunks=False))}, "
                        f"not {name!r}")
    relaxed = schedules.names(relaxed=True)
    if batches is not None and not spec.takes("batches"):
        raise PlanError(f"batches applies to {', '.join(relaxed)}, not {name!r}")
    try:
        check_batches(DEFAULT_BATCHES if batches is None else batches)
    except ScheduleError as e:
        raise PlanError(str(e)) from None
    keep = plan.schedule.planner_warmup and spec.planner_warmup    # the same depths mean alike
    same = spec == plan.schedule           # a relaxed plan keeps its batches and vertical sync
    variant = dataclasses.replace(
        plan, schedule=spec, warmup=plan.warmup_depths() if keep else None, virtual_stages=None,
        estimate=None,
        batches=(batches or plan.batches or DEFAULT_BATCHES) if spec.takes("batches") else None,
        advance=spec.parameter("advance").default if spec.takes("advance") else None,
        vertical_sync=plan.vertical_sync if same else None)
    return variant.validate()


def schedule_plan(plan: Plan, name: str, profile: Profile, topology,
                  virtual_stages: Optional[int] = None,
                  batches: Optional[int] = None) -> Tuple[Plan, PlanCosts]:
    """(`plan`, one stage per device group, under schedule `name`, finished; its costs)."""
    variant, costs = _variant(plan, name, profile, topology, virtual_stages, batches)
    return finish_plan(variant, profile, topology, keep_warmup=True, costs=costs), costs


def _variant(plan: Plan, name: str, profile: Profile, topology,
             virtual_stages: Optional[int], batches: Optional[int]) -> Tuple[Plan, PlanCosts]:
    """`schedule_plan` before its estimate: the plan under `name`, its warm-up settled."""
    spec = schedules.find(name)
    if spec is None or spec.legacy:
        raise PlanError(f"unknown schedule {name!r}; use one of {CHOICES}")
    if spec.rechunks:
        if plan.num_positions != plan.num_stages:
            raise PlanError("the plan is interleaved already; plan again to re-cut it")
        variant = interleave_plan(plan, profile, topology,
                                  virtual_stages or spec.parameter("virtual_stages").default)
    else:
        variant = with_schedule(plan, name, batches)
    if spec.takes("advance"):   # from early backward's warm-up, as Algorithm 1 from 1F1B's
        start = max(plan.warmup_depths()[0] - plan.num_stages, 0) \
            if plan.schedule.early_backward else 0
        variant.advance = tune_advance(lambda a: _avgpipe_step(variant, a, profile, topology),
                                       variant.micro_batches, ADVANCE_STEPS, start)
    costs = PlanCosts(variant, profile, topology)
    settle_warmup(variant, costs, keep_warmup=True)
    return variant, costs


def _avgpipe_step(plan: Plan, advance: int, profile: Profile, topology) -> Tuple[float, bool]:
    """(simulated time per global batch, fits in memory) of `plan` at `advance`, from one
    batch: with a flush per batch, k batches take k times as long."""
    costs = PlanCosts(dataclasses.replace(plan, advance=advance, batches=1), profile, topology)
    fits = all(m <= topology.device_memory_bytes for m in costs.memory())
    return costs.simulation().batch_ms, fits


def schedule_tasks(plan: Plan, name: str, virtual_stages: Optional[int] = None,
                   batches: Optional[int] = None) -> int:
    """The compute tasks (forwards, backwards; I and W when split) a simulation of `plan`
    (one stage per device group) under schedule `name` runs, known before it is made: a
    measure of what simulating it costs (the lowered lists hold about 4 actions a task)."""
    spec = schedules.get(name)
    chunks = (virtual_stages or spec.parameter("virtual_stages").default) if spec.rechunks else 1
    runs = (batches or plan.batches or DEFAULT_BATCHES) if spec.takes("batches") else 1
    passes = 3 if spec.split_backward else 2
    return plan.micro_batches * plan.num_positions * chunks * runs * passes


def schedule_options(plan: Plan, profile: Profile, topology,
                     virtual_stages: Optional[int] = None,
                     names: Sequence[str] = schedules.names(),
                     batches: Optional[int] = None,
                     timeline: bool = False) -> List[ScheduleOption]:
    """Each schedule of `names` on `plan`'s device groups (the relaxed ones over `batches`
    global batches), made, sized and simulated when first asked; `timeline`: a caller that
    will ask for the simulations (a report) has them run for the iteration too, instead of
    `PlanCosts.timing`'s pass."""
    def finish(variant: Plan, costs: PlanCosts) -> Plan:
        return finish_plan(variant, profile, topology, keep_warmup=True, costs=costs)

    def make(name: str) -> Callable[[], Tuple[Plan, PlanCosts]]:
        return lambda: _variant(plan, name, profile, topology, virtual_stages,
                                batches if schedules.get(name).takes("batches") else None)
    def tasks(name: str) -> int:
        return schedule_tasks(plan, name, virtual_stages,
                              batches if schedules.get(name).takes("batches") else None)
    return [ScheduleOption(name, device_memory_bytes=topology.device_memory_bytes,
                           make=make(name), finish=finish, tasks=tasks(name),
                           timeline=timeline) for name in names]


def fastest(options: Sequence[ScheduleOption]) -> ScheduleOption:
    """The synchronous option with the least simulated iteration among those that fit (ties:
    TIE_ORDER); never a relaxed one. Options are tried from the least lower bound up; one whose
    bound exceeds the best iteration so far can neither win nor tie (the margins are far
    above rounding), so it is neither sized nor simulated."""
    synchronous = [o for o in options if not o.relaxed]
    bounds = {id(o): o.lower_bound_ms for o in synchronous}
    best, fitting = None, []
    for o in sorted(synchronous, key=lambda o: (bounds[id(o)] is not None,
                                                 bounds[id(o)] or 0.0)):
        bound = bounds[id(o)]
        if best is not None and bound is not None and \
                bound * (1 - 1e-9) > best * (1 + 1e-9):
            continue
        if o.fits:
            fitting.append(o)
            best = o.iteration_ms if best is None else min(best, o.iteration_ms)
    if not fitting:
        raise PlanError("no schedule fits in device memory: " +
                        "; ".join(f"{o.name}: {o.note}" for o in options))
    tied = [o for o in fitting if o.iteration_ms <= best * (1 + 1e-9)]
    return min(tied, key=lambda o: TIE_ORDER.index(o.name))


def choose_schedule(plan: Plan, profile: Profile, topology, schedule: str = schedules.DEFAULT.name,
                    virtual_stages: Optional[int] = None, batches: Optional[int] = None,
                    timeline: bool = False) -> Tuple[Plan, List[ScheduleOption]]:
    """(`plan` under `schedule`, or under the fastest synchronous one that fits for "auto";
    every option compared; `timeline` as `schedule_options` takes it). An explicit schedule
    that does not fit in memory is a PlanError."""
    if schedule not in CHOICES:
        raise PlanError(f"unknown schedule {schedule!r}; use one of {CHOICES}")
    spec = None if schedule == AUTO else schedules.get(schedule)
    if virtual_stages is not None and spec is not None and not spec.takes("virtual_stages"):
        raise PlanError(f"virtual_stages applies to the "
                        f"{' or '.join(schedules.takers('virtual_stages'))} schedule, not "
                        f"{schedule!r}")
    if batches is not None and spec is not None and not spec.takes("batches"):
        raise PlanError(f"batches applies to {', '.join(schedules.takers('batches'))}, not "
                        f"{schedule!r}")
    options = schedule_options(plan, profile, topology, virtual_stages, batches=batches,
                               timeline=timeline)
    if schedule == AUTO:
        return fastest(options).plan, options
    chosen = next(o for o in options if o.name == schedule)
    if not chosen.fits:
        raise PlanError(f"schedule {schedule!r} on this plan ({plan.shape()}, "
                        f"{plan.micro_batches} micro-batches): {chosen.note}")
    return chosen.plan, options
