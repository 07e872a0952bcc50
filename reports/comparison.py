"""What a plan is compared with, computed in one place for every report: the alternative plans
(named by `Alternative`), the single-device reference of speedups, GPipe against early backward
on the same plan, and the rows of the HTML/markdown report. The report modules only present.

Speedup is the paper's (§VI-C): the whole global batch on one device divided by a candidate's
time. A candidate's time is its simulated iteration when it was simulated (it includes the
bubbles eq. 1 leaves out), else the formula's latency.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from planner.estimate.cost_model import pipeline_costs
from planner.search.pipedream import plan_pipedream
from planner.formats.plan import Plan, PlanError, Stage
from planner.search.baselines import best_data_parallel_plan, best_straight_plan
from planner.search.plan_space import plan_dapple
from planner.schedules.gpipe import GPIPE
from planner.schedules.one_f_one_b import ONE_F_ONE_B
from planner.search.schedule_choice import ScheduleOption, choose_schedule
from planner.estimate.simulator import SimulationResult, simulate_plan


class Alternative(enum.Enum):
    """A plan the chosen one is compared with; the value is its label in reports."""
    DATA_PARALLEL = "best data parallel"
    STRAIGHT = "best straight"
    PIPEDREAM = "PipeDream"
    PAPER_SPACE = "paper plan space (--plan_space=paper)"
    FULL_SPACE = "full plan space (--plan_space=full)"

    @classmethod
    def other_space(cls, plan_space: str) -> "Alternative":
        """The best plan of the plan space the chosen plan did not come from."""
        return cls.FULL_SPACE if plan_space == "paper" else cls.PAPER_SPACE


# The paper's comparisons (Fig. 12 and 13).
BASELINES = (Alternative.DATA_PARALLEL, Alternative.STRAIGHT, Alternative.PIPEDREAM)


def plan_alternative(alternative: Alternative, profile, topology, global_batch_size: int,
                     memory_limit=None, even_slices: bool = False,
                     transfers: str = "async") -> Plan:
    """The plan of `alternative`, run with `transfers` as the chosen plan is; raises
    PlanError when none is feasible. PipeDream's partition is its own (no even-slices option,
    nor a transfer mode: only its runs are simulated with `transfers`)."""
    gbs = global_batch_size
    if alternative is Alternative.PIPEDREAM:
        return dataclasses.replace(plan_pipedream(profile, topology, gbs,
                                                  memory_limit=memory_limit),
                                   transfers=transfers)
    if alternative is Alternative.DATA_PARALLEL:
        return best_data_parallel_plan(profile, topology, gbs, memory_limit=memory_limit,
                                       even_slices=even_slices, transfers=transfers)
    if alternative is Alternative.STRAIGHT:
        return best_straight_plan(profile, topology, gbs, memory_limit=memory_limit,
                                  even_slices=even_slices, transfers=transfers)
    space = "paper" if alternative is Alternative.PAPER_SPACE else "full"
    return plan_dapple(profile, topology, gbs, memory_limit=memory_limit,
                       even_slices=even_slices, plan_space=space, transfers=transfers)


def alternatives(profile, topology, global_batch_size: int, which: Sequence[Alternative],
                 memory_limit=None, even_slices: bool = False, transfers: str = "async"
                 ) -> Dict[Alternative, Optional[Plan]]:
    """The plans of `which`, in that order; None where none is feasible."""
    return {a: _attempt(functools.partial(plan_alternative, a, memory_limit=memory_limit,
                                          even_slices=even_slices, transfers=transfers),
                        profile, topology, global_batch_size)[0]
            for a in which}


def _attempt(planner: Callable, profile, topology, gbs: int) -> Tuple[Optional[Plan], str]:
    """(plan, "") or (None, the first clause of the PlanError that says why there is none)."""
    try:
        return planner(profile, topology, gbs), ""
    except PlanError as e:
        return None, str(e).split(";")[0]


def single_device_ms(profile, topology, global_batch_size: int) -> float:
    """The speedup reference: the whole global batch on one device, as micro-batches one after
    another, costed by the same cost model with the best micro-batch count and no memory
    limit."""
    best = None
    for M in range(1, global_batch_size + 1):
        if global_batch_size % M:
            continue
        one = Plan(stages=[Stage(layers=[0, profile.num_layers - 1], devices=[0])],
                   micro_batches=M, global_batch_size=global_batch_size)
        costs = pipeline_costs(one, profile, topology)
        total = M * (costs.forward_ms[0] + costs.backward_ms[0])
        best = total if best is None else min(best, total)
    return best


def held_comparison(plan: Plan, costs, link_duplex: Optional[str] = None,
                    rendezvous: Optional[bool] = None) -> Dict[str, SimulationResult]:
    """{label: simulation} for GPipe and early backward on the same stages and micro-batches
    (the paper's Fig. 3c), and the plan's own schedule when it is neither (an interleaved plan's
    chunks are not stages of the other two: it is shown alone)."""
    out = {}
    if plan.num_positions == plan.num_stages:
        own = plan.schedule.early_backward
        early_policy = plan.schedule if own else ONE_F_ONE_B
        early = dataclasses.replace(plan, schedule=early_policy,
                                    warmup=plan.warmup if own else None)
        gpipe = dataclasses.replace(plan, schedule=GPIPE, warmup=None)
        out["GPipe"] = simulate_plan(gpipe, costs, link_duplex, rendezvous)
        out[f"early backward ({early_policy})"] = simulate_plan(early, costs, link_duplex,
                                                                rendezvous)
    if not plan.schedule.formula:       # neither GPipe nor early backward: shown as well
        out[plan.schedule.name] = simulate_plan(plan, costs, link_duplex, rendezvous)
    return out


@dataclass
class Candidate:
    """One strategy for one global batch size; `plan` None means it is not feasible (`note`
    says why, e.g. "does not fit in device memory")."""
    name: str
    plan: Optional[Plan] = None
    latency_ms: Optional[float] = None            # default: plan.estimate.latency_ms
    simulation: Optional[SimulationResult] = None
    note: str = ""

    def formula_ms(self) -> Optional[float]:
        if self.latency_ms is not None:
            return self.latency_ms
        estimate = getattr(self.plan, "estimate", None) if self.plan is not None else None
        if estimate is not None and estimate.method == "formula":    # not a simulated one
            return estimate.latency_ms
        return None

    def time_ms(self) -> Optional[float]:
        """The time speedups are computed from: the simulated iteration, else the formula's."""
        if self.simulation is not None:
            return self.simulation.batch_ms
        return self.formula_ms()


@dataclass
class ReportRow:
    global_batch_size: int
    candidates: List[Candidate]                   # the best plan first: its timeline is drawn
    single_device_ms: Optional[float] = None      # whole global batch on one device
    held: Optional[Dict[str, SimulationResult]] = None   # GPipe vs early backward, best plan
    schedules: Optional[List[ScheduleOption]] = None     # the schedules on the best plan


def speedups(row: ReportRow, baseline: Optional[str] = None) -> Dict[str, Optional[float]]:
    """Speedup of every feasible candidate (None where there is no time): over one device when
    `row.single_device_ms` is known and no `baseline` is named, else over the candidate named
    `baseline` (default: the first)."""
    if row.single_device_ms is not None and baseline is None:
        reference = row.single_device_ms
    else:
        name = baseline or row.candidates[0].name
        matches = [c for c in row.candidates if c.name == name]
        if not matches:
            raise ValueError(f"speedup baseline {name!r} is not a candidate of global batch "
                             f"{row.global_batch_size}: {[c.name for c in row.candidates]}")
        reference = matches[0].time_ms()
    out = {}
    for c in row.candidates:
        t = c.time_ms() if c.plan is not None or c.latency_ms is not None else None
        out[c.name] = reference / t if (t and reference) else None
    return out


def strategy_row(profile, topology, global_batch_size: int, best_plan: Optional[Plan] = None,
                 planners: Optional[Sequence[Tuple[str, Callable]]] = None, memory_limit=None,
                 with_held: bool = True, even_slices: bool = False,
                 plan_space: str = "paper", schedule: Optional[str] = None,
                 virtual_stages: Optional[int] = None, batches: Optional[int] = None,
                 transfers: str = "async") -> ReportRow:
    """One report row: the DAPPLE plan (`best_plan`, or planned here and, when `schedule` is
    given, put under it: `planner.search.schedule_choice`), then each of `planners`
    ((name, function(profile, topology, global_batch_size) -> Plan) pairs; default: the
    `BASELINES`), each simulated with the cost model's durations. A planner that finds no plan
    gives an infeasible candidate whose note says why."""
    options = None
    if best_plan is None:
        best_plan = plan_dapple(profile, topology, global_batch_size,
                                memory_limit=memory_limit, even_slices=even_slices,
                                plan_space=plan_space, transfers=transfers)
        if schedule is not None:
            best_plan, options = choose_schedule(best_plan, profile, topology, schedule,
                                                 virtual_stages, batches)
    if planners is None:
        planners = [(a.value, functools.partial(plan_alternative, a, memory_limit=memory_limit,
                                                even_slices=even_slices, transfers=transfers))
                    for a in BASELINES]
    candidates = [Candidate("DAPPLE", best_plan)]
    for name, planner in planners:
        plan, note = _attempt(planner, profile, topology, global_batch_size)
        candidates.append(Candidate(name, plan, note=note))
    for c in candidates:
        if c.plan is not None:
            c.simulation = simulate_plan(c.plan, pipeline_costs(c.plan, profile, topology))
    held = None
    if with_held and best_plan.num_stages > 1:
        held = held_comparison(best_plan, pipeline_costs(best_plan, profile, topology))
    return ReportRow(global_batch_size, candidates,
                     single_device_ms=single_device_ms(profile, topology, global_batch_size),
                     held=held, schedules=options)
