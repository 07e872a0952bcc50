"""The relaxed schedules in the runtime: PipeDream, PipeDream-2BW and AvgPipe, whose lists
(`planner.schedules.relaxed_lists`, `planner.schedules.avgpipe_pipelines`) run k global batches without a flush and update the
weights inside the step.

`relaxed(step_class)` is `step_class` (the local `PipelineStep` or Horovod's) with these
schedules' actions; the executor is the same. One call of `run` is one run of k global batches
(k = its rows / the plan's global batch; AvgPipe's N pipelines take N batches each step): the
schedule of k batches is built once per k, micro-batch j of the run is rows block j % M of
global batch j // M.

* Versions. A forward reads the weight version its action names, relative to the run's start
  (`planner.schedules.run_versions`: negative for the versions earlier runs made, which the rule reads
  across a run boundary; all of them the initial weights on the first run). The stage computes
  with its Keras variables, so `graph_rewrite.version_book` plans, from the run's events, which
  version the variables hold before each forward and which versions wait in slots
  (`graph_rewrite.weight_store`). A backward differentiates its forward's tape, which kept the
  values its forward read (weight stashing); with recomputation it reloads its version first.
  Between runs the variables hold the latest version (AvgPipe: the reference z) and the slots
  the versions the next run reads.
* `ALLREDUCE u` then `UPDATE u` (PipeDream, 2BW): the chunk's gradients since its previous
  update, summed over its replicas, go to the stage's optimizer (`optimizers[(stage, 0)]`),
  which makes version u + 1 from version u in place. PipeDream's update follows every
  backward: its loss term is its micro-batch's mean (a PipeDream minibatch is a micro-batch),
  2BW's the global batch's.
* AvgPipe (`Schedule.averaging`): replica i of every stage is pipeline i, with its own weights
  w_i (a slot), its own optimizer (`optimizers[(stage, i)]`) and whole micro-batches of its own
  global batch (`arrange` puts the run's N batches per step side by side so that replica
  slicing gives each pipeline its batch). `UPDATE t` with Delta_i the optimizer's step from
  pipeline i's gradient: w_i <- (1 - a) w_i + a z + Delta_i, z from before the step;
  `ALLREDUCE t` sums the Delta_i over the pipelines and z <- z + sum_i Delta_i / N; a = 1/N.
* Loops (`graph_rewrite.schedule_loop`, `pipeline_loop`): PipeDream's and 2BW's periodic parts
  run as `tf.while_loop`s, the updates as the loop's UPDATE tasks; `loop_fixed_actions` keeps
  out of a loop every action before which the version book moves weights (a body is built
  once and moves nothing), and `after_loop` checks the events its other iterations stand for.
  AvgPipe, weight penalties and recomputation run unrolled.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from graph_rewrite.keras_adapter import tf_variables
from graph_rewrite.version_book import MovePlan, Read, Write, plan_moves
from graph_rewrite.weight_store import WeightStore
from planner.schedules.actions import BACKWARD, FORWARD, UPDATE, Schedule
from planner.schedules.replay import replay
from planner.schedules.run_versions import carried, relative_versions, update_count
from planner.schedules.by_name import plan_schedule
from planner.formats.slicing import unit_rows


@dataclass
class Run:
    """One run length's schedule and copies, and the cursor of a trace through them."""
    schedule: Schedule
    order: list
    versions: Dict[Tuple[int, int], int]
    events: Dict[int, list]
    moves: Dict[int, MovePlan]
    cursor: Dict[int, int] = field(default_factory=dict)
    deltas: Dict[Tuple[int, int], list] = field(default_factory=dict)
    fixed: Optional[list] = None        # per position, what no loop may hold (as loops run it)


def relaxed(step_class):
    """`step_class` running a relaxed plan's runs."""
    return type(f"Relaxed{step_class.__name__}", (RelaxedSteps, step_class), {})


class RelaxedSteps:
    """Mixed in before a `PipelineStep` class (see `relaxed`)."""

    # A loop's backward differentiates at the weights its forward read (`stage_split`).
    stashes_weights = True

    def __init__(self, *args, max_batches: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        plan = self.plan
        if not plan.schedule.relaxed:
            raise ValueError(f"schedule {plan.schedule.name!r} is not relaxed; use PipelineStep")
        if plan.global_batch_size is None:
            raise ValueError("a relaxed schedule needs the plan's global_batch_size (a run is "
                             "a number of global batches)")
        self.averaging = plan.schedule.averaging
        self.pipelines = self.replicas[0] if self.averaging else 1
        self.run_rows = plan.global_batch_size * self.pipelines      # rows of one batch step
        self.dispatch[UPDATE] = self._update
        self.optimizers: Dict[Tuple[int, int], object] = {}
        units = self.transport.local_units()
        self.local = {s: sorted(r for t, r in units if t == s) for s, _ in units}
        self._runs: Dict[int, Run] = {}
        self._current: Optional[Run] = None
        # Versions from before a run that runs read: kept in slots 0.. from one run to the next.
        self.carry = carried(relative_versions(self._build, max_batches), len(self.stages))
        slots = {s: max(self._run(k).moves[s].slots for k in range(1, max_batches + 1))
                 for s in self.local}
        self.stores = {s: WeightStore(self.stages[s].trainable_variables, slots[s],
                                      self.device(s, self.local[s][0]), f"dapple_stage{s}",
                                      reference=self.averaging)
                       for s in self.local if self.stages[s].trainable_variables}

    # ---- what the runtime needs ---------------------------------------------------------------
    def optimizer_keys(self) -> List[Tuple[int, int]]:
        """(stage, pipeline) of every optimizer this process's updates use (pipeline 0 unless
        AvgPipe), for stages with trainable variables."""
        return [(s, r if self.averaging else 0) for s in sorted(self.stores)
                for r in (self.local[s] if self.averaging else self.local[s][:1])]

    def reset_history(self) -> None:
        """Start the rule afresh from the variables' weights (eagerly): every earlier version,
        every pipeline's weights and the reference are these."""
        for store in self.stores.values():
            store.fill()

    def arrange(self, parts):
        """AvgPipe: the run's rows, N global batches per step one after another, reordered so
        that micro-batch j holds block j % M of each pipeline's batch side by side (replica i's
        slice is pipeline i's). Other schedules: as given. `parts`: nested tensors or None."""
        if not self.averaging:
            return parts
        N, M, B = self.pipelines, self.plan.micro_batches, self.plan.global_batch_size

        def one(t):
            if t is None:
                return None
            rest = list(t.shape[1:])
            k = int(t.shape[0]) // (N * B)
            t = tf.reshape(t, [k, N, M, B // M] + rest)
            t = tf.transpose(t, [0, 2, 1, 3] + list(range(4, 4 + len(rest))))
            return tf.reshape(t, [k * N * B] + rest)
        return tf.nest.map_structure(one, parts)

    # ---- runs ---------------------------------------------------------------------------------
    def _run(self, batches: int) -> Run:
        if batches not in self._runs:
            schedule = self._build(batches)
            versions = relative_versions(self._build, batches)
            if any(c > k for c, k in zip(carried(versions, len(self.stages)), self.carry)):
                raise ValueError(f"a run of {batches} batches reads older versions than the "
                                 f"runs this step was made for keep")
            order = replay(schedule).order
            events, moves = {}, {}
            for s in self.local:
                events[s] = self._events(order, s, versions)
                moves[s] = self._plan_moves(s, events[s], update_count(schedule)[s])
            self._runs[batches] = Run(schedule, order, versions, events, moves)
        return self._runs[batches]

    def _build(self, batches: int) -> Schedule:
        return plan_schedule(dataclasses.replace(self.plan, batches=batches))

    def _key(self, pipeline: int, version: int):
        return ("w", pipeline, version) if self.averaging else version

    def _owners(self, stage: int) -> List[int]:
        """The local replicas whose actions move weights: each pipeline's under AvgPipe; else
        the first (a stage's replicas here share its variables and read the same versions).
        Of another process's stage, as that process sees it (PipeDream, 2BW: replica 0)."""
        if stage not in self.local:
            return [0]
        return self.local[stage] if self.averaging else self.local[stage][:1]

    def _events(self, order, stage: int, versions) -> list:
        out = []
        for _, a in order:
            if a.chunk != stage:
                continue
            for r in self._owners(stage):
                p = r if self.averaging else 0
                if a.kind == FORWARD or (a.kind == BACKWARD and self.plan.recompute):
                    out.append(Read(self._key(p, versions[(stage, a.micro_batch)])))
                elif a.kind == UPDATE:
                    out.append(Write(self._key(p, a.micro_batch),
                                     self._key(p, a.micro_batch + 1)))
        return out

    def _plan_moves(self, stage: int, events, updates: int) -> MovePlan:
        if self.averaging:
            mine = {("w", r, 0): i for i, r in enumerate(self.local[stage])}
            end = {("w", r, updates): i for i, r in enumerate(self.local[stage])}
            return plan_moves(events, ("z",), mine, None, end)
        d = range(1, self.carry[stage] + 1)
        return plan_moves(events, 0, {-i: i - 1 for i in d}, updates,
                          {updates - i: i - 1 for i in d})

    def _event(self, stage: int, event) -> None:
        """Make the copies the run's next event of `stage` needs (checked against the plan)."""
        if stage not in self.stores:
            return
        run, i = self._current, self._current.cursor.get(stage, 0)
        if run.events[stage][i] != event:
            raise AssertionError(f"stage {stage}: event {i} is {event}, planned "
                                 f"{run.events[stage][i]}")
        self.stores[stage].move(run.moves[stage].before[i])
        run.cursor[stage] = i + 1

    # ---- as a schedule loop (`schedule_loop`) --------------------------------------------------
    def loop_fixed_actions(self):
        """Per position, the list actions a loop may not hold: an update of a stage with
        several replicas (its sum meets them all), and an action before which the weights move
        between the variables and the slots (a loop's body moves nothing). Computed from
        every stage's events, so every process cuts the lists alike. None (no loop) for
        AvgPipe, whose pipelines' weights take turns in a stage's variables, and for models
        with weight penalties (counted once per update, which a loop's sums do not place)."""
        if getattr(self, "_current", None) is None or self.averaging or any(
                self.weight_penalties[s] for s in range(len(self.stages))):
            return None
        run = self._current
        if run.fixed is None:
            run.fixed = []
            for p, lst in enumerate(run.schedule.lists):
                fixed, events = set(), 0
                stage = lst[0].chunk if lst else p
                moves = self._plan_moves(stage, self._events(run.order, stage, run.versions),
                                         update_count(run.schedule)[stage])
                for i, a in enumerate(lst):
                    if a.chunk != stage:
                        return None         # one stage per position
                    if a.kind in (FORWARD, UPDATE):
                        if moves.before[events]:
                            fixed.add(i)
                        events += 1
                    if a.kind == UPDATE and self.replicas[stage] > 1:
                        fixed.add(i)
                run.fixed.append(frozenset(fixed))
        return run.fixed

    def before_forward(self, unit, micro_batch: int) -> None:
        if unit[1] in self._owners(unit[0]):
            self._event(unit[0], Read(self._key(unit[1], self._current.versions[
                (unit[0], micro_batch)])))

    def loop_events(self):
        return dict(self._current.cursor)

    def after_loop(self, mark, iterations: int) -> None:
        """The events of the loop's other iterations, which its body (built once, for the
        first) stands for: each stage's as many again, none of them moving weights."""
        run = self._current
        for s in self.stores:
            start, now = mark.get(s, 0), run.cursor.get(s, 0)
            end = now + (now - start) * (iterations - 1)
            if any(run.moves[s].before[i] for i in range(now, end)):
                raise AssertionError(f"stage {s}: a loop's events {now}..{end} move weights")
            run.cursor[s] = end

    # ---- the step -----------------------------------------------------------------------------
    def run(self, x, y=None, training: bool = True, **kwargs):
        if y is None or not training:
            raise ValueError("a relaxed schedule's step trains; evaluate and predict run the "
                             "plan's synchronous step")
        rows = int(tf.nest.flatten(x)[0].shape[0])
        if rows % self.run_rows:
            raise ValueError(f"a run of schedule {self.plan.schedule.name!r} takes whole steps of "
                             f"{self.run_rows} rows ({self.pipelines} x the global batch "
                             f"{self.plan.global_batch_size}); got {rows}")
        run = self._run(rows // self.run_rows)
        run.cursor, run.deltas = {}, {}
        self._current = run
        self.schedule, self.order = run.schedule, run.order
        result = super().run(x, y, training, **kwargs)
        for s, store in self.stores.items():
            if run.cursor.get(s, 0) != len(run.events[s]):
                raise AssertionError(f"stage {s}: {run.cursor.get(s, 0)} of "
                                     f"{len(run.events[s])} planned events were built")
            store.move(run.moves[s].finish)
            store.permute(run.moves[s].permute)
            if self.averaging:
                store.load_reference()
        # The loss per global batch: every term averages over loss_rows rows.
        result.loss = result.loss * (self._loss_rows() / rows)
        return result

    def rows(self, stage: int, replica: int, micro_batch: int,
             global_batch: int) -> Tuple[int, int]:
        return unit_rows(global_batch, self.schedule.micro_batches, self.replicas[stage],
                         micro_batch, replica)

    def _loss_rows(self) -> int:
        B = self.plan.global_batch_size
        return B // self.plan.micro_batches if self.plan.schedule.updates_every_micro_batch else B

    def loss_share(self, state, unit, m: int) -> Tuple[int, bool]:
        """PipeDream: every micro-batch is a minibatch of its own (its mean loss, the weight
        penalties once in it); 2BW: the global batch; AvgPipe: each pipeline's global batch."""
        first = m % (1 if self.plan.schedule.updates_every_micro_batch
                     else self.plan.micro_batches) == 0
        return self._loss_rows(), first and (unit[1] == 0 or self.averaging)

    def _forward(self, state, unit, action):
        if unit[1] in self._owners(unit[0]):
            self._event(unit[0], Read(self._key(unit[1], self._version(unit[0], action))))
        return super()._forward(state, unit, action)

    def _backward(self, state, unit, action):
        if self.plan.recompute and unit[1] in self._owners(unit[0]):
            self._event(unit[0], Read(self._key(unit[1], self._version(unit[0], action))))
        return super()._backward(state, unit, action)

    def _version(self, stage: int, action) -> int:
        return self._current.versions[(stage, action.micro_batch)]

    def _allreduce(self, state, stage: int, replicas: List[int], action) -> None:
        u, device = action.micro_batch, self.device(stage, 0)
        if not self.averaging:      # the gradients UPDATE u applies, summed over replicas
            per_replica = {r: state.accumulated.pop((stage, r)) for r in replicas}
            state.reduced[stage] = self.transport.sum_replicas(stage, per_replica, device,
                                                               tag=f"ar{u}_")
            return
        deltas = {r: self._current.deltas.pop((stage, r)) for r in replicas}
        if stage not in self.stores:
            return
        total = self.transport.sum_replicas(stage, deltas, device, tag=f"avg{u}_")
        for z, t in zip(self.stores[stage].reference, total):
            z.assign_add(t / self.pipelines)

    def _update(self, state, unit, action):
        stage, replica = unit
        u = action.micro_batch
        if replica not in self._owners(stage):
            return None
        if self.averaging:
            grads = state.accumulated.pop(unit)
        else:
            grads = state.reduced.pop(stage)
        variables = self.stages[stage].trainable_variables
        if not variables:
            self._current.deltas[unit] = []
            return None
        p = replica if self.averaging else 0
        self._event(stage, Write(self._key(p, u), self._key(p, u + 1)))
        optimizer = self.optimizers[(stage, p)]
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not self.averaging:
            done = optimizer.apply_gradients(pairs)
            # What the optimizer returns need not follow every variable's assignment; what
            # waits for the update (a loop's next iteration: nothing else orders it) waits for
            # the new values, read where nothing keeps them.
            with tf.control_dependencies([done] if isinstance(done, (tf.Tensor, tf.Operation))
                                         else []):
                return [tf.group([v.read_value() for v in tf_variables(variables)])]
        variables = tf_variables(variables)     # what is read and assigned (Keras 3 wraps one)
        before = [v.read_value() for v in variables]
        with tf.control_dependencies(before):
            done = optimizer.apply_gradients(pairs)
        with tf.control_dependencies([done] if done is not None else []):
            after = [v.read_value() for v in variables]
        a = 1.0 / self.pipelines
        z = [r.read_value() for r in self.stores[stage].reference]
        self._current.deltas[unit] = [w1 - w0 for w0, w1 in zip(before, after)]
        # The assigned values: ready once the assignments are (the lane's next action waits).
        return [v.assign(w1 + a * (zz - w0), read_value=True)
                for v, w0, w1, zz in zip(variables, before, after, z)]
