"""Discrete-event simulator: a plan's lowered action lists, timed with the cost model's durations.

The latency formula (DAPPLE eq. 1-3, `planner.cost_model`) ignores bubbles inside the pivot
stage; this module runs the schedule instead, so a plan can be seen and its formula checked.
What runs, in which order, and which data moves where comes only from the lowered schedule
(`planner.lowering.lower`, the same lists the runtime runs); the simulator decides *when*.

Model (decisions a newcomer needs):

* A position (a stage, or the devices holding several chunks of an interleaved schedule) is
  one resource. Its replicas run in lockstep on their own slices of every micro-batch, so one
  timeline per position stands for all its devices (`PipelineCosts` holds per-replica
  durations, one entry per chunk). A position runs its list strictly in order.
* An action starts when its position is free and everything it reads is done
  (`planner.lowering.needs`). Compute takes the cost model's time; a split backward's I and W
  split the backward as the profile measured it (`dapple.profile` does), half and half for a
  graph.txt profile, which has only B.
* A send costs its position nothing. Its transfer runs when what it occupies is free, one at a
  time, first ready first served (ties: first produced); the receive completes when it arrives.
  `link_duplex` says what a transfer occupies. "full" (default): its direction of the link
  (with interleaving, all transfers from one position to another). "half": the link, both
  directions, as eq. 1 models a boundary (a stage with F = send forward, B = send backward).
  "serial": both its positions, all their links: a horovodrun rank's one background thread
  performs its collectives one after another (Horovod's `RunLoopOnce`). `rendezvous=True`: a
  transfer also waits until its receiver has reached the receive, as a collective (Horovod's
  alltoall) does; by default data travels as soon as it is sent. A plan's `transfers` picks
  ("horovod": "serial", rendezvous; "tensorflow", buffered Send/Recv, is "full" as "async").
* A chunk's allreduce (the ALLREDUCE action after its last weight gradient) occupies its
  position for the cost model's time; those of different positions do not wait for each other.
* A micro-batch's activations are *held* on a chunk from the start of its forward to the end
  of its backward (of I for a split backward); from then until the end of its W it *awaits W*,
  keeping only what W reads (`planner.schedule_memory`). At equal times a release counts
  before an acquisition (the position runs one action at a time).
* Statistics are per position ("stage" in the results): busy is compute; idle is the rest
  of the iteration minus the allreduces; bubble fraction is idle / iteration.
* A schedule over k global batches (`planner.multi_batch`) is one run: the iteration is the
  whole run, its bubble fraction the run's; `batch_ms` is the time per global batch consumed
  (iteration / (k x pipelines); AvgPipe's N pipelines consume N batches a step). An UPDATE
  takes no time (the optimizer's apply is not modelled, as in the single-batch schedules);
  each ALLREDUCE of an update takes the stage's allreduce time.
* Deterministic: events are committed in order of start time with fixed tie-breaks; the
  simulation is exact for this model (a max-plus system), not sampled. A schedule that cannot
  finish raises `ScheduleError` (from `planner.replay`) naming every stuck action.
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from planner.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                             RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD, UPDATE,
                             Action, Schedule, ScheduleError)
from planner.costs import PipelineCosts
from planner.lowering import Located, needs
from planner.multi_batch import AVGPIPE
from planner.replay import replay
from planner.schedule import plan_schedule
from planner.weight_versions import staleness, weight_copies

# Timeline event kinds (also the legend of the pictures).
FORWARD_KIND = "forward"
BACKWARD_KIND = "backward"
BACKWARD_INPUT_KIND = "backward_input"      # I of a split backward
BACKWARD_WEIGHT_KIND = "backward_weight"    # W of a split backward
SEND_FORWARD_KIND = "send_forward"     # activations, boundary s -> s+1
SEND_BACKWARD_KIND = "send_backward"   # gradients, boundary s+1 -> s
ALLREDUCE_KIND = "allreduce"
LINK_DUPLEX_MODES = ("full", "half", "serial")
_EVENT_KIND = {FORWARD: FORWARD_KIND, BACKWARD: BACKWARD_KIND, BACKWARD_INPUT: BACKWARD_INPUT_KIND,
               BACKWARD_WEIGHT: BACKWARD_WEIGHT_KIND, ALLREDUCE: ALLREDUCE_KIND}
_COMPUTE_EVENTS = (FORWARD_KIND, BACKWARD_KIND, BACKWARD_INPUT_KIND, BACKWARD_WEIGHT_KIND)


@dataclass(frozen=True)
class TimelineEvent:
    kind: str                  # one of the *_KIND constants
    stage: int                 # compute/allreduce: the chunk; transfers: boundary c (c <-> c+1)
    micro_batch: Optional[int]  # None for allreduce
    start_ms: float
    end_ms: float
    position: Optional[int] = None   # compute/allreduce: where it ran; transfers: the sender

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class StageStats:
    """One position: a stage, or the devices running chunks of an interleaved schedule."""
    stage: int                 # the position
    busy_ms: float
    idle_ms: float
    allreduce_ms: float
    bubble_fraction: float
    peak_held_micro_batches: int         # full activations, forward to B or I (all its chunks)
    peak_held_bytes: float               # held and awaiting W, at their bytes
    end_ms: float              # when the position's allreduce (or last task) ends
    peak_awaiting_weight_micro_batches: int = 0     # past I, before W
    chunks: List[int] = field(default_factory=list)
    weight_copies: int = 1      # weight versions resident at once (and AvgPipe's reference)
    staleness: int = 0          # most updates between a gradient's weights and those it updates


@dataclass
class SimulationResult:
    iteration_ms: float
    stages: List[StageStats]
    events: List[TimelineEvent]
    schedule: Optional[Schedule] = None          # lowered: what ran
    link_duplex: str = "full"
    rendezvous: bool = False
    batches: int = 1            # consecutive global batches in the run (per pipeline)
    pipelines: int = 1          # AvgPipe: pipelines running the same lists, each its own batch

    @property
    def batch_ms(self) -> float:
        """Time per global batch consumed: the iteration over batches x pipelines."""
        return self.iteration_ms / (self.batches * self.pipelines)

    @property
    def batches_per_second(self) -> float:
        return 1000.0 / self.batch_ms if self.batch_ms > 0 else float("inf")

    @property
    def num_stages(self) -> int:
        """Positions (stages; with interleaving, device groups holding several chunks)."""
        return len(self.stages)

    @property
    def num_boundaries(self) -> int:
        """Chunk boundaries c <-> c+1 (transfer events' `stage`)."""
        return sum(len(s.chunks) for s in self.stages) - 1

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time (each stage weighted equally)."""
        return sum(s.idle_ms for s in self.stages) / (self.iteration_ms * self.num_stages) \
            if self.iteration_ms > 0 else 0.0

    def stage_events(self, stage: int) -> List[TimelineEvent]:
        """Compute and allreduce events of position `stage`, in time order."""
        return [e for e in self.events if e.position == stage and
                e.kind in _COMPUTE_EVENTS + (ALLREDUCE_KIND,)]

    def link_events(self, boundary: int) -> List[TimelineEvent]:
        return [e for e in self.events if e.stage == boundary and
                e.kind in (SEND_FORWARD_KIND, SEND_BACKWARD_KIND)]

    def held_over_time(self, stage: int) -> List[Tuple[float, int]]:
        """Micro-batches held on position `stage`: [(time, count from then on)]."""
        return [(t, int(round(c))) for t, c in _held_steps(self.events, stage)]

    def to_dict(self, with_timeline: bool = False) -> Dict:
        d = {
            "iteration_ms": self.iteration_ms,
            "batches": self.batches,
            "pipelines": self.pipelines,
            "batch_ms": self.batch_ms,
            "batches_per_second": self.batches_per_second,
            "bubble_fraction": self.bubble_fraction,
            "link_duplex": self.link_duplex,
            "stages": [asdict(s) for s in self.stages],
        }
        if with_timeline:
            d["timeline"] = [asdict(e) for e in self.events]
        return d


# ---------------------------------------------------------------------------------------------
def simulate_plan(plan, costs: PipelineCosts, link_duplex: Optional[str] = None,
                  rendezvous: Optional[bool] = None) -> SimulationResult:
    """`plan` run with task durations `costs`; transfers as given, else `plan.transfers`."""
    horovod = plan.transfers == "horovod"
    link_duplex = link_duplex or ("serial" if horovod else "full")
    rendezvous = horovod if rendezvous is None else rendezvous
    if costs.num_stages != plan.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the plan has "
                         f"{plan.num_stages} (chunks, with interleaving); compute them for this "
                         f"plan (planner.cost_model.pipeline_costs)")
    result = simulate(plan_schedule(plan), costs, link_duplex=link_duplex, rendezvous=rendezvous)
    if plan.schedule == AVGPIPE:
        result.pipelines = plan.stages[0].replicas
    return result


def simulate(schedule: Schedule, costs: PipelineCosts,
             link_duplex: str = "full", rendezvous: bool = False) -> SimulationResult:
    """Run the lowered `schedule` (`planner.lowering.lower`) with the durations in `costs`
    (one entry per chunk)."""
    if link_duplex not in LINK_DUPLEX_MODES:
        raise ValueError(f"link_duplex must be one of {LINK_DUPLEX_MODES}, got {link_duplex!r}")
    C = schedule.num_chunks
    if C == 0:
        raise ValueError("empty schedule: a plan has at least one stage")
    if costs.num_stages != C:
        raise ValueError(f"costs describe {costs.num_stages} stages, schedule has {C} chunks")
    _check_costs(costs)
    lowered = replay(schedule).schedule      # checks every action once and no deadlock
    P, placement = lowered.num_positions, lowered.placement

    position = [0] * P
    position_free = [0.0] * P
    finished: Dict[Located, float] = {}
    busy_until: Dict[Tuple, float] = {}     # per channel, or per position when "serial"
    # Per link channel: heap of (ready_ms, sequence, send action, position).
    link_queue: Dict[Tuple, List] = {}
    events: List[TimelineEvent] = []
    sequence = 0

    def channel(sender: int, receiver: int) -> Tuple:
        return (min(sender, receiver), max(sender, receiver)) if link_duplex == "half" \
            else (sender, receiver)

    def occupied(ch: Tuple) -> Tuple:
        """What a transfer on channel `ch` keeps busy: the channel, or both its positions."""
        return tuple((p,) for p in ch) if link_duplex == "serial" else (ch,)

    ready_known: Dict[int, float] = {}    # position -> when its next action's inputs are done

    def ready_at(p: int, action: Action) -> Optional[float]:
        """When `action` may start as far as its inputs go; None while one is not done (a
        known time never changes, so it is kept until the position moves on)."""
        if p in ready_known:
            return ready_known[p]
        times = [finished.get(n) for n in needs(lowered, p, action)]
        if any(t is None for t in times):
            return None
        ready_known[p] = max(times, default=0.0)
        return ready_known[p]

    while True:
        best = None   # (key, payload)
        for p in range(P):
            if position[p] >= len(lowered.lists[p]):
                continue
            action = lowered.lists[p][position[p]]
            ready = ready_at(p, action)
            if ready is None:
                continue
            key = (max(position_free[p], ready), ready, 0, p)
            if best is None or key < best[0]:
                best = (key, ("action", p, action))
        for ch, queue in link_queue.items():
            if queue:
                ready, seq, send, _ = queue[0]
                if rendezvous:
                    posted = _receive_posted(lowered, placement, position, position_free, send)
                    if posted is None:
                        continue
                    ready = max(ready, posted)
                free = max(busy_until.get(r, 0.0) for r in occupied(ch))
                key = (max(free, ready), ready, 1, seq)
                if best is None or key < best[0]:
                    best = (key, ("transfer", ch))
        if best is None:
            break
        start = best[0][0]
        if best[1][0] == "action":
            _, p, action = best[1]
            c, m = action.chunk, action.micro_batch
            end = start + _duration(action, costs)
            position[p] += 1
            ready_known.pop(p, None)
            if action.kind in (SEND_FORWARD, SEND_BACKWARD):
                # The sender goes on at once; the link carries the data when it is free.
                receiver = placement[c + 1 if action.kind == SEND_FORWARD else c - 1]
                heapq.heappush(link_queue.setdefault(channel(p, receiver), []),
                               (start, sequence, action, p))
                sequence += 1
                position_free[p] = start
                continue
            if action.kind not in (RECV_FORWARD, RECV_BACKWARD, UPDATE) and not (
                    action.kind == ALLREDUCE and end == start):
                events.append(TimelineEvent(_EVENT_KIND[action.kind], c, m, start, end, p))
            finished[(p, action)] = end
            position_free[p] = end
        else:
            ch = best[1][1]
            _, _, send, p = heapq.heappop(link_queue[ch])
            forward = send.kind == SEND_FORWARD
            boundary = send.chunk if forward else send.chunk - 1
            duration = (costs.send_forward_ms[boundary] if forward
                        else costs.send_backward_ms[boundary])
            end = start + duration
            for r in occupied(ch):
                busy_until[r] = end
            events.append(TimelineEvent(SEND_FORWARD_KIND if forward else SEND_BACKWARD_KIND,
                                        boundary, send.micro_batch, start, end, p))
            finished[(p, send)] = end           # the receiver's data has arrived

    stuck = [f"{lowered.lists[p][position[p]]} on position {p}" for p in range(P)
             if position[p] < len(lowered.lists[p])]
    if stuck:       # only rendezvous can stop here: replay() ran the lists to the end
        raise ScheduleError(f"transfers waiting for receives that never come: {', '.join(stuck)}")
    iteration = max([e.end_ms for e in events] + [0.0])
    events.sort(key=lambda e: (e.start_ms, _KIND_ORDER[e.kind], e.stage,
                               -1 if e.micro_batch is None else e.micro_batch))
    held_bytes = list(costs.activation_bytes) or [0.0] * C
    awaiting_bytes = list(costs.weight_gradient_bytes) or held_bytes
    stats = []
    copies, stale = weight_copies(lowered), staleness(lowered)
    for p in range(P):
        chunks = [c for c in range(C) if placement[c] == p]
        busy = sum(e.duration_ms for e in events if e.position == p and
                   e.kind in _COMPUTE_EVENTS)
        allreduce = sum(costs.allreduce_ms[a.chunk] for a in lowered.lists[p]
                        if a.kind == ALLREDUCE)
        idle = max(iteration - busy - allreduce, 0.0)
        stats.append(StageStats(
            stage=p, busy_ms=busy, idle_ms=idle, allreduce_ms=allreduce,
            bubble_fraction=idle / iteration if iteration > 0 else 0.0,
            peak_held_micro_batches=int(round(_peak(events, p, [1.0] * C, [0.0] * C))),
            peak_held_bytes=_peak(events, p, held_bytes, awaiting_bytes),
            end_ms=position_free[p],
            peak_awaiting_weight_micro_batches=int(round(_peak(events, p, [0.0] * C,
                                                               [1.0] * C))),
            chunks=chunks, weight_copies=copies[p], staleness=stale[p]))
    return SimulationResult(iteration_ms=iteration, stages=stats, events=events, schedule=lowered,
                            link_duplex=link_duplex, rendezvous=rendezvous,
                            batches=schedule.batches)


def _receive_posted(lowered: Schedule, placement, position, position_free,
                    send: Action) -> Optional[float]:
    """When the receiver of `send` reached its receive, or None if it has not yet."""
    forward = send.kind == SEND_FORWARD
    chunk = send.chunk + 1 if forward else send.chunk - 1
    want = Action(chunk, RECV_FORWARD if forward else RECV_BACKWARD, send.micro_batch)
    p = placement[chunk]
    if position[p] < len(lowered.lists[p]) and lowered.lists[p][position[p]] == want:
        return position_free[p]
    return None


def _duration(action: Action, costs: PipelineCosts) -> float:
    c = action.chunk
    if action.kind == FORWARD:
        return costs.forward_ms[c]
    if action.kind == BACKWARD:
        return costs.backward_ms[c]
    if action.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):
        # I as the profile measured it (`input_gradient_ms`), else half of B; W the rest.
        i = costs.input_gradient_ms[c] if costs.input_gradient_ms else costs.backward_ms[c] / 2
        return i if action.kind == BACKWARD_INPUT else costs.backward_ms[c] - i
    if action.kind == ALLREDUCE:
        return costs.allreduce_ms[c]
    return 0.0                              # sends and receives: the link's time is the transfer


_KIND_ORDER = {BACKWARD_KIND: 0, BACKWARD_WEIGHT_KIND: 0, BACKWARD_INPUT_KIND: 1, FORWARD_KIND: 1,
               SEND_FORWARD_KIND: 2, SEND_BACKWARD_KIND: 3, ALLREDUCE_KIND: 4}


def _held_steps(events: Sequence[TimelineEvent], position: int,
                held_weight: Optional[Sequence[float]] = None,
                awaiting_weight: Optional[Sequence[float]] = None) -> List[Tuple[float, float]]:
    """Step function [(time, amount from then on)] of what `position` keeps: per micro-batch of
    chunk c, `held_weight[c]` from a forward's start to its B's or I's end, then
    `awaiting_weight[c]` until its W's end (defaults: count held micro-batches)."""
    changes = []   # (time, order, delta): releases (order 0) before acquisitions (order 1)
    for e in events:
        if e.position != position:
            continue
        held = 1.0 if held_weight is None else held_weight[e.stage]
        awaiting = 0.0 if awaiting_weight is None else awaiting_weight[e.stage]
        if e.kind == FORWARD_KIND:
            changes.append((e.start_ms, 1, +held))
        elif e.kind in (BACKWARD_KIND, BACKWARD_INPUT_KIND):
            changes.append((e.end_ms, 0, -held))
            if e.kind == BACKWARD_INPUT_KIND:
                changes.append((e.end_ms, 1, +awaiting))
        elif e.kind == BACKWARD_WEIGHT_KIND:
            changes.append((e.end_ms, 0, -awaiting))
    changes.sort()
    steps, amount = [(0.0, 0.0)], 0.0
    for time, _, delta in changes:
        amount += delta
        if steps[-1][0] == time:
            steps[-1] = (time, amount)
        else:
            steps.append((time, amount))
    # Entries at one instant collapse to the last amount: a backward ending at t and the next
    # forward starting at t leave the count unchanged, never one above it.
    return steps


def _peak(events, position, held_weight, awaiting_weight) -> float:
    return max(amount for _, amount in _held_steps(events, position, held_weight,
                                                   awaiting_weight))


def _check_costs(costs: PipelineCosts) -> None:
    for name in ("forward_ms", "backward_ms", "send_forward_ms", "send_backward_ms",
                 "allreduce_ms"):
        for i, v in enumerate(getattr(costs, name)):
            if not v >= 0:   # also catches NaN
                raise ValueError(f"PipelineCosts.{name}[{i}] = {v}: durations must be "
                                 f"non-negative numbers (milliseconds)")
