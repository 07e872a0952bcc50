"""Discrete-event simulator: a plan's lowered action lists, timed with the cost model's durations.

The latency formula (DAPPLE eq. 1-3, `planner.estimate.cost_model`) ignores bubbles inside the pivot
stage; this module runs the schedule instead, so a plan can be seen and its formula checked.
What runs, in which order, and which data moves where comes only from the lowered schedule
(`planner.schedules.lowering.lower`, the same lists the runtime runs); the simulator decides *when*.

Model (decisions a newcomer needs):

* A position (a stage, or the devices holding several chunks of an interleaved schedule) is
  one resource. Its replicas run in lockstep on their own slices of every micro-batch, so one
  timeline per position stands for all its devices (`PipelineCosts` holds per-replica
  durations, one entry per chunk). A position runs its list strictly in order.
* An action starts when its position is free and everything it reads is done
  (`planner.schedules.lowering.needs`). Compute takes the cost model's time; a split backward's I and W
  split the backward as the profile measured it (`dapple.profile` does), half and half for a
  graph.txt profile, which has only B.
* A send costs its position nothing (on CPU hosts the cost model has already charged the CPU
  of a transfer's ends to the F and B that send and receive: `cost_model.StageModel.
  transfer_cpu_ms`). Its transfer runs when what it occupies is free, one at a
  time, first ready first served (ties: first produced); the receive completes when it arrives.
  `link_duplex` says what a transfer occupies. "full" (default): its direction of the link
  (with interleaving, all transfers from one position to another). "half": the link, both
  directions, as eq. 1 models a boundary (a stage with F = send forward, B = send backward).
  "serial": both its positions, all their links: a horovodrun rank's one background thread
  performs its collectives one after another (Horovod's `RunLoopOnce`). `rendezvous=True`: a
  transfer also waits until its receiver has reached the receive, as a collective (Horovod's
  alltoall) does; by default data travels as soon as it is sent. A plan's `transfers` picks
  ("horovod": "serial", rendezvous; "tensorflow", buffered Send/Recv, is "full" as "async").
* A chunk's forwards start no earlier than its `start_ms` (what the step is fed reaching its
  replicas; on a TensorFlow cluster, the chief's rows crossing to the first stage's others).
* A chunk's allreduce (the ALLREDUCE action after its last weight gradient) occupies its
  position for the cost model's time; those of different positions do not wait for each other.
* A micro-batch's activations are *held* on a chunk from the start of its forward to the end
  of its backward (of I for a split backward); from then until the end of its W it *awaits W*,
  keeping only what W reads (`planner.schedules.memory`). At equal times a release counts
  before an acquisition (the position runs one action at a time).
* Statistics are per position ("stage" in the results): busy is compute; idle is the rest
  of the iteration minus the allreduces; bubble fraction is idle / iteration.
* A schedule over k global batches (`planner.schedules.relaxed_lists`) is one run: the iteration is the
  whole run, its bubble fraction the run's; `batch_ms` is the time per global batch consumed
  (iteration / (k x pipelines); AvgPipe's N pipelines consume N batches a step). An UPDATE
  takes no time (the optimizer's apply is not modelled, as in the single-batch schedules);
  each ALLREDUCE of an update takes the stage's allreduce time.
* Deterministic: events are committed in order of start time with fixed tie-breaks
  (`planner.estimate.event_loop`, whose cost grows with the number of actions only); the simulation
  is exact for this model (a max-plus system), not sampled. Where no order depends on time
  (full duplex, no rendezvous) `planner.estimate.fixed_order` computes the same floats in one
  pass, without the queue. A schedule that cannot finish
  raises `ScheduleError` (from `planner.schedules.replay`) naming every stuck action.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator, List, Optional, Tuple

from planner.schedules.actions import ALLREDUCE, Schedule, ScheduleError
from planner.estimate.action_graph import action_graph
from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate import event_loop, fixed_order
from planner.schedules.replay import checked_lowering, replay
from planner.schedules.by_name import plan_schedule
from planner.schedules.identity_cache import cached_by_identity
from planner.estimate.simulation_result import (  # noqa: F401  (the names users import from here)
    ALLREDUCE_KIND, BACKWARD_INPUT_KIND, BACKWARD_KIND, BACKWARD_WEIGHT_KIND, FORWARD_KIND,
    SEND_BACKWARD_KIND, SEND_FORWARD_KIND, StageStats, SimulationResult, TimelineEvent,
    COMPUTE_EVENTS, KIND_ORDER, peak_held, peaks)
from planner.schedules.weight_versions import staleness, weight_copies

LINK_DUPLEX_MODES = ("full", "half", "serial")


def simulate_plan(plan, costs: PipelineCosts, link_duplex: Optional[str] = None,
                  rendezvous: Optional[bool] = None) -> SimulationResult:
    """`plan` run with task durations `costs`; transfers as given, else `plan.transfers`."""
    schedule, link_duplex, rendezvous, pipelines = plan_run(plan, costs, link_duplex, rendezvous)
    result = simulate(schedule, costs, link_duplex=link_duplex, rendezvous=rendezvous)
    result.pipelines = pipelines
    return result


def plan_run(plan, costs: PipelineCosts, link_duplex: Optional[str] = None,
             rendezvous: Optional[bool] = None) -> Tuple[Schedule, str, bool, int]:
    """What `simulate_plan` runs: (the plan's schedule, link_duplex, rendezvous, pipelines)."""
    horovod = plan.transfers == "horovod"
    link_duplex = link_duplex or ("serial" if horovod else "full")
    rendezvous = horovod if rendezvous is None else rendezvous
    if costs.num_stages != plan.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the plan has "
                         f"{plan.num_stages} (chunks, with interleaving); compute them for this "
                         f"plan (planner.estimate.cost_model.pipeline_costs)")
    return plan_schedule(plan), link_duplex, rendezvous, plan.schedule.pipelines(plan)


def simulate(schedule: Schedule, costs: PipelineCosts,
             link_duplex: str = "full", rendezvous: bool = False) -> SimulationResult:
    """Run the lowered `schedule` (`planner.schedules.lowering.lower`) with the durations in `costs`
    (one entry per chunk)."""
    check_inputs(schedule, costs, link_duplex)
    with cyclic_gc_paused():
        lowered = checked_lowering(schedule)
        graph = action_graph(lowered)
        events, position_free, position = (
            fixed_order.run(graph, costs, link_duplex, rendezvous) or
            event_loop.run(graph, costs, link_duplex, rendezvous))
        return timed_result(schedule, lowered, costs, events, position_free, position,
                            link_duplex, rendezvous)


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cycle collector off within, as it was after. A simulation allocates an event
    and a few tuples per action, none in a cycle; collections triggered by those allocations
    would traverse every object alive, so their cost per action grew with the schedule
    (`benchmarks/plan_speed.py --only=scaling`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_inputs(schedule: Schedule, costs: PipelineCosts, link_duplex: str) -> None:
    if link_duplex not in LINK_DUPLEX_MODES:
        raise ValueError(f"link_duplex must be one of {LINK_DUPLEX_MODES}, got {link_duplex!r}")
    C = schedule.num_chunks
    if C == 0:
        raise ValueError("empty schedule: a plan has at least one stage")
    if costs.num_stages != C:
        raise ValueError(f"costs describe {costs.num_stages} stages, schedule has {C} chunks")
    _check_costs(costs)


def timed_result(schedule: Schedule, lowered: Schedule, costs: PipelineCosts,
                 events: List[TimelineEvent], position_free: List[float], position: List[int],
                 link_duplex: str, rendezvous: bool) -> SimulationResult:
    """The result of a run that stopped with each position `position[p]` actions into its
    list; a ScheduleError naming the stuck actions if one did not reach the end."""
    C, P, placement = schedule.num_chunks, lowered.num_positions, lowered.placement
    stuck = [f"{lowered.lists[p][position[p]]} on position {p}" for p in range(P)
             if position[p] < len(lowered.lists[p])]
    if stuck:
        # Whether a schedule deadlocks does not depend on durations: replay names the stuck
        # actions and what they wait for. If it runs to the end, rendezvous stopped here.
        replay(lowered)
        raise ScheduleError(f"transfers waiting for receives that never come: {', '.join(stuck)}")
    iteration = max([e.end_ms for e in events] + [0.0])
    events.sort(key=lambda e: (e.start_ms, KIND_ORDER[e.kind], e.stage,
                               -1 if e.micro_batch is None else e.micro_batch))
    held_bytes = list(costs.activation_bytes) or [0.0] * C
    awaiting_bytes = list(costs.weight_gradient_bytes) or held_bytes
    stats = []
    copies, stale, allreduces = _per_position(lowered)
    at: List[List[TimelineEvent]] = [[] for _ in range(P)]   # each position's, in time order
    for e in events:
        if e.kind in COMPUTE_EVENTS:
            at[e.position].append(e)
    for p in range(P):
        chunks = [c for c in range(C) if placement[c] == p]
        busy = sum([e.end_ms - e.start_ms for e in at[p]])
        allreduce = sum([costs.allreduce_ms[c] for c in allreduces[p]])
        idle = max(iteration - busy - allreduce, 0.0)
        held, held_bytes_peak, awaiting = peaks(at[p], held_bytes, awaiting_bytes)
        stats.append(StageStats(
            stage=p, busy_ms=busy, idle_ms=idle, allreduce_ms=allreduce,
            bubble_fraction=idle / iteration if iteration > 0 else 0.0,
            peak_held_micro_batches=int(round(held)), peak_held_bytes=held_bytes_peak,
            end_ms=position_free[p], peak_awaiting_weight_micro_batches=int(round(awaiting)),
            chunks=chunks, weight_copies=copies[p], staleness=stale[p]))
    return SimulationResult(iteration_ms=iteration, stages=stats, events=events, schedule=lowered,
                            link_duplex=link_duplex, rendezvous=rendezvous,
                            batches=schedule.batches)


@cached_by_identity(64)
def _per_position(lowered: Schedule) -> Tuple[List[int], List[int], List[List[int]]]:
    """Per position of `lowered`: its weight copies, its staleness, the chunks of its
    allreduces in list order. They depend on the lists only, not on durations."""
    return (weight_copies(lowered), staleness(lowered),
            [[a.chunk for a in lst if a.kind == ALLREDUCE] for lst in lowered.lists])


def _check_costs(costs: PipelineCosts) -> None:
    for name in ("forward_ms", "backward_ms", "send_forward_ms", "send_backward_ms",
                 "allreduce_ms", "start_ms"):
        for i, v in enumerate(getattr(costs, name)):
            if not v >= 0:   # also catches NaN
                raise ValueError(f"PipelineCosts.{name}[{i}] = {v}: durations must be "
                                 f"non-negative numbers (milliseconds)")
