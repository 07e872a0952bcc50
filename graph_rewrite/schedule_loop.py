"""A pipeline's schedule as loops over the devices' steady periods, between unrolled parts.

Unrolled, a step holds a call of a stage's forward and one of its backward per micro-batch, and
TensorFlow's graph passes process every call site again: the first call grows with M
(docs/runtime.md, "Start-up"). But every device's list settles into periods whose micro-batches
advance by the same count each period, so the step runs, for every unit (stage, replica) of this
process:

* 1F1B: warm-up (unrolled), one `tf.while_loop` whose iteration t runs period t of every unit
  (one forward and one backward: on stage 0 of two F(t+1) B(t), on stage 1 F(t) B(t)), then
  cool-down (unrolled). Warm-up and cool-down depend on the stage count, not on M.
* GPipe: a loop of forwards (iteration t: F(t) of every unit), then a loop of backwards.
* zb-h1: as 1F1B, with a forward, an I and a W per period (stage s's W s micro-batches behind
  its I: what I leaves for W is carried).
* Interleaved: a device runs several stages (chunks); a period is a forward and a backward of
  each of its chunks for every micro-batch of a group, and advances a group (`Loop.stride`).

Forwards and backwards are the stage's split functions (`graph_rewrite.stage_split`), so a
forward's residuals, like the boundary tensors and the gradients going back, are plain tensors
a loop can carry. What is live between actions is keyed (what, stage, replica, micro-batch): a
forward's outputs awaiting the next stage, its residuals awaiting its backward, a backward's
input gradients awaiting the previous stage, an I's leftovers awaiting its W. Inside a loop a
key's micro-batch is relative to t; the body must leave the keys it found, one period on
(carried), except residuals it never reads, which it collects into arrays (an element per
micro-batch, read in place) for a later loop or unrolled part (GPipe's forwards, whose backwards
all come after them). `plan_loop` checks all this on the keys alone, before any op is built;
lists it cannot fit run unrolled.

A loop adds each unit's gradients in place into variables of its own, on its device
(`GradientAccumulators`): carried as loop variables, every gradient's Enter, Merge, Switch and
NextIteration ran each iteration, which cost more than the adds (0.4 ms an iteration for a
2-stage MLP of 34 small variables, measured in CPU time). For the same reason the small tensors
a loop carries or collects travel packed, one tensor per dtype (`PackedElements`). A loop
carries the loss, one order token per lane (device:
every action of a lane waits for its previous one, across iterations too, whichever chunk it
computes) and arrays of the last stage's predictions and of every forward's BatchNormalization
statistics, which the step reads afterwards as the unrolled actions would have left them: the
moving statistics are then updated once per step, from all of them (`batch_statistics`).

Rows: micro-batch m of every unit is a slice of rows m * n + [lo, hi) (n = global batch / M),
so a unit's inputs are taken as [M, rows, ...] and indexed by m, a tensor in the loop.

Across processes (Horovod) every process plans the whole pipeline's lists, so all cut them into
the same segments and run the same iterations of every loop, and builds only its own units'
tasks. A transfer is built at the receiving task on both sides (the sender sends what its units
left for another process's task there), so sender and receiver of a micro-batch meet in the
same segment and iteration; inside a loop it is named by its slot (`Crossing.slot`: the loop's
number and the task's relative micro-batch), one op carrying a micro-batch per iteration. Such
loops run one iteration at a time (`parallel_iterations=1`): Horovod refuses a name while a
transfer of it is in flight (GPipe's forward loop hit that). The body's transfers are kept by
an exact-zero loop variable the step adds to its loss (`_kept`).
Units on one process's devices or on a TensorFlow cluster's tasks (`LocalTransport`: the
partitioner cuts the loop by task, each task running its own frame of it, and the tensors
crossing tasks move by Send/Recv inside it), reading their device's working copies where a
runtime made them, or on Horovod ranks (a transport that names transfers so:
`transfers_in_loops`), in training, with no recomputation, are looped.

Relaxed schedules (PipeDream, 2BW) update the weights inside the step: an UPDATE task takes
its unit's gradient sums since the previous one (summed over the stage's replicas here) to the
relaxed step's update, and the sums start again from zero. PipeDream's update follows every
backward, so it runs inside the loop's body; 2BW's once a global batch, between loops. The
relaxed step says which actions no loop may hold (`loop_fixed_actions`: before them weights move
between the variables and the slots, or an update meets several replicas); an unrolled part runs
in the schedule's own order, so an update follows the backwards it sums and precedes the
forwards that read what it made. A backward differentiates at the weights its forward read (the
split stashes them, `stashes_weights`), and no split is inlined in such a body: inlined, a
forward's weight reads were no longer ordered after the previous iteration's update.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite.local_transport import Crossing, LocalTransport, Unit
from graph_rewrite.micro_batch_loop import weight_penalty
from graph_rewrite.packing import PackedElements
from graph_rewrite.stage_gradients import scaled_one
from graph_rewrite.stage_split import StageSplit
from graph_rewrite.step_state import StepState
from planner.schedules.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT,
                                       FORWARD, UPDATE, Action)

OUTPUTS, RESIDUALS, GRADIENTS, PENDING = "outputs", "residuals", "gradients", "pending"
Key = Tuple[str, int, int, int]      # (what, stage, replica, micro-batch)


@dataclass(frozen=True)
class Task:
    """One compute action of one unit; `micro_batch` is relative to t inside the loop."""
    kind: str
    stage: int
    replica: int
    micro_batch: int


@dataclass
class Loop:
    """One `tf.while_loop`: iteration t runs `body` with every micro-batch + t * stride."""
    body: List[Task]           # iteration 0's tasks, in an order that respects the data
    iterations: int
    carried: List[Key]         # live when the loop starts, left again `stride` micro-batches on
    collected: List[Key]       # residuals the body leaves for after the loop
    stride: int = 1            # micro-batches a period advances (interleaved: a group's)


@dataclass
class LoopPlan:
    """Unrolled tasks and loops, alternating: warm-up, loop, ..., loop, cool-down."""
    segments: List[Union[List[Task], Loop]]

    @property
    def loops(self) -> List[Loop]:
        return [part for part in self.segments if isinstance(part, Loop)]


def periodic(actions: Sequence[tuple], period: int, stride: int = 1,
             fixed: AbstractSet[int] = frozenset()) -> Tuple[int, int]:
    """(start, n): the longest run of n periods from `start` in which period i repeats period 0
    with every micro-batch (an action's last field) + i * stride, holding no index of `fixed`
    (actions that must run unrolled)."""
    best = (0, 0)
    for start in range(len(actions)):
        n = 0
        while start + (n + 1) * period <= len(actions) and all(
                actions[start + n * period + j] == (*actions[start + j][:-1],
                                                    actions[start + j][-1] + n * stride)
                and start + n * period + j not in fixed
                for j in range(period)):
            n += 1
        if n > best[1]:
            best = (start, n)
    return best


def periodic_runs(actions: Sequence[tuple], period: int, stride: int = 1,
                  fixed: AbstractSet[int] = frozenset()) -> List[Tuple[int, int]]:
    """(start, n) of each run of two or more periods, in list order: the longest first, then
    the longest after it, and so on."""
    runs, offset = [], 0
    while offset < len(actions):
        start, n = periodic(actions[offset:], period, stride,
                            frozenset(i - offset for i in fixed if i >= offset))
        if n < 2:               # one period is no loop (and any actions look periodic once)
            break
        runs.append((offset + start, n))
        offset += start + n * period
    return runs


class KeyBook:
    """What each task reads and leaves, as keys with a count of readers still to come."""

    def __init__(self, replicas: Sequence[int]):
        self.replicas = list(replicas)

    def needs(self, task: Task) -> List[Key]:
        s, r, m = task.stage, task.replica, task.micro_batch
        if task.kind == UPDATE:         # its lane's gradient sums, ordered by the lane's token
            return []
        if task.kind == FORWARD:
            return [(OUTPUTS, s - 1, q, m) for q in range(self.replicas[s - 1])] if s else []
        if task.kind == BACKWARD_WEIGHT:
            return [(PENDING, s, r, m)]
        out = [(RESIDUALS, s, r, m)]
        if s + 1 < len(self.replicas):
            out += [(GRADIENTS, s + 1, q, m) for q in range(self.replicas[s + 1])]
        return out

    def leaves(self, task: Task) -> Dict[Key, int]:
        s, r, m = task.stage, task.replica, task.micro_batch
        if task.kind == UPDATE:
            return {}
        if task.kind == FORWARD:
            out = {(RESIDUALS, s, r, m): 1}
            if s + 1 < len(self.replicas):
                out[(OUTPUTS, s, r, m)] = self.replicas[s + 1]
            return out
        if task.kind == BACKWARD_WEIGHT:
            return {}
        out = {(GRADIENTS, s, r, m): self.replicas[s - 1]} if s else {}
        if task.kind == BACKWARD_INPUT:
            out[(PENDING, s, r, m)] = 1
        return out

    def read(self, live: Dict[Key, int], task: Task) -> None:
        for key in self.needs(task):
            live[key] -= 1
            if not live[key]:
                del live[key]

    def order(self, queues: Dict[Unit, List[Task]], live: Dict[Key, int]) -> Optional[List[Task]]:
        """The tasks of every lane's queue (a device's: (position, replica)), each lane's in
        order, each after what it reads (later positions first: a backward frees memory
        sooner); None if they deadlock. Updates `live`."""
        queues = {u: list(q) for u, q in queues.items()}
        done: List[Task] = []
        while any(queues.values()):
            progressed = False
            for unit in sorted(queues, reverse=True):
                queue = queues[unit]
                while queue and all(k in live for k in self.needs(queue[0])):
                    task = queue.pop(0)
                    self.read(live, task)
                    live.update(self.leaves(task))
                    done.append(task)
                    progressed = True
            if not progressed:
                return None
        return done


def _shifted(keys: Dict[Key, int], by: int) -> Dict[Key, int]:
    return {(w, s, r, m + by): n for (w, s, r, m), n in keys.items()}


def _plan_one_loop(book: KeyBook, queues: Dict[Unit, List[Task]], iterations: int,
                   live: Dict[Key, int], collections: Dict[tuple, Tuple[int, int]],
                   stride: int = 1) -> Optional[Loop]:
    """The loop of `queues` (iteration 0's tasks) over `iterations`, from `live` (absolute
    keys; updated to what is live after it), or None if one loop cannot run them. What the
    body leaves of a kind it also reads is carried; residuals it leaves and never reads are
    collected (`collections`: kind -> (first micro-batch, count)); what it reads and never leaves
    comes from an earlier loop's collection."""
    tasks = [t for q in queues.values() for t in q]
    produced = {k[:3] for t in tasks for k in book.leaves(t)}
    trial = dict(live)
    body = book.order(queues, trial)
    if body is None:
        return None
    for kind in {k[:3] for t in body for k in book.needs(t)} - produced:
        reads = [k[3] for t in body for k in book.needs(t) if k[:3] == kind]
        first, count = collections.get(kind, (0, 0))
        if kind not in collections or min(reads) < first or (
                max(reads) + iterations > first + count):
            return None         # read but never made in the body, nor collected
        if stride != 1:
            return None         # collections hold one micro-batch per iteration
        for m in reads:         # every iteration reads its own
            for t in range(iterations):
                if kind + (m + t,) not in live:
                    return None             # read up already
                live[kind + (m + t,)] -= 1
                if not live[kind + (m + t,)]:
                    del live[kind + (m + t,)]
    entry = {k: n for k, n in live.items() if k[:3] in produced}
    after = {k: n for k, n in trial.items() if k[:3] in produced}
    carried_kinds = {k[:3] for k in entry}
    collected = {k: n for k, n in after.items() if k[:3] not in carried_kinds}
    if any(k[0] != RESIDUALS for k in collected) or any(
            k[:3] in {c[:3] for c in collected} for t in body for k in book.needs(t)) or (
            collected and stride != 1):
        return None
    if _shifted({k: n for k, n in after.items() if k not in collected}, -stride) != entry:
        return None             # the body does not leave what it found, one period on
    for k in entry:
        del live[k]
    live.update(_shifted({k: n for k, n in after.items() if k not in collected},
                         (iterations - 1) * stride))
    for (w, s, r, m), n in collected.items():
        collections[(w, s, r)] = (m, iterations)
        live.update({(w, s, r, m + t): n for t in range(iterations)})
    return Loop(body, iterations, sorted(entry), sorted(collected), stride)


def plan_loop(lists: Sequence[Sequence[tuple]], replicas: Sequence[int],
              placement: Optional[Sequence[int]] = None,
              fixed: Optional[Sequence[AbstractSet[int]]] = None) -> Optional[LoopPlan]:
    """Unrolled segments and loops for every unit, from per-position lists of compute actions,
    or None when the lists have no common periodic runs one loop each can run. An action is
    (kind, stage, m), or (kind, m) where position s runs stage s; `replicas` is per stage,
    `placement` the position of every stage (default: stage s on position s); `fixed`, per
    position, the indices of actions no loop may hold (they run unrolled). An UPDATE action
    (kind, stage, u) applies its unit's gradient sums since its previous one.

    Periods tried, first fit wins: a forward and a backward (1F1B: one loop), F, I and W
    (zb-h1), one action (GPipe: a loop of forwards, then one of backwards); with several
    stages per position, a forward and a backward of each stage for every micro-batch of a
    group of g (interleaved: a period advances g micro-batches)."""
    lists = [[a if len(a) == 3 else (a[0], p, a[1]) for a in lst] for p, lst in enumerate(lists)]
    placement = list(placement) if placement is not None else list(range(len(lists)))
    per_position = len(placement) // len(lists)
    shapes = [(2, 1), (3, 1), (1, 1)]
    if per_position > 1:
        longest = max(len(lst) for lst in lists)
        shapes = [(2 * per_position * g, g) for g in range(1, longest // (4 * per_position) + 1)]
    for period, stride in shapes:
        plan = _plan_with_period(lists, replicas, placement, period, stride,
                                 fixed or [frozenset()] * len(lists))
        if plan is not None:
            return plan
    return None


def _plan_with_period(lists, replicas, placement, period: int, stride: int, fixed
                      ) -> Optional[LoopPlan]:
    lane_replicas = {}
    for s, p in enumerate(placement):
        if lane_replicas.setdefault(p, replicas[s]) != replicas[s]:
            return None         # a position's stages on different device counts
    runs = [periodic_runs(lst, period, stride, fixed[p]) for p, lst in enumerate(lists)]
    if not runs[0] or any(len(r) != len(runs[0]) for r in runs):
        return None
    book = KeyBook(replicas)
    live: Dict[Key, int] = {}
    collections: Dict[tuple, Tuple[int, int]] = {}
    segments: List[Union[List[Task], Loop]] = []
    done = [0] * len(lists)     # per position, how much of its list is placed

    def queues(cut):            # per lane, the tasks of its position's slice of its list
        return {(p, r): [Task(kind, s, r, m) for kind, s, m in lst[done[p]:cut(p)]]
                for p, lst in enumerate(lists) for r in range(lane_replicas[p])}

    for j in range(len(runs[0])):
        iterations = min(r[j][1] for r in runs)
        unrolled = book.order(queues(lambda s: runs[s][j][0]), live)
        for s in range(len(lists)):
            done[s] = runs[s][j][0]
        loop = _plan_one_loop(book, queues(lambda s: done[s] + period), iterations, live,
                              collections, stride) if unrolled is not None else None
        if loop is None:
            return None
        segments += [unrolled, loop]
        for s in range(len(lists)):
            done[s] += iterations * period
    last = book.order(queues(lambda s: len(lists[s])), live)
    if last is None or live:
        return None
    return LoopPlan(segments + [last])


def transfers_in_loops(transport) -> bool:
    """Whether a loop body can hold `transport`'s boundary transfers: local ones, or those
    of a transport between processes that names them by `Crossing.label` (a loop's slot) and
    lets a rank send at the receiving task (`slot_named_transfers`, `ScheduleLoop`)."""
    return isinstance(transport, LocalTransport) or getattr(transport, "slot_named_transfers",
                                                            False)


def training_loop_plan(step) -> Optional[LoopPlan]:
    """The loop plan of `step`'s pipeline in training as far as the step decides it (`loop_plan`
    checks a run's rows too), or None if it runs unrolled."""
    schedule = step.schedule
    if (not step.pipeline_loop or len(step.stages) < 2 or step.plan.recompute
            or not transfers_in_loops(step.transport)):
        return None
    fixed = step.loop_fixed_actions()
    if fixed is None:
        return None
    return plan_loop([[(a.kind, a.chunk, a.micro_batch) for a in lst] for lst in schedule.lists],
                     step.replicas, schedule.placement, fixed)


def loop_plan(step, state: StepState) -> Optional[LoopPlan]:
    """The loop plan of `step`'s pipeline for this run, or None if it runs unrolled."""
    if not state.backward:
        return None
    plan = training_loop_plan(step)
    if plan is None:
        return None
    M = step.schedule.micro_batches
    n = state.global_batch // M
    for s, R in enumerate(step.replicas):
        for r in range(R):
            lo, hi = step.rows(s, r, 0, state.global_batch)
            if any(step.rows(s, r, m, state.global_batch) != (m * n + lo, m * n + hi)
                   for m in range(M)):
                return None     # not the [micro-batch, rows] layout the loop indexes
    return plan


class ScheduleLoop:
    """Builds one run's tasks of a `LoopPlan` into the step (`run`), leaving in the step's
    state what the unrolled actions would: gradient sums, loss terms, predictions and
    BatchNormalization statistics."""

    def __init__(self, step, state: StepState, plan: LoopPlan):
        self.step, self.state, self.plan = step, state, plan
        self.book = KeyBook(step.replicas)
        self.S, self.M = len(step.stages), step.schedule.micro_batches
        self.units = [(s, r) for s, R in enumerate(step.replicas) for r in range(R)]
        # This process's units; the plan covers all of them, so that every process cuts its
        # lists into the same segments and runs the same iterations of every loop.
        local = set(step.transport.local_units())
        self.local = [u for u in self.units if u in local]
        self.remote = not isinstance(step.transport, LocalTransport)
        self.lanes = sorted({step.lane(*u) for u in self.local})
        self.splits = {unit: self._split(unit) for unit in self.local}
        self.loop_index: Optional[int] = None     # of the loop being built, else None
        # (unit, kind) whose split function is inlined where it is called: in a loop body
        # that calls it once (see `_loop`); elsewhere it stays one function, called, since the
        # optimizer rewrites an inlined copy per call site (interleaved's 16 warm-up and
        # cool-down tasks and its body's two micro-batches of every chunk, inlined, made the
        # first call at M = 16 2.4 times M = 2's on MobileNetV2).
        self.inlined: set = set()
        # d(loss)/d(term), the same for every micro-batch: made once, outside the loop.
        with tf.device(step.device(self.S - 1, 0)):
            self.loss_gradient = scaled_one(tf.zeros([]), state.one, state.loss_scale)
        for unit in self.local:     # the feeds made here, outside every loop body
            step.fed(state, unit)
        self.list_rank: Optional[Dict[tuple, int]] = None    # `_in_list_order`'s, made once

    # ---- what every unit reads ----------------------------------------------------------------
    def _rows(self, unit: Unit) -> Tuple[int, int]:
        """[lo, hi) of the unit's rows within a micro-batch."""
        return self.step.rows(*unit, 0, self.state.global_batch)

    def _split(self, unit: Unit) -> StageSplit:
        """The unit's stage split for its rows, made once per signature."""
        lo, hi = self._rows(unit)
        return self.step.stage_split(self.state, unit, hi - lo,
                                     self.step.loss_share(self.state, unit, 0)[0])

    # ---- tasks --------------------------------------------------------------------------------
    def _crossing(self, boundary: int, micro_batch: int) -> Crossing:
        """The crossing of a task's `micro_batch` (relative to t inside a loop). Rows are the
        same for every micro-batch; inside a loop its transfers are named by their slot in the
        period (the loop's number and the relative micro-batch): the same op, under the same
        name, carries one micro-batch per iteration, and the peer's op of that slot carries the
        same micro-batch, since both build the same plan."""
        crossing = self.step.crossing(boundary, micro_batch if self.loop_index is None else 0,
                                      self.state.global_batch)
        if self.loop_index is None:
            return crossing
        return dataclasses.replace(crossing, slot=f"l{self.loop_index}.{micro_batch}")

    def _is_local(self, key: Key) -> bool:
        return key[1:3] in self.splits

    def _send(self, task: Task, m, values: dict) -> None:
        """Another process's `task`: send it what this process's units left for it, each
        value once (at its last reader), named as the receiving task names its receive."""
        for key in self.book.needs(task):
            if not self._is_local(key):
                continue
            last = values["readers"][key] == 1
            value = self._take(values, key, m)
            if not last:
                continue
            what, stage, replica, _ = key
            with tf.device(self.step.device(stage, replica)), \
                    tf.name_scope(f"stage{stage}/replica{replica}/send"):
                if what == OUTPUTS:
                    self.step.transport.send_activations(
                        self._crossing(stage, task.micro_batch), replica, value)
                elif what == GRADIENTS:
                    crossing = self._crossing(stage - 1, task.micro_batch)
                    self.step.transport.send_gradients(
                        crossing, replica, _with_zeros(crossing, replica, value))

    def _run(self, task: Task, m, values: dict, carry: dict) -> None:
        """Build `task` for micro-batch index `m` (an int, or a tensor in the loop), reading
        and leaving `values` by key; `carry` holds the sums, loss, tokens (one per lane: a
        device's tasks run in list order, whichever stage they compute) and the arrays."""
        unit = (task.stage, task.replica)
        if unit not in self.splits:
            self._send(task, m, values)
            return
        if task.kind == UPDATE:
            self._update(task, carry)
            return
        s, r = unit
        lane = self.step.lane(*unit)
        split = self.splits[unit]
        if (unit, task.kind) not in self.inlined:
            split = split.called()
        inputs_of, labels_of, weights_of = self.step.fed(self.state, unit)
        # Another process's keys arrive through the transport (which ignores `sent`).
        read = {k: self._take(values, k, m) for k in self.book.needs(task) if self._is_local(k)}
        with tf.device(self.step.device(*unit)), \
                tf.name_scope(f"stage{s}/replica{r}/{task.kind}"), \
                tf.control_dependencies([carry["token"][lane]]):
            if task.kind == FORWARD:
                if s == 0:
                    inputs = {tid: t[m] for tid, t in inputs_of.items()}
                else:
                    sent = {q: read.get((OUTPUTS, s - 1, q, task.micro_batch))
                            for q in range(self.step.replicas[s - 1])}
                    inputs = self.step.transport.receive_activations(
                        self._crossing(s - 1, task.micro_batch), r, sent)
                labels = weights = None
                if s == self.S - 1:
                    labels = [y[m] for y in labels_of]
                    weights = [None if w is None else w[m] for w in weights_of]
                self.step.before_forward(unit, task.micro_batch)
                # In a loop body the statistics come joined (`_loop` writes them as one row).
                outputs, term, statistics, residuals = split.forward(
                    inputs, labels, weights, joined_statistics=self.loop_index is not None)
                left = {(RESIDUALS, s, r, task.micro_batch): residuals}
                if s < self.S - 1:
                    left[(OUTPUTS, s, r, task.micro_batch)] = outputs
                else:
                    carry["loss"].append(term)
                    carry["predictions"].setdefault(r, []).append(
                        (task.micro_batch, [outputs[t] for t in self.step.output_ids]))
                carry["statistics"].setdefault(unit, []).append(statistics)
                produced = list(outputs.values()) + residuals
            elif task.kind == BACKWARD_WEIGHT:
                grads = split.backward_weight(read[(PENDING, s, r, task.micro_batch)])
                left = {}
                carry["sums"][unit] = self._accumulate(unit, carry["sums"][unit], grads)
                produced = grads
            else:
                residuals = read[(RESIDUALS, s, r, task.micro_batch)]
                if s == self.S - 1:
                    dys = [self.loss_gradient]
                else:
                    sent = {q: read.get((GRADIENTS, s + 1, q, task.micro_batch))
                            for q in range(self.step.replicas[s + 1])}
                    dys = self.step.transport.receive_gradients(
                        self._crossing(s, task.micro_batch), r, sent,
                        split.differentiated_outputs)
                    dys = [dys[tid] for tid in split.differentiated_outputs]
                left = {}
                if task.kind == BACKWARD_INPUT:
                    grads_in, pending = split.backward_input(residuals, dys)
                    left[(PENDING, s, r, task.micro_batch)] = pending
                    produced = list(grads_in.values()) + pending
                else:
                    grads_in, grads = split.backward(residuals, dys)
                    carry["sums"][unit] = self._accumulate(unit, carry["sums"][unit], grads)
                    produced = list(grads_in.values()) + grads
                if s:
                    left[(GRADIENTS, s, r, task.micro_batch)] = grads_in
            with tf.control_dependencies(produced):
                carry["token"][lane] = tf.identity(carry["token"][lane])
        for k, v in left.items():
            values[k] = v
            values.setdefault("readers", {})[k] = self.book.leaves(task)[k]

    def _update(self, task: Task, carry: dict) -> None:
        """UPDATE: the stage's gradient sums since its previous update, summed over its
        replicas here (its ALLREDUCE), go to the step's update (a relaxed step's); the sums
        start again from zero. The stage's first replica here builds it for all (the others'
        UPDATE tasks, earlier in an unrolled part's list order, only mark their place)."""
        step, state, s, u = self.step, self.state, task.stage, task.micro_batch
        replicas = [q for t, q in self.local if t == s]
        if task.replica != replicas[0]:
            return
        lane = step.lane(s, task.replica)
        with tf.device(step.device(s, task.replica)), \
                tf.name_scope(f"stage{s}/replica{task.replica}/{UPDATE}"), \
                tf.control_dependencies([carry["token"][lane]]):
            for q in replicas:
                sums = carry["sums"][(s, q)]
                if isinstance(sums, GradientAccumulators):
                    sums = sums.values(step.device(s, q))
                state.accumulated[(s, q)] = sums
            step._allreduce(state, s, replicas, Action(s, ALLREDUCE, u))
            done = list(step.dispatch[UPDATE](state, (s, task.replica), Action(s, UPDATE, u))
                        or [])
        for q in replicas:
            sums = carry["sums"][(s, q)]
            if isinstance(sums, GradientAccumulators):
                with tf.device(step.device(s, q)), tf.control_dependencies(done):
                    done += sums.zero()
            else:
                carry["sums"][(s, q)] = None
        # A loop's next iteration on this lane (its forward reads the new weights, its backward
        # adds to the zeroed sums) waits for all of it.
        with tf.device(step.device(s, task.replica)):
            carry["token"][lane] = _after_all(carry["token"][lane], done)

    def _accumulate(self, unit, sums, grads):
        """`sums` + `grads`: in place inside a loop, else the step's `Accumulator`."""
        if isinstance(sums, GradientAccumulators):
            sums.add(grads)
            return sums
        return self.step._accumulate(sums, grads, unit)

    def _packing(self, key: Key) -> "PackedElements":
        """How a collected residual's tensors are packed (by kind, stage, replica)."""
        if key[:3] not in self.packing:
            self.packing[key[:3]] = PackedElements(self.splits[key[1:3]].packed_residual_specs)
        return self.packing[key[:3]]

    def _take(self, values: dict, key: Key, m):
        """The value of `key` for micro-batch index `m`: a live one (dropped after its last
        reader), or its element of an earlier loop's collection."""
        if key not in values:           # read and unpacked where the reader runs
            first, arrays = self.collections[key[:3]]
            with tf.device(self.step.device(*key[1:3])):
                return self.packing[key[:3]].read(arrays, m - first)
        value = values[key]
        readers = values["readers"]
        readers[key] -= 1
        if not readers[key]:
            del readers[key], values[key]
        return value

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> None:
        state, step = self.state, self.step
        values: dict = {"readers": {}}
        self.collections: Dict[tuple, Tuple[int, List[tf.TensorArray]]] = {}
        self.packing: Dict[tuple, PackedElements] = {}
        carry = {"token": {lane: self._zeros(self.step.device(*lane), []) for lane in self.lanes},
                 "sums": {u: None for u in self.local}, "loss": [], "predictions": {},
                 "statistics": {}}
        if self.remote:     # read outside any loop body, which captures it
            step.transport.salt()
        loops = 0
        for part in self.plan.segments:
            if isinstance(part, Loop):
                for unit in self.local:     # a unit with no backward yet starts from zero
                    if carry["sums"][unit] is None:
                        carry["sums"][unit] = [
                            self._zeros(step.device(*unit), v.shape, v.dtype)
                            for v in step.stages[unit[0]].trainable_variables]
                self.loop_index, loops = loops, loops + 1
                self._loop(part, values, carry)
                self.loop_index, self.inlined = None, set()
                continue
            for task in self._in_list_order(part):
                self._run(task, task.micro_batch, values, carry)
            self._record(carry)
        if step.schedule.has_updates:
            return                  # every UPDATE took its sums
        for unit in self.local:
            sums = carry["sums"][unit]
            penalty = weight_penalty(step, state, unit, step.stages[unit[0]].trainable_variables)
            if penalty is not None:
                term, grads = penalty
                state.loss_terms.append(term)
                sums = [a + g for a, g in zip(sums, grads)]
            state.accumulated[unit] = sums

    def _in_list_order(self, tasks: List[Task]) -> List[Task]:
        """An unrolled part's tasks; with updates in the lists, in the schedule's own order
        (`step.order`, every replica of an action together): an update then follows every
        replica's backwards it sums, and precedes the forwards that read what it made."""
        if not self.step.schedule.has_updates:
            return tasks
        if self.list_rank is None:
            self.list_rank = {(a.kind, a.chunk, a.micro_batch): i
                              for i, (_, a) in enumerate(self.step.order)}
        return sorted(tasks, key=lambda t: (self.list_rank[(t.kind, t.stage, t.micro_batch)],
                                            t.replica))

    @staticmethod
    def _zeros(device: Optional[str], shape, dtype=tf.float32) -> tf.Tensor:
        """Zeros on `device`. A loop variable's Enter, Merge, Switch and NextIteration go where
        its first value was made: made on the default device, a stage's gradient sums crossed
        devices twice every iteration."""
        with tf.device(device):
            return tf.zeros(shape, dtype)

    @staticmethod
    def _plus_one(device: Optional[str], counter: tf.Tensor) -> tf.Tensor:
        with tf.device(device):
            return counter + 1

    def _record(self, carry) -> None:
        """Move what unrolled tasks left in `carry` into the step's state."""
        state = self.state
        state.loss_terms.extend(carry["loss"])
        for r, items in carry["predictions"].items():
            for m, predictions in items:
                state.predictions[(m, r)] = predictions
        for unit, calls in carry["statistics"].items():
            function = self.step.functions[unit[0]]
            for statistics in calls:
                for node_id, stats in function.slice_statistics(statistics).items():
                    state.statistics[unit].by_node.setdefault(node_id, []).append(stats)
        carry["loss"], carry["predictions"], carry["statistics"] = [], {}, {}

    def _loop(self, loop: Loop, values: dict, carry: dict) -> None:
        """Build `loop`; `values` (absolute keys) then holds what is live after it, and
        `self.collections` what it collected."""
        step, iterations, stride = self.step, loop.iterations, loop.stride
        local_carried = [k for k in loop.carried if self._is_local(k)]
        local_collected = [k for k in loop.collected if self._is_local(k)]
        readers = {k: values["readers"].pop(k) for k in local_carried}
        forwards = {}                       # unit -> its forwards per period, in body order
        for task in loop.body:
            if task.kind == FORWARD and (task.stage, task.replica) in self.splits:
                forwards.setdefault((task.stage, task.replica), []).append(task.micro_batch)
        last = [u for u in forwards if u[0] == self.S - 1]

        sites = collections.Counter(((t.stage, t.replica), t.kind) for t in loop.body)
        # With updates in the body (PipeDream) every split stays a call: inlined, a forward's
        # reads of the weights lost the call's order after the previous iteration's update (a
        # 3-stage PipeDream loop read stale weights in 2 of 6 runs).
        self.inlined = set() if any(t.kind == UPDATE for t in loop.body) else {
            site for site, n in sites.items() if n == 1}
        backward = {(task.stage, task.replica) for task in loop.body
                    if task.kind != FORWARD and (task.stage, task.replica) in self.splits}
        sums = dict(carry["sums"])
        for u in backward:
            if u not in step.loop_accumulators:     # a view of the sums the step made for `u`
                step.loop_accumulators[u] = GradientAccumulators(step._accumulate, u)
            sums[u] = step.loop_accumulators[u]
            sums[u].start(carry["sums"][u], step.device(*u))

        # t, one counter per device: a unit indexes its inputs and arrays with its own
        devices = sorted({step.device(*u) for u in self.local}, key=str)

        def arrays(unit, specs, size):
            with tf.device(step.device(*unit)):
                return [tf.TensorArray(spec.dtype, size=size, element_shape=spec.shape)
                        for spec in specs]

        carried = {k: CarriedValue(values[k], step.device(*k[1:3])) for k in local_carried}
        start = {
            "token": dict(carry["token"]),
            "counters": {d: self._zeros(d, [], tf.int32) for d in devices},
            "loss": self._zeros(step.device(*last[0]) if last else None, []),
            "values": {k: carried[k].pack_value(values.pop(k)) for k in local_carried},
            "collected": {k: self._packing(k).arrays(step.device(*k[1:3]), iterations)
                          for k in local_collected},
            "predictions": {u: arrays(u, [self._prediction_spec(u, k)
                                          for k in range(len(step.output_ids))],
                                      iterations * len(forwards[u])) for u in last},
            "statistics": {u: arrays(u, [tf.TensorSpec([self._statistics_width(u)])] * 2,
                                     iterations * len(forwards[u]))
                           for u in forwards if self.splits[u].statistics_keys},
        }
        transport = step.transport
        if self.remote:     # what keeps the body's transfers (see `_kept`)
            start["kept"] = self._zeros(step.device(*self.local[0]), [])

        def body(now):
            counters = now["counters"]
            values = {k: carried[k].unpack_value(v) for k, v in now["values"].items()}
            values["readers"] = dict(readers)
            inner = {"token": dict(now["token"]), "sums": dict(sums), "loss": [],
                     "predictions": {}, "statistics": {}}
            mark = len(transport.pending) if self.remote else 0
            for task in loop.body:
                device = step.device(task.stage, task.replica)
                with tf.device(device):
                    m = counters[device] * stride + task.micro_batch
                self._run(task, m, values, inner)
            kept = {}
            if self.remote:
                kept["kept"] = self._kept(now["kept"], transport.pending[mark:])
                del transport.pending[mark:]
            collected = {}
            for k, written in now["collected"].items():
                with tf.device(step.device(*k[1:3])):
                    collected[k] = self.packing[k[:3]].write(
                        written, counters[step.device(*k[1:3])], values.pop(k))
            shifted = {(k[0], k[1], k[2], k[3] - stride): v for k, v in values.items()
                       if k != "readers"}
            loss = now["loss"]
            if inner["loss"]:
                with tf.device(step.device(*last[0])):
                    loss = loss + tf.add_n(inner["loss"])
            predictions = {}
            for u, written in now["predictions"].items():
                for i, (_, outs) in enumerate(inner["predictions"][u[1]]):
                    with tf.device(step.device(*u)):
                        index = counters[step.device(*u)] * len(forwards[u]) + i
                        written = [a.write(index, o) for a, o in zip(written, outs)]
                predictions[u] = written
            statistics = {}
            for u, (means, m2s) in now["statistics"].items():
                for i, (mean, m2) in enumerate(inner["statistics"][u]):
                    with tf.device(step.device(*u)):
                        index = counters[step.device(*u)] * len(forwards[u]) + i
                        means, m2s = means.write(index, mean), m2s.write(index, m2)
                statistics[u] = [means, m2s]
            counters = {d: self._plus_one(d, c) for d, c in counters.items()}
            return [{"counters": counters, "loss": loss, "token": inner["token"],
                     "values": {k: carried[k].pack_value(shifted[k]) for k in local_carried},
                     "collected": collected,
                     "predictions": predictions, "statistics": statistics, **kept}]

        # Across processes one iteration at a time: a slot's transfer is one op under one
        # name, and Horovod refuses a name while a transfer of it is still in flight.
        mark = step.loop_events()
        with tf.compat.v1.device(_identity_beside_its_input):
            (end,) = tf.while_loop(lambda now: now["counters"][devices[0]] < iterations, body,
                                   [start], maximum_iterations=iterations,
                                   parallel_iterations=1 if self.remote else 10)
        step.after_loop(mark, iterations)
        if self.remote:
            transport.pending.append(end["kept"])
        carry["token"] = end["token"]
        for u, accumulators in sums.items():
            if isinstance(accumulators, GradientAccumulators):
                carry["sums"][u] = accumulators.read(step.device(*u))
        if last:
            self.state.loss_terms.append(end["loss"])
        for u, written in end["predictions"].items():
            stacked = [a.stack() for a in written]
            for t in range(iterations):
                for i, c in enumerate(forwards[u]):
                    self.state.predictions[(t * stride + c, u[1])] = [
                        p[t * len(forwards[u]) + i] for p in stacked]
        for u, (means, m2s) in end["statistics"].items():
            self._record_loop_statistics(u, means.stack(), m2s.stack())
        for k, written in end["collected"].items():    # read in place, element by element
            self.collections[k[:3]] = (k[3], written)
        advance = iterations * stride
        values.update({(w, s, r, m + advance): carried[(w, s, r, m)].unpack_value(v)
                       for (w, s, r, m), v in end["values"].items()})
        values["readers"].update({(w, s, r, m + advance): n
                                  for (w, s, r, m), n in readers.items()})

    def _kept(self, kept: tf.Tensor, outputs: List[tf.Tensor]) -> tf.Tensor:
        """The transport's `kept`: an exact 0 added to `kept` that makes the loop's result
        depend on each transfer of its body (the step then adds it to its loss; unread,
        TensorFlow drops a collective and the peers wait forever)."""
        with tf.device(self.step.device(*self.local[0])):
            return self.step.transport.kept(kept, outputs)

    # ---- shapes of what the loop collects -----------------------------------------------------
    def _prediction_spec(self, unit: Unit, k: int):
        specs = self.splits[unit].forward_function.structured_outputs[0]
        return specs[self.splits[unit].output_ids.index(self.step.output_ids[k])]

    def _statistics_width(self, unit: Unit) -> int:
        split = self.splits[unit]
        outs = split.forward_function.structured_outputs[0]
        first = len(split.output_ids) + int(split.has_term)
        return sum(outs[first + 2 * i].shape.num_elements()
                   for i in range(len(split.statistics_keys)))

    def _record_loop_statistics(self, unit: Unit, means: tf.Tensor, m2s: tf.Tensor) -> None:
        """The loop's statistics of `unit` (one row per forward) combined into one slice per
        BatchNormalization call, as `micro_batch_loop` does."""
        function, split = self.step.functions[unit[0]], self.splits[unit]
        outs = split.forward_function.structured_outputs[0]
        first = len(split.output_ids) + int(split.has_term)
        shapes = [outs[first + 2 * i].shape for i in range(len(split.statistics_keys))]
        widths = [s.num_elements() for s in shapes]
        with tf.device(self.step.device(*unit)):
            rows = function.statistics_rows
            counts = tf.concat([tf.fill([w], float(rows[k]))
                                for k, w in zip(split.statistics_keys, widths)], 0)
            mean, m2 = bstats.combine_stacked(counts, means, m2s)
        forwards = int(means.shape[0])
        for key, shape, mean, m2 in zip(split.statistics_keys, shapes, tf.split(mean, widths),
                                        tf.split(m2, widths)):
            self.state.statistics[unit].by_node.setdefault(id(function.nodes[key]), []).append(
                bstats.SliceStatistics(rows[key] * forwards, tf.reshape(mean, shape),
                                       tf.reshape(m2, shape)))


class CarriedValue:
    """A value a loop carries from one period to the next (a forward's outputs or residuals, a
    backward's input gradients, an I's leftovers), packed as `PackedElements` on its unit's
    device: one loop variable per dtype instead of one per tensor."""

    def __init__(self, value, device: Optional[str]):
        self.structure, self.device = value, device
        self.packing = PackedElements([tf.TensorSpec(t.shape, t.dtype)
                                       for t in tf.nest.flatten(value)])

    def pack_value(self, value) -> List[tf.Tensor]:
        with tf.device(self.device):
            return self.packing.pack(tf.nest.flatten(value))

    def unpack_value(self, packed: Sequence[tf.Tensor]):
        with tf.device(self.device):
            return tf.nest.pack_sequence_as(self.structure, self.packing.unpack(packed))


class GradientAccumulators:
    """A unit's gradient sums during a loop: the step's `Accumulator`'s sums of the unit
    (variables on its device), holding what the warm-up added, added to in place by each
    iteration's backward and read after it (TensorFlow orders the assignments and reads of one
    variable as written); the cool-down adds on in place. Kept by the step between calls: the
    memory of one set of the stage's gradients."""

    def __init__(self, accumulator, unit: Unit):
        self.accumulator, self.unit = accumulator, unit
        self.variables = accumulator.own_sums[unit]

    def start(self, sums: List[tf.Tensor], device: Optional[str]) -> None:
        if self.accumulator.holds(self.unit, sums) and all(s is not None for s in sums):
            return                  # the warm-up added there already
        with tf.device(device):
            for v, s in zip(self.variables, sums):
                v.assign(s)

    def add(self, gradients: List[Optional[tf.Tensor]]) -> None:
        for v, g in zip(self.variables, gradients):
            if g is not None:
                v.assign_add(g)

    def read(self, device: Optional[str]) -> List[tf.Tensor]:
        with tf.device(device):
            return self.accumulator.held(self.unit, [v.read_value() for v in self.variables])

    def values(self, device: Optional[str]) -> List[tf.Tensor]:
        """The sums as they are now (inside a loop body: an update's)."""
        with tf.device(device):
            return [v.read_value() for v in self.variables]

    def zero(self) -> List[tf.Operation]:
        return [v.assign(tf.zeros(v.shape, v.dtype), read_value=False) for v in self.variables]


def _after_all(token: tf.Tensor, ops: Sequence) -> tf.Tensor:
    """`token`, ready once `ops` have run."""
    with tf.control_dependencies(list(ops)):
        return tf.identity(token)


def _with_zeros(crossing: Crossing, replica: int, grads) -> dict:
    """`grads` (a backward's input gradients by id) with zeros for the crossing's float
    tensors the backward gives none: the transfer carries all of them."""
    lo, hi = crossing.receiver_rows[replica]
    out = dict(grads)
    for tid, spec in crossing.specs.items():
        if tid in crossing.ids and spec.dtype.is_floating and tid not in out:
            out[tid] = tf.zeros([hi - lo] + spec.shape.as_list()[1:], spec.dtype)
    return out


def _identity_beside_its_input(op) -> str:
    """The device of an Identity made with none (the body's return values, which the while
    loop's function adds) is its input's: left to the placer, a device's loop variable went
    to the first device and back every iteration (two sends)."""
    if op.type == "Identity" and not op.device and op.inputs and op.inputs[0].device:
        return op.inputs[0].device
    return op.device


def run_schedule_loop(step, state: StepState, plan: LoopPlan) -> None:
    """Build `plan` for this run (inside the step's trace); see `ScheduleLoop`."""
    ScheduleLoop(step, state, plan).run()
