"""The pipelined training step: a Keras model + a Plan -> gradients of one global batch.

Built inside a `tf.function`, one graph per step (the paper's §V design on TF2), by a small
executor over the plan's lowered schedule (`planner.schedules.lowering`: the same action lists the
simulator replays):

* Units. Every (stage s, replica r) is a unit; it runs stage s's action list on its rows of
  every micro-batch, on the replica's device. The executor takes the actions in `planner.schedules.replay`
  order (which respects every data dependency) and dispatches each to one method per kind
  (`_forward`, `_backward`, `_send_forward`, ...) over an explicit `StepState`.
* Forward and backward. A forward calls the stage's traced-once function
  (`graph_rewrite.stage_function`) on its rows under its own `tf.GradientTape`; the backward
  asks that tape for the gradients of the stage's outputs (weighted by the gradients that came
  back from stage s+1) with respect to its inputs and the stage's variables. With `recompute`,
  the forward keeps only its inputs and the backward calls the function again under a tape.
* Split backward (zb-h1's I and W): the stage's split functions (`graph_rewrite.stage_split`,
  the ones `schedule_loop` runs): the forward returns its residuals, I reads them and hands
  W what it needs; three call ops per micro-batch, as 1F1B's forward and backward are two.
* Boundaries. A `Transport` moves boundary tensors forward and their gradients backward: the
  local one (`graph_rewrite.local_transport`) slices and concatenates row ranges on the
  receiving device; `dapple.runtime.horovod.transport` moves them between processes.
* Update. Each unit's variable gradients are accumulated over micro-batches; ALLREDUCE sums
  them across the stage's replicas (locally an add on the stage's first device), and they are
  handed back aligned with `model.trainable_variables` for one `apply_gradients`.
* Order. Every op of an action depends on the previous compute action of its device (its lane:
  position and replica; an interleaved position runs several chunks, and `stage` below means
  the chunk), through control dependencies on its tensors; a send does not hold its device back,
  a receive does. A lane alone in its process on a CPU keeps two actions in flight instead
  (`graph_rewrite.in_flight`): an action waits for those two and three back. Each action is
  built under the name scope `stage{s}/replica{r}/{kind}{m}` so the traced graph can be read
  back and checked
  (`tests/graph_rewrite/test_schedule_lowering.py`); TF names the gradient ops a tape builds
  `gradient_tape/<forward op name>`: those belong to B{m}.
* Loops: with `micro_batch_loop`, a one-stage plan's lanes as loops (`micro_batch_loop.py`),
  a pipeline's steady periods as one loop between warm-up and cool-down (`schedule_loop.py`).
  A unit reads the working copies of its device if a runtime made them (`working_copies.py`).
* Training state. BatchNormalization calls normalize with their slice's statistics, as in
  GPipe and DAPPLE ("ghost batches"); their moving statistics move once per step, from the
  whole global batch (`graph_rewrite.batch_statistics`).

Gradients equal the plain model's: each slice's loss term is its share of the global batch
loss (`losses.PipelineLoss`), the rest is exact re-association of sums. Weight penalties
(`kernel_regularizer`...) are added once per step, by the first unit of the stage that owns the
weights; losses from activations (`add_loss`) are refused by `dapple.PipelinedModel`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite import cut_rows, in_flight
from graph_rewrite.local_transport import Crossing, LocalTransport, Tensors, Unit
from graph_rewrite.losses import PipelineLoss, per_output, weight_penalties_by_stage
from graph_rewrite.micro_batch_loop import LaneLoop, loops_lanes, run_lane, weight_penalty
from graph_rewrite.model_graph import StageGraph, cut_model, model_input_ids, model_output_ids
from graph_rewrite.schedule_loop import loop_plan, run_schedule_loop
from graph_rewrite.stage_function import StageFunction
from graph_rewrite.stage_gradients import is_float, scaled_one, stage_gradients, watch_inputs
from graph_rewrite.stage_split import StageSplit, split_stage
from graph_rewrite.step_state import Stashed, StepState
from planner.schedules.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                             RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD, Action)
from planner.formats.plan import Plan
from planner.schedules.replay import replay
from planner.schedules.by_name import plan_schedule
from planner.formats.slicing import check_even, unit_rows

FORWARD_ONLY = (FORWARD, SEND_FORWARD, RECV_FORWARD)


def task_scope(stage: int, replica: int, kind: str, micro_batch: Optional[int]) -> str:
    return f"stage{stage}/replica{replica}/{kind}{'' if micro_batch is None else micro_batch}"


@dataclass
class StepResult:
    loss: tf.Tensor
    gradients: List[Optional[tf.Tensor]]          # aligned with model.trainable_variables
    predictions: List[List[tf.Tensor]] = field(default_factory=list)  # per output, row order
    global_batch: int = 0
    # (stage, replica >= 1) -> the stage's summed gradients on that replica's device, aligned
    # with the stage's trainable variables: the stages in `PipelineStep.sum_on_every_replica`
    replica_gradients: Dict[Tuple[int, int], List[Optional[tf.Tensor]]] = field(
        default_factory=dict)


class PipelineStep:
    """Builds the pipelined forward/backward of one global batch for `model` and `plan`."""
    def __init__(self, model: tf.keras.Model, plan: Plan, loss: PipelineLoss,
                 devices: Sequence[str], transport=None,
                 stages: Optional[List[StageGraph]] = None, micro_batch_loop: bool = False,
                 pipeline_loop: bool = False, inline_stage_calls: bool = False):
        """`stages`: the model cut by the plan (`model_graph.cut_model`), if already cut;
        `micro_batch_loop`: a data-parallel plan's lanes as loops (`micro_batch_loop`);
        `pipeline_loop`: a pipeline's steady periods as one (`schedule_loop`);
        `inline_stage_calls`: stage calls inlined into the step (`StageFunction`'s `inlined`)."""
        self.model = model
        self.plan = plan
        self.loss = loss
        self.micro_batch_loop = micro_batch_loop
        self.pipeline_loop = pipeline_loop
        self.stages: List[StageGraph] = stages if stages is not None else cut_model(
            model, [tuple(s.layers) for s in plan.stages])
        self.replicas = [s.replicas for s in plan.stages]
        self._devices = list(devices)
        self.schedule = plan_schedule(plan)
        self.order = replay(self.schedule).order          # lowered actions, dependencies first
        self.input_ids = model_input_ids(model)
        self.output_ids = model_output_ids(model)
        self.weight_penalties = weight_penalties_by_stage(self.stages)
        self.functions = [StageFunction(g, loss, self.output_ids, g is self.stages[-1],
                                        bool(self.weight_penalties[s]), inline_stage_calls)
                          for s, g in enumerate(self.stages)]
        self.lane_loops = [LaneLoop(f) for f in self.functions]   # `micro_batch_loop`
        self.stage_splits: Dict[tuple, StageSplit] = {}   # made once per signature
        self.schedule_loops = 0     # traces that built a pipeline's steady periods as loops
        self.loop_accumulators: Dict[tuple, object] = {}   # `schedule_loop`'s, by unit
        self._accumulate = Accumulator(inline_stage_calls)
        self._combine_statistics = bstats.CallCombiner()
        self.transport = transport if transport is not None else LocalTransport(self.replicas)
        # Stages whose every replica trains its own weights (a runtime's choice), so each needs
        # the sum on its own device: the replicas exchange gradients, nothing comes back.
        self.sum_on_every_replica: Set[int] = set()
        with tf.init_scope():
            # Made here, not in the step: a tf.function that creates a variable traces twice.
            self._constants = tf.Variable([1.0, 0.0], trainable=False, name="dapple_one_zero")
        for s, r in self.transport.local_units():   # where Keras's BatchNormalization updates go
            self.functions[s].scratch.make(self.device(s, r))
        for s, r in self.transport.local_units():   # the units' gradient sums, likewise
            self._accumulate.make_sums((s, r), self.stages[s].trainable_variables,
                                       self.device(s, r))
        # The method each action kind runs: a subclass adds kinds (`relaxed_step`: UPDATE); a
        # test may wrap them to see what each action builds.
        self.dispatch = {FORWARD: self._forward, BACKWARD: self._backward,
                         BACKWARD_INPUT: self._backward, BACKWARD_WEIGHT: self._backward_weight,
                         SEND_FORWARD: self._send_forward, RECV_FORWARD: self._receive_forward,
                         SEND_BACKWARD: self._send_backward, RECV_BACKWARD: self._receive_backward}

    # ---- placement and rows ---------------------------------------------------------------
    def device(self, stage: int, replica: int) -> str:
        return self._devices[self.plan.stages[stage].devices[replica]]

    def lane(self, chunk: int, replica: int) -> Tuple[int, int]:
        """(position, replica): the device whose actions run in schedule order, whichever of
        its chunks they compute (an interleaved position holds several)."""
        return self.schedule.placement[chunk], replica

    def unit_variables(self, unit: Unit) -> List[tf.Variable]:   # its device's copies, if any
        return self.functions[unit[0]].copies.variables_on(self.device(*unit))

    def rows(self, stage: int, replica: int, micro_batch: int,
             global_batch: int) -> Tuple[int, int]:
        """[lo, hi) rows of the global batch that (stage, replica) holds of `micro_batch`."""
        return unit_rows(global_batch, self.plan.micro_batches, self.replicas[stage],
                         micro_batch, replica)

    def crossing(self, boundary: int, micro_batch: int, global_batch: int) -> Crossing:
        """What crosses from stage `boundary` to the next for `micro_batch`."""
        receiver = self.stages[boundary + 1]
        return Crossing(
            boundary, micro_batch, tuple(receiver.input_ids), receiver.specs,
            tuple(self.rows(boundary, r, micro_batch, global_batch)
                  for r in range(self.replicas[boundary])),
            tuple(self.rows(boundary + 1, r, micro_batch, global_batch)
                  for r in range(self.replicas[boundary + 1])))

    def trained_variables(self) -> List[tf.Variable]:
        """The model's trainable variables the units of this process give gradients for, in
        the model's order (what the optimizer will be asked to update)."""
        mine = {id(v) for s in {s for s, _ in self.transport.local_units()}
                for v in self.stages[s].trainable_variables}
        return [v for v in self.model.trainable_variables if id(v) in mine]

    # ---- the step ---------------------------------------------------------------------------
    # Plain Python that builds ops: not converted by AutoGraph (converting it cost seconds per
    # trace). The stage functions convert the model's own layers as Keras does.
    @tf.autograph.experimental.do_not_convert
    def run(self, x, y=None, training: bool = True, sample_weight=None,
            loss_scale: Optional[tf.Tensor] = None) -> StepResult:
        """Build the step's ops (call inside a tf.function). `y=None` builds forward only.

        `sample_weight`: one tensor of per-row weights for every output, or a list with one
        (or None) per output. `loss_scale`: multiplies every gradient the backward computes
        (mixed precision's loss scaling); the returned loss stays unscaled."""
        xs = tf.nest.flatten(x)
        if len(xs) != len(self.input_ids):
            raise ValueError(f"model {self.model.name!r} has {len(self.input_ids)} inputs, got "
                             f"{len(xs)}")
        global_batch = xs[0].shape[0]
        if global_batch is None:
            raise ValueError("the global batch size must be static; batch the data with "
                             "drop_remainder=True")
        global_batch = int(global_batch)
        check_even(global_batch, self.plan.micro_batches, self.replicas)
        ys = tf.nest.flatten(y) if y is not None else None
        state = StepState(inputs=dict(zip(self.input_ids, xs)), labels=ys,
                          sample_weights=per_output(sample_weight, len(self.output_ids)),
                          global_batch=global_batch, training=training,
                          backward=ys is not None and training, loss_scale=loss_scale)
        if state.backward:
            state.one, state.zero = self._read_constants()
        units = self.transport.local_units()
        by_stage: Dict[int, List[int]] = {}
        for s, r in units:
            by_stage.setdefault(s, []).append(r)
        state.previous = {self.lane(s, r): [] for s, r in units}
        depths = {self.lane(s, r): in_flight.order_depth(self, (s, r)) for s, r in units}
        moving_before = bstats.read_moving_statistics(self.stages, units) if training else {}
        if training:
            state.statistics = {u: bstats.StatisticsRecorder() for u in units}

        looped = loops_lanes(self, state)   # one loop per lane instead of its F and B actions
        for unit in units if looped else ():
            with tf.device(self.device(*unit)), tf.name_scope(task_scope(*unit, "loop", None)):
                run_lane(self, state, unit)
        periods = None if looped else loop_plan(self, state)
        if periods is not None:             # a pipeline's steady periods as one loop
            with tf.name_scope("schedule_loop"):
                run_schedule_loop(self, state, periods)
            self.schedule_loops += 1
            looped = True
        for _, action in self.order:
            stage = action.chunk
            # A schedule loop of a list with updates sums the replicas' gradients itself.
            if (looped and (action.kind != ALLREDUCE or self.schedule.has_updates)) or (
                    stage not in by_stage) or (
                    not state.backward and action.kind not in FORWARD_ONLY):
                continue
            if action.kind == ALLREDUCE:
                self._allreduce(state, stage, by_stage[stage], action)
                continue
            for replica in by_stage[stage]:
                lane = self.lane(stage, replica)
                history, depth = state.previous[lane], depths[lane]
                with tf.device(self.device(stage, replica)), \
                        tf.name_scope(task_scope(stage, replica, action.kind, action.micro_batch)), \
                        tf.control_dependencies(in_flight.waits(history, depth)):
                    done = self.dispatch[action.kind](state, (stage, replica), action)
                if done is not None:
                    history.append(done)
                    del history[:-(2 * depth - 1)]

        loss = sum_where_made(state.loss_terms) if state.loss_terms else tf.constant(0.0)
        if training:
            self._update_moving_statistics(state.statistics, moving_before)
        gradients = (model_gradients(self.model, self.stages, state.reduced)
                     if state.backward else [])
        S, M = len(self.stages), self.schedule.micro_batches     # over the run's batches
        preds = [[state.predictions[(m, r)][k] for m in range(M)
                  for r in range(self.replicas[S - 1]) if (m, r) in state.predictions]
                 for k in range(len(self.output_ids))]
        return StepResult(loss=loss, gradients=gradients, predictions=preds,
                          global_batch=global_batch, replica_gradients=state.replica_reduced)

    # ---- actions ----------------------------------------------------------------------------
    def _call_stage(self, state: StepState, unit: Unit, m: int, inputs: Tensors,
                    add_penalties: bool = True):
        """The stage function on the unit's rows of micro-batch m: (outputs, term, statistics),
        with the weight penalties added to the term by the step's first unit (unless
        `add_penalties` is False: the caller adds them)."""
        stage, replica = unit
        lo, hi = self.rows(stage, replica, m, state.global_batch)
        labels, weights = self._labels(state, unit, m)
        function = self.functions[stage]
        loss_rows, penalized = self.loss_share(state, unit, m)
        outputs, term, statistics = function(inputs, state.training, labels, weights, hi - lo,
                                             loss_rows, function.on(self.device(*unit)))
        if state.labels is not None and penalized and add_penalties:
            # Weight regularizers count once per step, like Keras: in the first unit of the
            # first stage that uses the weights (evaluated here, so the tape sees them).
            penalties = [tf.cast(c(), tf.float32) for c in self.weight_penalties[stage]]
            if penalties:
                term = tf.add_n(penalties + ([term] if term is not None else []))
        return outputs, term, statistics

    def _labels(self, state: StepState, unit: Unit, m: int):
        """(labels, sample weights) of the unit's rows of micro-batch m: the last stage's."""
        _, labels, weights = self.fed(state, unit)
        if labels is None:
            return None, None
        return [y[m] for y in labels], [None if w is None else w[m] for w in weights]

    def fed(self, state: StepState, unit: Unit):
        """(inputs by id, labels, sample weights) that `unit` reads of what the step is fed,
        each as the unit's rows of every micro-batch, [M, rows, ...], on the unit's device:
        the first stage reads the inputs, the last the labels and weights (None: not read).
        Cut where the feed is and moved once a step: cut per micro-batch, each of M small
        tensors would cross on its own (between tasks, a gRPC call each)."""
        if unit not in state.fed:
            stage = unit[0]
            M = self.schedule.micro_batches
            lo, hi = self.rows(*unit, 0, state.global_batch)

            def rows(t):
                return None if t is None else cut_rows.micro_batch_rows(t, M, lo, hi)
            inputs = labels = weights = None
            # Made for the whole step: no action's scope or control dependencies.
            with tf.device(self.device(*unit)), tf.control_dependencies(None), \
                    tf.name_scope("fed/"):
                if stage == 0:
                    inputs = {tid: rows(state.inputs[tid]) for tid in self.stages[0].input_ids}
                if stage == len(self.stages) - 1 and state.labels is not None:
                    labels = [rows(y) for y in state.labels]
                    weights = [rows(w) for w in state.sample_weights]
            state.fed[unit] = inputs, labels, weights
        return state.fed[unit]

    def stage_split(self, state: StepState, unit: Unit, rows: int, global_rows: int
                    ) -> StageSplit:
        """The unit's stage split (`stage_split.split_stage`) for slices of `rows` rows whose
        loss terms average over `global_rows`, made once per signature."""
        stage = unit[0]
        last = stage == len(self.stages) - 1
        specs = dict(self.stages[stage].specs)
        if stage == 0:
            specs.update({tid: tf.TensorSpec(t.shape, t.dtype) for tid, t in state.inputs.items()})
        labels = [tf.TensorSpec([rows] + y.shape[1:].as_list(), y.dtype)
                  for y in state.labels] if last else None
        weights = [None if w is None else tf.TensorSpec([rows] + w.shape[1:].as_list(), w.dtype)
                   for w in state.sample_weights] if last else None
        device = self.device(*unit)
        key = (unit, rows, global_rows, str(labels), str(weights),
               tuple((tid, str(s)) for tid, s in sorted(specs.items())))
        if key not in self.stage_splits:
            function = self.functions[stage]
            # Traced outside the step's graph, so it captures the variables themselves and
            # serves every retrace; not under `tf.init_scope`, which stops every tape: in a
            # thread of its own, whose graph and tape stacks are empty.
            with ThreadPoolExecutor(1) as thread:
                self.stage_splits[key] = thread.submit(
                    split_stage, function, stage, rows, global_rows, function.on(device),
                    specs, labels, weights, stage in self.schedule.split_chunks,
                    self.unit_variables(unit), self.stashes_weights).result()
        return self.stage_splits[key]

    # ---- what a schedule loop asks (`schedule_loop`); a relaxed step answers otherwise -------
    # A split's backward reads the weights again unless they are stashed: they do not change
    # within a synchronous step.
    stashes_weights = False

    def loop_fixed_actions(self) -> Optional[List[FrozenSet[int]]]:
        """Per position, the indices of list actions no loop may hold; None if no loop can run
        the schedule (updates in its lists are a relaxed step's to place)."""
        if self.schedule.has_updates:
            return None
        return [frozenset()] * len(self.schedule.lists)

    def before_forward(self, unit: Unit, micro_batch: int) -> None:
        """Called as a loop's forward of `unit` is built, before it reads the weights."""

    def loop_events(self) -> object:
        """A mark taken before a loop body is built (`after_loop` takes it)."""
        return None

    def after_loop(self, mark: object, iterations: int) -> None:
        """A loop whose body was built once ran `iterations` times."""

    def loss_share(self, state: StepState, unit: Unit, m: int) -> Tuple[int, bool]:
        """(rows a loss term averages over, adds the weight penalties) for `unit`'s m-th."""
        return state.global_batch, unit[1] == 0 and m == 0

    def _forward(self, state: StepState, unit: Unit, action: Action) -> List[tf.Tensor]:
        stage, replica = unit
        m = action.micro_batch
        if stage == 0:
            inputs = {tid: t[m] for tid, t in self.fed(state, unit)[0].items()}
        else:
            inputs = self._from_previous_chunk(state, unit, m)
        if state.backward and stage in self.schedule.split_chunks:
            stashed = self._split_forward(state, unit, m, inputs)
        elif state.backward and not self.plan.recompute:
            stashed = self._taped_forward(state, unit, m, inputs)
        else:
            outputs, term, statistics = self._call_stage(state, unit, m, inputs)
            self._record_statistics(state, unit, statistics)
            stashed = Stashed(inputs, outputs, None, term, [])
        outputs, term = stashed.outputs, stashed.term
        if stage == len(self.stages) - 1:
            state.predictions[(m, replica)] = [outputs[t] for t in self.output_ids]
        if term is not None:
            state.loss_terms.append(term)
        state.stash[(unit, m)] = stashed
        return list(outputs.values()) + ([term] if term is not None else [])

    def _taped_forward(self, state: StepState, unit: Unit, m: int, inputs: Tensors,
                       record: bool = True) -> Stashed:
        """The stage on `inputs` under a tape; records its BatchNormalization statistics
        unless it is a recomputation (`record` False)."""
        stage = unit[0]
        with tf.GradientTape() as tape:
            watch_inputs(tape, inputs, stage)
            outputs, term, statistics = self._call_stage(state, unit, m, inputs)
        if record:
            self._record_statistics(state, unit, statistics)
        return Stashed(inputs, outputs, tape, term, self._untargeted(stage, outputs, statistics))

    def _split(self, state: StepState, unit: Unit, m: int) -> StageSplit:
        lo, hi = self.rows(*unit, m, state.global_batch)
        split = self.stage_split(state, unit, hi - lo, self.loss_share(state, unit, m)[0])
        # Kept as calls, like the stage's own, unless the step inlines its stage calls.
        return split if self.functions[unit[0]].inlined else split.called()

    def _split_forward(self, state: StepState, unit: Unit, m: int, inputs: Tensors) -> Stashed:
        """The forward of a split stage: its residuals kept for I, or (recomputation) only its
        inputs, I running the split forward again. Weight penalties are differentiated apart
        (the split's forward has none) and their gradients added at once."""
        if self.plan.recompute:
            outputs, term, statistics = self._call_stage(state, unit, m, inputs,
                                                         add_penalties=False)
            residuals = None
        else:
            outputs, term, statistics, residuals = self._split(state, unit, m).forward(
                inputs, *self._labels(state, unit, m))
        penalty = (weight_penalty(self, state, unit, self.unit_variables(unit))
                   if self.loss_share(state, unit, m)[1] else None)
        if penalty is not None:
            penalty_term, grads = penalty
            term = penalty_term if term is None else term + penalty_term
            state.accumulated[unit] = self._accumulate(state.accumulated.get(unit), grads, unit)
        self._record_statistics(state, unit, statistics)
        return Stashed(inputs, outputs, None, term, [], residuals)

    def _record_statistics(self, state: StepState, unit: Unit, statistics) -> None:
        if state.training:
            for node_id, stats in self.functions[unit[0]].slice_statistics(statistics).items():
                state.statistics[unit].by_node.setdefault(node_id, []).append(stats)

    def _backward(self, state: StepState, unit: Unit, action: Action) -> List[tf.Tensor]:
        """B, or I of a split backward (which leaves W what it needs)."""
        stage, m = unit[0], action.micro_batch
        stashed = state.stash.pop((unit, m))
        upstream = None
        if stage < len(self.stages) - 1:
            upstream = self._from_next_chunk(state, unit, m)
        if action.kind == BACKWARD_INPUT:
            return self._backward_input(state, unit, m, stashed, upstream)
        if stashed.tape is None:   # recomputation: run the forward again under a tape
            stashed = self._taped_forward(state, unit, m, stashed.inputs, record=False)
        grads_in, var_grads = stage_gradients(
            self.stages[stage], stashed.tape, stashed.inputs, stashed.outputs, stashed.term,
            upstream, loss_scale=state.loss_scale, one=state.one, zero=state.zeros_like,
            untargeted=stashed.untargeted, variables=self.unit_variables(unit))
        state.input_gradients[(unit, m)] = grads_in
        state.accumulated[unit] = self._accumulate(state.accumulated.get(unit), var_grads,
                                                    unit)
        return [g for g in list(grads_in.values()) + var_grads if g is not None]

    def _backward_input(self, state: StepState, unit: Unit, m: int, stashed: Stashed,
                        upstream: Optional[Tensors]) -> List[tf.Tensor]:
        """I: the split's input gradients; what W reads is left in `awaiting_weight`."""
        split = self._split(state, unit, m)
        residuals = stashed.residuals
        if residuals is None:      # recomputation: the split forward again
            residuals = split.forward(stashed.inputs, *self._labels(state, unit, m))[3]
        if upstream is None:
            dys = [scaled_one(tf.zeros([]), state.one, state.loss_scale)]
        else:
            dys = [upstream[tid] for tid in split.differentiated_outputs]
        grads_in, pending = split.backward_input(residuals, dys)
        state.awaiting_weight[(unit, m)] = (split, pending)
        state.input_gradients[(unit, m)] = grads_in
        return list(grads_in.values()) + list(pending)

    def _backward_weight(self, state: StepState, unit: Unit, action: Action) -> List[tf.Tensor]:
        """W of a split backward: the weight gradients from what its I left."""
        split, pending = state.awaiting_weight.pop((unit, action.micro_batch))
        var_grads = split.backward_weight(pending)
        state.accumulated[unit] = self._accumulate(state.accumulated.get(unit), var_grads,
                                                    unit)
        return var_grads

    def _shares_device(self, chunk: int, other: int) -> bool:
        """Whether two chunks run on one device group (interleaved on a single group): the
        lowering then moves nothing between them, and the data is read where it lies."""
        return self.schedule.placement[chunk] == self.schedule.placement[other]

    def _from_previous_chunk(self, state: StepState, unit: Unit, m: int) -> Tensors:
        stage, replica = unit
        if not self._shares_device(stage - 1, stage):
            return state.received.pop((unit, RECV_FORWARD, m))
        outputs = state.stash[((stage - 1, replica), m)].outputs
        return {tid: outputs[tid] for tid in self.stages[stage].input_ids}

    def _from_next_chunk(self, state: StepState, unit: Unit, m: int) -> Tensors:
        stage, replica = unit
        if not self._shares_device(stage, stage + 1):
            return state.received.pop((unit, RECV_BACKWARD, m))
        return state.input_gradients.pop(((stage + 1, replica), m))

    def _untargeted(self, stage: int, outputs: Tensors, statistics) -> List[tf.Tensor]:
        """A forward's outputs its backward does not differentiate."""
        out = [t for pair in statistics.values() for t in pair]
        if stage == len(self.stages) - 1:
            out += list(outputs.values())
        return out

    def _send_forward(self, state: StepState, unit: Unit, action: Action) -> None:
        stage, replica = unit
        outputs = state.stash[(unit, action.micro_batch)].outputs
        state.sent.setdefault((FORWARD, stage, action.micro_batch), {})[replica] = outputs
        self.transport.send_activations(
            self.crossing(stage, action.micro_batch, state.global_batch), replica, outputs)

    def _receive_forward(self, state: StepState, unit: Unit, action: Action) -> None:
        stage, replica = unit
        m = action.micro_batch
        state.received[(unit, RECV_FORWARD, m)] = self.transport.receive_activations(
            self.crossing(stage - 1, m, state.global_batch), replica,
            state.sent.get((FORWARD, stage - 1, m), {}))

    def _send_backward(self, state: StepState, unit: Unit, action: Action) -> None:
        stage, replica = unit
        grads = state.input_gradients.pop((unit, action.micro_batch))
        state.sent.setdefault((BACKWARD, stage, action.micro_batch), {})[replica] = grads
        self.transport.send_gradients(
            self.crossing(stage - 1, action.micro_batch, state.global_batch), replica, grads)

    def _receive_backward(self, state: StepState, unit: Unit, action: Action) -> None:
        stage, replica = unit
        m = action.micro_batch
        outputs = state.stash[(unit, m)].outputs
        float_out = [tid for tid in self.stages[stage].output_ids if is_float(outputs[tid])]
        state.received[(unit, RECV_BACKWARD, m)] = self.transport.receive_gradients(
            self.crossing(stage, m, state.global_batch), replica,
            state.sent.get((BACKWARD, stage + 1, m), {}), float_out)

    def _allreduce(self, state: StepState, stage: int, replicas: List[int], action) -> None:
        """The stage's accumulated gradients summed over its replicas (`action`: ALLREDUCE)."""
        accumulated = {r: state.accumulated[(stage, r)] for r in replicas}
        if stage in self.sum_on_every_replica:
            sums = self.transport.sums_on_every_replica(
                stage, accumulated, {r: self.device(stage, r) for r in replicas})
            state.reduced[stage] = sums[replicas[0]]
            for r in replicas[1:]:
                state.replica_reduced[(stage, r)] = sums[r]
        else:
            state.reduced[stage] = self.transport.sum_replicas(stage, accumulated,
                                                               self.device(stage, 0))

    # ---- BatchNormalization state ------------------------------------------------------------
    def _update_moving_statistics(self, recorders, moving_before) -> None:
        """One Keras update per BatchNormalization call from the global batch's statistics."""
        bstats.update_moving_statistics(
            self.stages, self.replicas, recorders, moving_before,
            sum_replicas=lambda s, lists, tag: self.transport.sum_replicas(
                s, lists, self.device(s, 0), tag=tag), device=self.device,
            combine_calls=self._combine_statistics)

    def _read_constants(self) -> Tuple[tf.Tensor, tf.Tensor]:
        """1.0 and 0.0, read from a variable once per step: as constants, the graph optimizer
        would specialize (copy and re-optimize) the backward function per call."""
        both = self._constants.read_value()
        return both[0], both[1]


# ---- accumulation ----------------------------------------------------------------------------
def sum_where_made(terms: List[tf.Tensor]) -> tf.Tensor:
    """The sum of `terms`, added first on each device that made them: one partial sum per
    device crosses to where the total is made, not every micro-batch's term. The total is
    an op of its own, placed where the step's unplaced ops run (the caller's device), even
    for one partial sum: `tf.add_n` would return that sum itself, and the step's result would
    stay on a stage's device, for the caller to fetch from there."""
    by_device: Dict[str, List[tf.Tensor]] = {}
    for t in terms:
        by_device.setdefault(t.device, []).append(t)
    partial = []
    for device, on_device in by_device.items():
        with tf.device(device):
            partial.append(tf.add_n(on_device))
    return tf.raw_ops.AddN(inputs=partial)


def _add_lists(accumulated, gradients):
    return [a + g for a, g in zip(accumulated, gradients)]


def _assign_in_place(variables, values):
    for v, x in zip(variables, values):
        v.assign(x)
    return [v.read_value() for v in variables]


def _assign_sums(variables, accumulated, gradients):
    for v, a, g in zip(variables, accumulated, gradients):
        v.assign(a + g)
    return [v.read_value() for v in variables]


def _add_in_place(variables, values):
    for v, x in zip(variables, values):
        v.assign_add(x)
    return [v.read_value() for v in variables]


class InPlaceSums(list):
    """What `Accumulator` returns for a unit with sums of its own: the sums as read after the
    add, and which add of the unit's sums that was (`count`)."""

    def __init__(self, values, unit, count):
        super().__init__(values)
        self.unit, self.count = unit, count


class Accumulator:
    """A unit's variable gradients summed over its micro-batches, one call op per micro-batch:
    adding a stage's gradient tensors op by op made the adds most of the step's graph (and of
    its tracing and optimization time); one non-inlined function adds the whole list, traced
    once per list of shapes, on the device of the call site.

    A unit given sums of its own (`own_sums`: variables on its device) is added to in place.
    Inside a non-inlined function a sum held as a tensor cannot take its input's buffer (the
    caller still holds the input), so every add wrote a new buffer of the gradient's size: 2.3x
    the in-place add's time (9 Dense(1024) gradients, 8 micro-batches, one thread). The values
    read after each add are what the caller keeps; a read nothing uses is gone before the next
    add, which then writes in place.

    `inlined` (a step whose stage calls are inlined): the in-place adds are ops of the step
    itself, not calls. The benchmark MLP's 1f1b step on 2 processes then takes 0.93 of its time
    with the adds as calls on the TF cluster runtime (0.96 on Horovod's), the adds' kernels 0.72
    of their CPU time. Sums held as tensors stay calls: in the step's graph TensorFlow's
    optimizer may rewrite a chain of adds into one sum of every micro-batch's gradient, holding
    them all."""

    def __init__(self, inlined: bool = False):
        def call(f):
            return f if inlined else tf.function(f, experimental_attributes={"_noinline": True})
        self._add = tf.function(_add_lists, experimental_attributes={"_noinline": True})
        self._assign_in_place = call(_assign_in_place)
        self._assign_sums = call(_assign_sums)
        self._add_in_place = call(_add_in_place)
        self.own_sums: Dict[tuple, List[tf.Variable]] = {}     # by unit
        self._adds: Dict[tuple, int] = {}

    def make_sums(self, unit, variables, device: Optional[str]) -> None:
        """Give `unit` sums of its own for `variables` (its trainable variables), on `device`;
        call outside any trace (a variable made while tracing retraces the step)."""
        if unit not in self.own_sums:
            with tf.init_scope(), tf.device(device):
                self.own_sums[unit] = [
                    tf.Variable(tf.zeros(v.shape, tf.as_dtype(v.dtype)), trainable=False,
                                name=f"gradient_sum_s{unit[0]}r{unit[1]}") for v in variables]

    def __call__(self, accumulated: Optional[List[Optional[tf.Tensor]]],
                 gradients: List[Optional[tf.Tensor]], unit=None) -> List[Optional[tf.Tensor]]:
        """`accumulated` + `gradients` elementwise (None: no gradient yet / none here)."""
        sums = self.own_sums.get(unit)
        if sums is not None and len(sums) == len(gradients):
            return self._in_place(unit, sums, accumulated, gradients)
        if accumulated is None:
            return list(gradients)
        both = [i for i, (a, g) in enumerate(zip(accumulated, gradients))
                if a is not None and g is not None]
        out = [g if a is None else a for a, g in zip(accumulated, gradients)]
        if both:
            summed = self._add([accumulated[i] for i in both], [gradients[i] for i in both])
            for i, s in zip(both, summed):
                out[i] = s
        return out

    def holds(self, unit, accumulated) -> bool:
        """Whether `unit`'s own sums hold `accumulated` (the latest values it returned)."""
        return isinstance(accumulated, InPlaceSums) and accumulated.unit == unit and \
            accumulated.count == self._adds.get(unit, 0)

    def held(self, unit, values) -> InPlaceSums:
        """`values`, read from `unit`'s own sums after adds made there by others (a loop's)."""
        return InPlaceSums(values, unit, self._adds.get(unit, 0))

    def _in_place(self, unit, sums, accumulated, gradients):
        if accumulated is None:
            return list(gradients)      # nothing to add yet: one micro-batch copies nothing
        held = self.holds(unit, accumulated)
        count = self._adds.get(unit, 0) + 1
        self._adds[unit] = count
        out = [None] * len(gradients)
        assign, values, add, pairs = [], [], [], []
        for i, (a, g) in enumerate(zip(accumulated, gradients)):
            if g is None:
                out[i] = a
                if a is not None and not held:
                    assign.append(i)
                    values.append(a)
            elif a is None:
                assign.append(i)
                values.append(g)
            elif held:
                add.append(i)
            else:       # the first add, or a sum read elsewhere (a loop's): set to the sum
                pairs.append(i)
        for indices, function, arguments in (
                (assign, self._assign_in_place, [values]),
                (pairs, self._assign_sums, [[accumulated[i] for i in pairs],
                                            [gradients[i] for i in pairs]]),
                (add, self._add_in_place, [[gradients[i] for i in add]])):
            if indices:
                for i, r in zip(indices, function([sums[i] for i in indices], *arguments)):
                    out[i] = r
        return InPlaceSums(out, unit, count)


def model_gradients(model, stages, reduced: Dict[int, List[tf.Tensor]]):
    """Every stage's summed gradients (`reduced`, by stage), aligned with the model's trainable
    variables: a variable used by several stages gets the sum, one no stage here holds None."""
    by_var: Dict[int, tf.Tensor] = {}
    for stage, graph in enumerate(stages):
        if stage not in reduced:
            continue
        for v, g in zip(graph.trainable_variables, reduced[stage]):
            by_var[id(v)] = g if id(v) not in by_var else by_var[id(v)] + g
    return [by_var.get(id(v)) for v in model.trainable_variables]
