"""A data-parallel lane's micro-batches as one loop: start-up flat in M.

A plan with one stage gives each replica the list F0 B0 F1 B1 ... (early backward), or only
forwards (evaluation): every backward directly follows its own forward, and nothing crosses
lanes before the allreduce. Unrolled, the step holds a call of the stage's forward and one of
its backward per micro-batch, and for every call site TensorFlow's graph passes (Grappler's
function optimizer, the encapsulation pass) process the callee's whole body again: the first
call grows with M (docs/runtime.md, "Start-up", has the figures). Here a lane is
one call of a `LaneLoop`: a `tf.while_loop` whose body is micro-batch j's forward, backward and
gradient sum, so the step's graph is the same whatever M.

The lane is a function of its own, not inlined (`_noinline`): lowering a while loop inlines
what its body calls, so a loop in the step's graph put a copy of the stage into that graph per
lane, and a slower first call than the unrolled step's. The forward is built inline in the
body, under one tape, so no forward/backward function pair is made per call either. The loop's
own code is not converted by AutoGraph (it builds ops; converting it only lengthened every
trace); the body's function is, so the model's layers are converted as in Keras's own train
step.

What the loop carries: the gradient sums (from zero), the loss sum, and arrays of the
predictions and BatchNormalization statistics, which the step then reads as the unrolled
actions would have left them. Micro-batch j + 1 starts after j's backward (its slice waits on
the sums), as the list says: a lane holds one micro-batch's activations. A plan whose one stage
warms up K > 1 deep (`warmup: [K]`, the list F0 .. F(K-1) B0 FK B1 ...) lets K micro-batches
be in flight instead: the loop runs K iterations at once (`parallel_iterations`), so a forward
can run beside the previous backward where the device has threads to spare (a CPU's inter-op
threads; a GPU's one compute stream gains nothing), for K micro-batches' activations. A lane
alone in its process on a CPU (a Horovod rank's, a cluster task's) keeps two in flight even
where the plan says one (`graph_rewrite.in_flight`): the sums, added in order either way, are
the same. The weight
penalties, added to the first unit's term when unrolled, are differentiated once after replica
0's loop.

GPipe's one stage (all forwards, then all backwards) is K = M. Lists this loop cannot express
(split backwards, updates in the list) run unrolled; so does M = 1. Plans with several stages
loop their steady periods instead (`schedule_loop.py`: stages split into forward and backward,
since there a backward runs iterations after its forward).

`PipelinedModel` loops by default (`micro_batch_loop=False` unrolls; `PipelineStep` itself
unrolls unless told). Each lane's function is optimized per device, and the lowered loop is
larger than an unrolled lane's forward and backward, so it pays from a few micro-batches on
(docs/runtime.md, "Start-up", measures where).
"""
from __future__ import annotations

from typing import List

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite import in_flight
from graph_rewrite.local_transport import Unit
from graph_rewrite.stage_gradients import scaled_one, stage_gradients
from graph_rewrite.step_state import StepState
from planner.schedules.actions import ALLREDUCE, BACKWARD, FORWARD
from planner.schedules.by_name import first_backward_depths
from planner.schedules.forward_backward import stage_actions


def lane_depth(schedule) -> int:
    """The micro-batches a one-stage schedule's lanes keep in flight: K of the first list
    (its forwards before its first backward)."""
    return first_backward_depths(schedule)[0]


def lanes_in_flight(step, unit: Unit) -> int:
    """The micro-batches `unit`'s lane runs at once: the plan's K, raised (at most to M) to the
    actions an unrolled lane keeps in flight there (`graph_rewrite.in_flight.order_depth`)."""
    return max(lane_depth(step.schedule),
               min(in_flight.order_depth(step, unit), step.schedule.micro_batches))


def loops_lanes(step, state: StepState) -> bool:
    """Whether `step` runs every lane of this run as one loop over its micro-batches."""
    schedule = step.schedule
    M = schedule.micro_batches
    if not step.micro_batch_loop or len(step.stages) != 1 or M < 2:
        return False
    if any(a.kind not in (FORWARD, BACKWARD, ALLREDUCE) for lst in schedule.lists for a in lst):
        return False        # split backwards, or updates in the list
    R, n = step.replicas[0], state.global_batch // M
    if any(step.rows(0, r, m, state.global_batch) != (m * n + r * n // R, m * n + (r + 1) * n // R)
           for r in range(R) for m in range(M)) or n % R:
        return False        # rows not in the [micro-batch, replica, row] layout `run_lane` reads
    early_backward = tuple(stage_actions(0, M, lane_depth(schedule)))
    return not state.backward or all(
        tuple(a for a in lst if a.kind != ALLREDUCE) == early_backward for lst in schedule.lists)


def run_lane(step, state: StepState, unit: Unit) -> None:
    """Call `unit`'s loop (in its device and name scope) and leave in `state` what the unrolled
    actions would: accumulated gradients, loss terms, predictions, BatchNormalization
    statistics."""
    stage, replica = unit
    M = step.schedule.micro_batches
    inputs, labels, weights = step.fed(state, unit)
    depth = lanes_in_flight(step, unit) if state.backward else 1
    sums, loss, predictions, statistics = step.lane_loops[stage](
        inputs, labels, weights, state.loss_scale, state.training, state.backward,
        state.global_batch, step.functions[stage].on(step.device(*unit)), depth)

    if loss is not None:
        state.loss_terms.append(loss)
    variables = step.stages[stage].trainable_variables if state.backward else []
    penalty = weight_penalty(step, state, unit, variables)
    if penalty is not None:
        term, grads = penalty
        state.loss_terms.append(term)
        sums = [a + g for a, g in zip(sums, grads)]
    if state.backward:
        state.accumulated[unit] = sums
    for m in range(M):
        state.predictions[(m, replica)] = [p[m] for p in predictions]
    if state.training:
        function = step.functions[stage]
        for key, (mean, m2) in statistics.items():
            rows = function.statistics_rows[key] * M
            state.statistics[unit].by_node[id(function.nodes[key])] = [
                bstats.SliceStatistics(rows, mean, m2)]


class LaneLoop:
    """A lane's micro-batches: (gradient sums, loss sum or None, predictions [M, rows, ...] per
    output, {BatchNormalization call: (means [M, C], m2s [M, C])}), from its rows as
    [M, rows, ...]. One non-inlined function, traced once per signature, run on the call
    site's device."""

    def __init__(self, function):
        self.function = function            # the stage's `StageFunction`
        self.graph = function.graph
        self._micro_batch = tf.function(self._one)
        self._lane = tf.function(self._loop, autograph=False,
                                 experimental_attributes={"_noinline": True})

    @property
    def traces(self) -> int:
        """How many times the lane's function was traced (0: the lanes ran unrolled)."""
        return self._lane.experimental_get_tracing_count()

    def __call__(self, inputs, labels, weights, loss_scale, training: bool, backward: bool,
                 global_rows: int, scratch=(), depth: int = 1):
        """`depth`: micro-batches in flight (1: j + 1 starts after j's backward)."""
        return self._lane(inputs, labels, weights, loss_scale, training, backward, global_rows,
                          [list(s) for s in scratch], depth)

    def _one(self, inputs, labels, weights, sums, loss_scale, training, backward, global_rows,
             scratch):
        """Micro-batch j: its forward (with `backward`, and its gradients added to `sums`)."""
        rows = int(next(iter(inputs.values())).shape[0])
        with tf.GradientTape() as tape:
            outputs, term, statistics = self.function.inline(inputs, training, labels, weights,
                                                             rows, global_rows, scratch)
        if backward:
            copies = scratch[1] if scratch else []      # the device's working copies, if any
            _, grads = stage_gradients(self.graph, tape, inputs, outputs, term, None,
                                       loss_scale=loss_scale, variables=copies or None)
            sums = [a + g for a, g in zip(sums, grads)]
        return sums, outputs, term, statistics

    def _loop(self, inputs, labels, weights, loss_scale, training, backward, global_rows,
              scratch, depth):
        M = int(next(iter(inputs.values())).shape[0])
        output_ids = self.function.output_ids
        sums = [tf.zeros(v.shape, v.dtype) for v in self.graph.trainable_variables
                if backward]

        def arguments(j, sums):
            pick = lambda t: None if t is None else t[j]   # noqa: E731
            return (tf.nest.map_structure(pick, inputs), tf.nest.map_structure(pick, labels),
                    tf.nest.map_structure(pick, weights), sums, loss_scale, training, backward,
                    global_rows, scratch)

        # One trace gives the results' structure; the loop body's call reuses it.
        _, outputs, term, statistics = self._micro_batch.get_concrete_function(
            *arguments(0, sums)).structured_outputs
        keys = sorted(statistics)
        widths = [statistics[k][0].shape.num_elements() for k in keys]

        def arrays(tensors):
            return [tf.TensorArray(t.dtype, size=M, element_shape=t.shape) for t in tensors]

        def body(j, loss, sums, predictions, statistics_arrays):
            if depth == 1:
                with tf.control_dependencies(sums):        # after the previous backward
                    j = tf.identity(j)
            sums, outputs, term, statistics = self._micro_batch(*arguments(j, sums))
            loss = loss if term is None else loss + term
            return (j + 1, loss, sums,
                    [a.write(j, outputs[t]) for a, t in zip(predictions, output_ids)],
                    [a.write(j, bstats.joined([statistics[k][i] for k in keys]))
                     for i, a in enumerate(statistics_arrays)])

        # Statistics travel as two arrays, not two per call: every loop variable is a handful
        # of nodes per lane in the lowered graph, which the graph passes then process.
        statistics_specs = [tf.TensorSpec([sum(widths)], tf.float32)] * 2 if keys else []
        start = (tf.constant(0), tf.zeros([], tf.float32 if term is None else term.dtype), sums,
                 arrays([outputs[t] for t in output_ids]), arrays(statistics_specs))
        _, loss, sums, predictions, statistics_arrays = tf.while_loop(
            lambda j, *_: j < M, body, start, maximum_iterations=M,
            parallel_iterations=depth if depth > 1 else 10)   # 1: the dependency above orders
        combined = {}
        if keys:    # over the lane's micro-batches, all calls at once
            rows = self.function.statistics_rows
            counts = tf.concat([tf.fill([w], float(rows[k])) for k, w in zip(keys, widths)], 0)
            mean, m2 = bstats.combine_stacked(counts, *[a.stack() for a in statistics_arrays])
            for k, mean, m2 in zip(keys, tf.split(mean, widths), tf.split(m2, widths)):
                shape = statistics[k][0].shape
                combined[k] = (tf.reshape(mean, shape), tf.reshape(m2, shape))
        return sums, None if term is None else loss, [p.stack() for p in predictions], combined


def weight_penalty(step, state: StepState, unit: Unit, variables: List[tf.Variable]):
    """(penalty term, its gradients) for the unit that counts the stage's weight penalties
    (replica 0), or None."""
    stage, _ = unit
    penalties = step.weight_penalties[stage]
    if state.labels is None or not penalties or not step.loss_share(state, unit, 0)[1]:
        return None
    with tf.GradientTape() as tape:
        term = tf.add_n([tf.cast(c(), tf.float32) for c in penalties])
    if not state.backward:
        return term, []
    grads = tape.gradient(term, variables, output_gradients=scaled_one(term, state.one,
                                                                       state.loss_scale))
    # Zeros for the variables without a regularizer, made here: the tape's own zeros read
    # `variable.dtype`, which a Keras 3 variable gives as a string.
    return term, [tf.zeros(v.shape, tf.as_dtype(v.dtype)) if g is None else
                  tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
