"""Discrete-event simulator: a plan's per-stage task lists, timed with the cost model's durations.

The latency formula (DAPPLE eq. 1-3, `planner.cost_model`) ignores bubbles inside the pivot
stage; this module runs the schedule instead, so a plan can be seen and its formula checked.
Task order comes only from `planner.schedule` (one source of truth); the simulator decides
*when* each task runs, never *which* runs next on a stage.

Model (decisions a newcomer needs):

* A stage is one resource. Its replicas run in lockstep on their own slices of every
  micro-batch, so one timeline per stage stands for all its devices (`PipelineCosts` already
  holds per-replica durations). A stage runs its list strictly in order, one task at a time.
* Data dependencies (`planner.schedule.dependencies`): forward of micro-batch m on stage s
  needs the activations of m sent from s-1; backward of m needs the stage's own forward of m
  and the gradient of m sent from s+1.
* A boundary's transfer starts when the producing task ends, and occupies its link; transfers
  on one link run one at a time, first ready first served (ties: first produced). The sending
  and receiving devices are not blocked (copies run beside compute, as on GPUs). Links are
  full duplex by default: activations (s -> s+1) and gradients (s+1 -> s) use separate
  channels. `link_duplex="half"` makes both directions share one channel, which is what
  eq. 1 assumes when it models a boundary as a stage of its own with F = send forward and
  B = send backward.
* Each stage's allreduce starts when its last task (its last backward) ends; allreduces of
  different stages run on different device groups and do not wait for each other.
* A micro-batch's activations are *held* on a stage from the start of its forward to the end
  of its backward; at equal times a release counts before an acquisition (the stage runs one
  task at a time, so a backward ending at t frees memory before the forward starting at t).
* Busy time is forward + backward compute; idle time is the rest of the iteration minus the
  stage's allreduce; bubble fraction is idle / iteration.
* Deterministic: events are committed in order of start time with fixed tie-breaks, and a
  duration never depends on anything random. The simulation is exact for this model (a
  max-plus system), not sampled.

A schedule that cannot finish raises `DeadlockError` naming every stuck task and what it waits
for (a task missing from a list, or a wait cycle between stages).
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from planner.costs import PipelineCosts
from planner.schedule import (BACKWARD, FORWARD, ScheduleError, Task, dependencies,
                              plan_schedule)

# Timeline event kinds (also the legend of the pictures).
FORWARD_KIND = "forward"
BACKWARD_KIND = "backward"
SEND_FORWARD_KIND = "send_forward"     # activations, boundary s -> s+1
SEND_BACKWARD_KIND = "send_backward"   # gradients, boundary s+1 -> s
ALLREDUCE_KIND = "allreduce"
LINK_DUPLEX_MODES = ("full", "half")


class DeadlockError(ScheduleError):
    """The task lists cannot all run to the end; the message names the stuck tasks."""


@dataclass(frozen=True)
class TimelineEvent:
    kind: str                  # one of the *_KIND constants
    stage: int                 # compute/allreduce: the stage; transfers: boundary s (s <-> s+1)
    micro_batch: Optional[int]  # None for allreduce
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class StageStats:
    stage: int
    busy_ms: float
    idle_ms: float
    allreduce_ms: float
    bubble_fraction: float
    peak_held_micro_batches: int
    peak_held_bytes: float
    end_ms: float              # when the stage's allreduce (or last task) ends


@dataclass
class SimulationResult:
    iteration_ms: float
    stages: List[StageStats]
    events: List[TimelineEvent]
    schedule: List[List[Task]] = field(repr=False, default_factory=list)
    link_duplex: str = "full"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time (each stage weighted equally)."""
        return sum(s.idle_ms for s in self.stages) / (self.iteration_ms * self.num_stages) \
            if self.iteration_ms > 0 else 0.0

    def stage_events(self, stage: int) -> List[TimelineEvent]:
        """Compute and allreduce events of `stage`, in time order."""
        return [e for e in self.events if e.stage == stage and
                e.kind in (FORWARD_KIND, BACKWARD_KIND, ALLREDUCE_KIND)]

    def link_events(self, boundary: int) -> List[TimelineEvent]:
        return [e for e in self.events if e.stage == boundary and
                e.kind in (SEND_FORWARD_KIND, SEND_BACKWARD_KIND)]

    def held_over_time(self, stage: int) -> List[Tuple[float, int]]:
        """Step function of micro-batches held on `stage`: [(time, count from then on)]."""
        return _held_steps(self.events, stage)

    def to_dict(self, with_timeline: bool = False) -> Dict:
        d = {
            "iteration_ms": self.iteration_ms,
            "bubble_fraction": self.bubble_fraction,
            "link_duplex": self.link_duplex,
            "stages": [asdict(s) for s in self.stages],
        }
        if with_timeline:
            d["timeline"] = [asdict(e) for e in self.events]
        return d


# ---------------------------------------------------------------------------------------------
def simulate_plan(plan, costs: PipelineCosts, link_duplex: str = "full") -> SimulationResult:
    """Simulate `plan` (a `planner.plan.Plan`) with per-task durations `costs`."""
    if costs.num_stages != plan.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the plan has "
                         f"{plan.num_stages}; compute them for this plan "
                         f"(planner.cost_model.pipeline_costs)")
    return simulate(plan_schedule(plan), costs, link_duplex=link_duplex)


def simulate(schedule: Sequence[Sequence[Task]], costs: PipelineCosts,
             link_duplex: str = "full") -> SimulationResult:
    """Run all stages' task lists together with the durations in `costs`."""
    if link_duplex not in LINK_DUPLEX_MODES:
        raise ValueError(f"link_duplex must be one of {LINK_DUPLEX_MODES}, got {link_duplex!r}")
    S = len(schedule)
    if S == 0:
        raise ValueError("empty schedule: a plan has at least one stage")
    if costs.num_stages != S:
        raise ValueError(f"costs describe {costs.num_stages} stages, schedule has {S}")
    _check_costs(costs)
    _check_no_repeats(schedule)

    position = [0] * S
    stage_free = [0.0] * S
    finished: Dict[Tuple[int, Task], float] = {}     # (stage, task) -> end time
    arrived: Dict[Tuple[int, Task], float] = {}      # data for (stage, task) arrives on stage
    link_free: Dict[Tuple, float] = {}
    # Per link channel: heap of (ready_ms, sequence, kind, boundary, micro_batch).
    link_queue: Dict[Tuple, List] = {}
    events: List[TimelineEvent] = []
    sequence = 0

    def channel(kind: str, boundary: int) -> Tuple:
        return (boundary,) if link_duplex == "half" else (boundary, kind)

    def data_ready(s: int, task: Task) -> Optional[float]:
        """When `task` on stage `s` may start as far as data goes; None if not yet known."""
        ready = 0.0
        for dep_stage, dep_task in dependencies(s, task, S):
            key = (dep_stage, dep_task)
            if dep_stage == s:
                if key not in finished:
                    return None
                ready = max(ready, finished[key])
            else:
                # Cross-stage data arrives by a transfer (instant when the send costs 0 ms).
                if (s, task) not in arrived:
                    return None
                ready = max(ready, arrived[(s, task)])
        return ready

    while True:
        best = None   # (start, ready, category, index, payload)
        for s in range(S):
            if position[s] >= len(schedule[s]):
                continue
            task = schedule[s][position[s]]
            ready = data_ready(s, task)
            if ready is None:
                continue
            key = (max(stage_free[s], ready), ready, 0, s)
            if best is None or key < best[0]:
                best = (key, ("task", s, task))
        for ch, queue in link_queue.items():
            if queue:
                ready, seq, kind, boundary, m = queue[0]
                key = (max(link_free.get(ch, 0.0), ready), ready, 1, seq)
                if best is None or key < best[0]:
                    best = (key, ("send", ch))
        if best is None:
            break
        start = best[0][0]
        what = best[1]
        if what[0] == "task":
            _, s, task = what
            duration = costs.forward_ms[s] if task.kind == FORWARD else costs.backward_ms[s]
            end = start + duration
            events.append(TimelineEvent(FORWARD_KIND if task.kind == FORWARD else BACKWARD_KIND,
                                        s, task.micro_batch, start, end))
            finished[(s, task)] = end
            stage_free[s] = end
            position[s] += 1
            # Hand the result to the neighbour that needs it.
            if task.kind == FORWARD and s < S - 1:
                kind, boundary = SEND_FORWARD_KIND, s
            elif task.kind == BACKWARD and s > 0:
                kind, boundary = SEND_BACKWARD_KIND, s - 1
            else:
                kind = None
            if kind is not None:
                heapq.heappush(link_queue.setdefault(channel(kind, boundary), []),
                               (end, sequence, kind, boundary, task.micro_batch))
                sequence += 1
        else:
            ch = what[1]
            ready, seq, kind, boundary, m = heapq.heappop(link_queue[ch])
            duration = (costs.send_forward_ms[boundary] if kind == SEND_FORWARD_KIND
                        else costs.send_backward_ms[boundary])
            end = start + duration
            link_free[ch] = end
            events.append(TimelineEvent(kind, boundary, m, start, end))
            if kind == SEND_FORWARD_KIND:
                arrived[(boundary + 1, Task(FORWARD, m))] = end
            else:
                arrived[(boundary, Task(BACKWARD, m))] = end

    stuck = [s for s in range(S) if position[s] < len(schedule[s])]
    if stuck:
        raise DeadlockError(_deadlock_message(schedule, position, finished, arrived, S))
    _check_complete(schedule)

    stage_end = []
    for s in range(S):
        last_end = stage_free[s]
        if costs.allreduce_ms[s] > 0:
            events.append(TimelineEvent(ALLREDUCE_KIND, s, None, last_end,
                                        last_end + costs.allreduce_ms[s]))
        stage_end.append(last_end + costs.allreduce_ms[s])
    iteration = max([e.end_ms for e in events] + [0.0])
    events.sort(key=lambda e: (e.start_ms, _KIND_ORDER[e.kind], e.stage,
                               -1 if e.micro_batch is None else e.micro_batch))

    stage_stats = []
    for s in range(S):
        busy = sum(e.duration_ms for e in events if e.stage == s and
                   e.kind in (FORWARD_KIND, BACKWARD_KIND))
        allreduce = costs.allreduce_ms[s]
        idle = max(iteration - busy - allreduce, 0.0)
        peak = max((count for _, count in _held_steps(events, s)), default=0)
        per_mb = costs.activation_bytes[s] if costs.activation_bytes else 0.0
        stage_stats.append(StageStats(
            stage=s, busy_ms=busy, idle_ms=idle, allreduce_ms=allreduce,
            bubble_fraction=idle / iteration if iteration > 0 else 0.0,
            peak_held_micro_batches=peak, peak_held_bytes=peak * per_mb, end_ms=stage_end[s]))
    return SimulationResult(iteration_ms=iteration, stages=stage_stats, events=events,
                            schedule=[list(t) for t in schedule], link_duplex=link_duplex)


_KIND_ORDER = {BACKWARD_KIND: 0, FORWARD_KIND: 1, SEND_FORWARD_KIND: 2, SEND_BACKWARD_KIND: 3,
               ALLREDUCE_KIND: 4}


def _held_steps(events: Sequence[TimelineEvent], stage: int) -> List[Tuple[float, int]]:
    changes = []   # (time, order, delta): releases (order 0) before acquisitions (order 1)
    for e in events:
        if e.stage != stage:
            continue
        if e.kind == FORWARD_KIND:
            changes.append((e.start_ms, 1, +1))
        elif e.kind == BACKWARD_KIND:
            changes.append((e.end_ms, 0, -1))
    changes.sort()
    steps, count = [(0.0, 0)], 0
    for time, _, delta in changes:
        count += delta
        if steps[-1][0] == time:
            steps[-1] = (time, count)
        else:
            steps.append((time, count))
    # Entries at one instant collapse to the last count: a backward ending at t and the next
    # forward starting at t leave the count unchanged, never one above it.
    return steps


def _check_costs(costs: PipelineCosts) -> None:
    for name in ("forward_ms", "backward_ms", "send_forward_ms", "send_backward_ms",
                 "allreduce_ms"):
        for i, v in enumerate(getattr(costs, name)):
            if not v >= 0:   # also catches NaN
                raise ValueError(f"PipelineCosts.{name}[{i}] = {v}: durations must be "
                                 f"non-negative numbers (milliseconds)")


def _check_no_repeats(schedule: Sequence[Sequence[Task]]) -> None:
    for s, tasks in enumerate(schedule):
        seen = set()
        for t in tasks:
            if t.kind not in (FORWARD, BACKWARD):
                raise ScheduleError(f"stage {s}: task {t!r} has kind {t.kind!r}; use "
                                    f"{FORWARD!r} or {BACKWARD!r}")
            if t in seen:
                raise ScheduleError(f"stage {s}: task {t} appears twice; each forward and "
                                    f"backward of a micro-batch runs once per stage")
            seen.add(t)


def _check_complete(schedule: Sequence[Sequence[Task]]) -> None:
    """After a run without deadlock: every stage must hold F and B of the same micro-batches."""
    micro_batches = sorted({t.micro_batch for tasks in schedule for t in tasks})
    expected = {Task(k, m) for k in (FORWARD, BACKWARD) for m in micro_batches}
    for s, tasks in enumerate(schedule):
        missing = sorted(expected - set(tasks))
        if missing:
            raise DeadlockError(
                f"stage {s} never runs {[str(t) for t in missing]} (missing from its task "
                f"list), so those micro-batches never finish their gradients; take task "
                f"lists from planner.schedule")


def _deadlock_message(schedule, position, finished, arrived, S) -> str:
    lines = []
    for s in range(S):
        if position[s] >= len(schedule[s]):
            continue
        task = schedule[s][position[s]]
        waits = []
        for dep_stage, dep_task in dependencies(s, task, S):
            if dep_stage == s:
                if (s, dep_task) in finished:
                    continue
                where = "which is not in its task list" if dep_task not in schedule[s] \
                    else "which comes later in its own list"
                waits.append(f"its own {dep_task} ({where})")
            elif (s, task) not in arrived:
                if dep_task not in schedule[dep_stage]:
                    waits.append(f"stage {dep_stage} {dep_task}, which is not in stage "
                                 f"{dep_stage}'s task list")
                elif (dep_stage, dep_task) not in finished:
                    nxt = (schedule[dep_stage][position[dep_stage]]
                           if position[dep_stage] < len(schedule[dep_stage]) else None)
                    waits.append(f"stage {dep_stage} {dep_task} (stage {dep_stage} is stuck "
                                 f"at {nxt})")
        lines.append(f"stage {s} at {task} waits for " + " and ".join(waits))
    return ("schedule deadlocks: " + "; ".join(lines) +
            ". Task lists must come from planner.schedule (every F and B once, warm-up depths "
            "non-increasing along the pipeline)")
