"""The pipelined training step: a Keras model + a Plan -> gradients of one global batch.

Built inside a `tf.function`, one graph per step (the paper's §V design on TF2):

* Units. Every (stage s, replica r, micro-batch m) is a unit. Its forward runs the stage's
  layer calls (`model_graph.StageGraph.call`) on its rows under its own `tf.GradientTape`, on
  the replica's device; its backward asks that tape for the gradients of the stage's outputs
  (weighted by the gradients that came back from stage s+1) with respect to its inputs and the
  stage's variables. With `recompute`, the forward keeps only its inputs and the backward runs
  the forward again under a fresh tape.
* Boundaries. A `Transport` moves boundary tensors forward and their gradients backward. The
  local transport (`graph_rewrite.local_transport`: one process, many devices) slices and
  concatenates row ranges on the receiving device: split, concat, both, or nothing when replica counts
  are equal. `graph_rewrite.horovod_transport` moves them between processes.
* Update. Each unit's variable gradients are accumulated over micro-batches per replica, summed
  across the stage's replicas (the allreduce; locally an add on the stage's first device), and
  handed back aligned with `model.trainable_variables` for one `apply_gradients`.
* Order. The schedule (`planner.schedule`, the same task lists the simulator replays) is lowered
  to control dependencies: every op of a unit's task depends on the previous task of the same
  (stage, replica). Units are *built* in `planner.schedule.replay` order, which respects data
  dependencies. Each task is built under the name scope `stage{s}/replica{r}/{F|B}{m}` so the
  traced graph can be read back and checked (`tests/test_schedule_lowering.py`); TF names the
  gradient ops a tape builds `gradient_tape/<forward op name>`, so those belong to B{m}.

* Training state. BatchNormalization calls normalize with their slice's statistics; their
  moving statistics move once per step, from the whole global batch
  (`graph_rewrite.batch_statistics`).

Gradients equal the plain model's because each slice's loss term is its share of the global
batch loss (`losses.PipelineLoss`) and everything else is exact re-association of sums. Weight
regularization penalties (`kernel_regularizer` and the like) are added once per step, by the
first unit (replica 0, micro-batch 0) of the stage that owns the weights. Losses that depend on
activations (activity regularizers, `add_loss`) are refused by `dapple.PipelinedModel`.
Batch-dependent layers (BatchNormalization in training mode) normalize with micro-batch
statistics, as in GPipe and the DAPPLE paper: such models' gradients equal the plain model's
run slice by slice ("ghost batches"), not on the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite.local_transport import LocalTransport, Tensors, Unit
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.model_graph import StageGraph, cut_model, model_input_ids, model_output_ids
from planner.plan import Plan
from planner.slicing import check_even, unit_rows
from planner.actions import FORWARD
from planner.replay import replay
from planner.schedule import plan_schedule



def _is_float(t) -> bool:
    return t.dtype.is_floating


def _per_output(sample_weight, outputs: int) -> List[Optional[tf.Tensor]]:
    if sample_weight is None:
        return [None] * outputs
    if isinstance(sample_weight, (list, tuple)):
        if len(sample_weight) != outputs:
            raise ValueError(f"{len(sample_weight)} sample weight arrays for {outputs} outputs")
        return list(sample_weight)
    return [sample_weight] * outputs


def task_scope(stage: int, replica: int, kind: str, micro_batch: int) -> str:
    return f"stage{stage}/replica{replica}/{kind}{micro_batch}"


@dataclass
class StepResult:
    loss: tf.Tensor
    gradients: List[Optional[tf.Tensor]]          # aligned with model.trainable_variables
    predictions: List[List[tf.Tensor]] = field(default_factory=list)  # per output, row order


class PipelineStep:
    """Builds the pipelined forward/backward of one global batch for `model` and `plan`."""

    def __init__(self, model: tf.keras.Model, plan: Plan, loss: PipelineLoss,
                 devices: Sequence[str], transport_factory=LocalTransport):
        self.model = model
        self.plan = plan
        self.loss = loss
        self.stages: List[StageGraph] = cut_model(model, [tuple(s.layers) for s in plan.stages])
        self.replicas = [s.replicas for s in plan.stages]
        self._devices = list(devices)
        self.schedule = plan_schedule(plan)
        self.build_order = [(p, a) for p, a in replay(self.schedule).order if a.is_compute]
        self.input_ids = model_input_ids(model)
        self.output_ids = model_output_ids(model)
        self._penalties = self._weight_penalties_by_stage()
        self.transport = transport_factory(self)
        self.global_batch: Optional[int] = None
        self._loss_scale: Optional[tf.Tensor] = None

    # ---- placement and rows ---------------------------------------------------------------
    def device(self, stage: int, replica: int) -> str:
        return self._devices[self.plan.stages[stage].devices[replica]]

    def rows(self, stage: int, replica: int, micro_batch: int) -> Tuple[int, int]:
        return unit_rows(self.global_batch, self.plan.micro_batches, self.replicas[stage],
                         micro_batch, replica)

    # ---- the step ---------------------------------------------------------------------------
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
        self.global_batch = int(global_batch)
        check_even(self.global_batch, self.plan.micro_batches, self.replicas)
        model_inputs = dict(zip(self.input_ids, xs))
        ys = tf.nest.flatten(y) if y is not None else None
        self._sample_weights = _per_output(sample_weight, len(self.output_ids))
        self._loss_scale = loss_scale
        backward = ys is not None and training
        self._training = training
        S, M = len(self.stages), self.plan.micro_batches

        units = self.transport.local_units()
        moving_before = self._read_moving_statistics(units) if training else {}
        recorders = {u: bstats.StatisticsRecorder() for u in units} if training else {}
        previous: Dict[Unit, list] = {u: [] for u in units}     # last task's ops, per unit
        stash: Dict[Tuple[int, int, int], tuple] = {}
        sent_fwd: Dict[Tuple[int, int], Dict[int, Tensors]] = {}
        sent_bwd: Dict[Tuple[int, int], Dict[int, Tensors]] = {}
        accumulated: Dict[Unit, List[Optional[tf.Tensor]]] = {}
        loss_terms: List[tf.Tensor] = []
        predictions: Dict[Tuple[int, int], List[tf.Tensor]] = {}

        order = self.build_order if backward else [
            (s, t) for (s, t) in self.build_order if t.kind == FORWARD]
        for stage, task in order:
            m = task.micro_batch
            for replica in range(self.replicas[stage]):
                if (stage, replica) not in previous:
                    continue
                unit = (stage, replica)
                scope = task_scope(stage, replica, task.kind, m)
                with tf.device(self.device(stage, replica)), tf.name_scope(scope), \
                        tf.control_dependencies(previous[unit]):
                    if task.kind == FORWARD:
                        if stage == 0:
                            lo, hi = self.rows(0, replica, m)
                            inputs = {tid: model_inputs[tid][lo:hi]
                                      for tid in self.stages[0].input_ids}
                        else:
                            inputs = self.transport.receive_activations(
                                stage, replica, m, sent_fwd.get((stage - 1, m), {}))
                        outputs, tape, term = self._forward(stage, replica, m, inputs, ys,
                                                            keep_tape=backward,
                                                            observe=recorders.get(unit))
                        sent_fwd.setdefault((stage, m), {})[replica] = outputs
                        if stage < S - 1:
                            self.transport.send_activations(stage, replica, m, outputs)
                        stash[(stage, replica, m)] = (inputs, outputs, tape, term)
                        if stage == S - 1:
                            predictions[(m, replica)] = [outputs[t] for t in self.output_ids]
                        if term is not None:
                            loss_terms.append(term)
                        previous[unit] = list(outputs.values()) + ([term] if term is not None
                                                                   else [])
                    else:
                        grads_in, var_grads = self._backward(stage, replica, m, stash.pop(
                            (stage, replica, m)), sent_bwd.get((stage + 1, m), {}), ys)
                        sent_bwd.setdefault((stage, m), {})[replica] = grads_in
                        if stage > 0:
                            self.transport.send_gradients(stage, replica, m, grads_in)
                        acc = accumulated.get(unit)
                        accumulated[unit] = var_grads if acc is None else [
                            g if a is None else (a if g is None else a + g)
                            for a, g in zip(acc, var_grads)]
                        previous[unit] = [g for g in list(grads_in.values()) + var_grads
                                          if g is not None]

        loss = tf.add_n(loss_terms) if loss_terms else tf.constant(0.0)
        if training:
            self._update_moving_statistics(recorders, moving_before)
        gradients = self._gather_gradients(accumulated) if backward else []
        preds = [[predictions[(m, r)][k] for m in range(M)
                  for r in range(self.replicas[S - 1]) if (m, r) in predictions]
                 for k in range(len(self.output_ids))]
        return StepResult(loss=loss, gradients=gradients, predictions=preds)

    # ---- units ------------------------------------------------------------------------------
    def _labels(self, ys, stage, replica, m):
        lo, hi = self.rows(stage, replica, m)
        return [y[lo:hi] for y in ys]

    def _forward(self, stage, replica, m, inputs: Tensors, ys, keep_tape: bool, observe=None):
        graph = self.stages[stage]
        last = stage == len(self.stages) - 1

        def compute():
            outs = graph.call(inputs, training=self._training, observe=observe)
            # A relayed tensor must be a new tensor so the tape sees output != input.
            outs = {tid: (tf.identity(t) if tid in inputs else t) for tid, t in outs.items()}
            term = None
            if last and ys is not None:
                lo, hi = self.rows(stage, replica, m)
                weights = [None if w is None else w[lo:hi] for w in self._sample_weights]
                term = self.loss.micro_batch_term(
                    self._labels(ys, stage, replica, m), [outs[t] for t in self.output_ids],
                    rows=hi - lo, global_rows=self.global_batch, sample_weights=weights)
            if ys is not None and replica == 0 and m == 0:
                # Weight regularizers count once per step, like Keras: in the first unit of
                # the first stage that uses the weights (evaluated here, so the tape sees them).
                penalties = [tf.cast(c(), tf.float32) for c in self._penalties[stage]]
                penalties = [p for p in penalties if p is not None]
                if penalties:
                    term = tf.add_n(penalties + ([term] if term is not None else []))
            return outs, term

        if not keep_tape or self.plan.recompute:
            outputs, term = compute()
            return outputs, None, term
        tape = tf.GradientTape()
        with tape:
            for t in inputs.values():
                if _is_float(t):
                    tape.watch(t)
            outputs, term = compute()
        return outputs, tape, term

    def _backward(self, stage, replica, m, stashed, sent: Dict[int, Tensors], ys):
        inputs, outputs, tape, term = stashed
        graph = self.stages[stage]
        last = stage == len(self.stages) - 1
        if tape is None:   # recomputation: run the forward again under a tape
            tape = tf.GradientTape()
            with tape:
                for t in inputs.values():
                    if _is_float(t):
                        tape.watch(t)
                outputs, term = self._forward(stage, replica, m, inputs, ys, keep_tape=False)[::2]
        upstream = None
        if not last:
            float_out = [tid for tid in graph.output_ids if _is_float(outputs[tid])]
            upstream = self.transport.receive_gradients(stage, replica, m, sent, float_out)
        return self.differentiate(graph, tape, inputs, outputs, term, upstream)

    def differentiate(self, graph: StageGraph, tape, inputs: Tensors, outputs: Tensors, term,
                      upstream: Optional[Tensors]):
        """A unit's backward from its forward's tape: (gradients of its float inputs by id,
        gradients of the stage's trainable variables). The last stage differentiates its loss
        term (`upstream` None); the others their float outputs weighted by `upstream`, plus
        their weight-regularization term when they have one."""
        if upstream is None:
            targets, output_gradients = [term], [self._scaled_one(term)]
        else:
            float_out = [tid for tid in graph.output_ids if _is_float(outputs[tid])]
            targets = [outputs[tid] for tid in float_out]
            output_gradients = [upstream[tid] for tid in float_out]
            if term is not None:            # this stage's weight-regularization penalty
                targets.append(term)
                output_gradients.append(self._scaled_one(term))
        float_in = [tid for tid in graph.input_ids if _is_float(inputs[tid])]
        variables = graph.trainable_variables
        sources = [inputs[tid] for tid in float_in] + variables
        grads = tape.gradient(targets, sources, output_gradients=output_gradients,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # Embedding gradients come as tf.IndexedSlices, which do not add up across
        # micro-batches and replicas; dense tensors do (at the cost of a dense table gradient).
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        grads_in = dict(zip(float_in, grads[:len(float_in)]))
        return grads_in, list(grads[len(float_in):])

    def _weight_penalties_by_stage(self) -> List[list]:
        """Each weight regularizer (Keras's callable losses) in the first stage that calls a
        layer holding it, so a layer shared by two stages is penalized once, as in Keras."""
        seen, out = set(), []
        for graph in self.stages:
            mine = []
            for layer in graph.called_layers:
                for sub in layer._flatten_layers():
                    for c in sub._callable_losses:
                        if id(c) not in seen:
                            seen.add(id(c))
                            mine.append(c)
            out.append(mine)
        return out

    # ---- BatchNormalization state ------------------------------------------------------------
    def _normalization_layers(self, units) -> List:
        stages = sorted({s for s, _ in units})
        seen, out = set(), []
        for s in stages:
            for node in self.stages[s].nodes:
                if bstats.is_batch_normalization(node.layer) and id(node.layer) not in seen:
                    seen.add(id(node.layer))
                    out.append(node.layer)
        return out

    def _read_moving_statistics(self, units) -> Dict[int, Tuple[tf.Tensor, tf.Tensor]]:
        """The moving statistics before any unit runs (each unit's own Keras update follows in
        program order, and is overwritten by the step's one update)."""
        return {id(layer): (tf.identity(layer.moving_mean), tf.identity(layer.moving_variance))
                for layer in self._normalization_layers(units)}

    def _update_moving_statistics(self, recorders, moving_before) -> None:
        """One Keras update per BatchNormalization call from the global batch's statistics."""
        current = dict(moving_before)
        for stage, graph in enumerate(self.stages):
            mine = {r: recorders[(stage, r)] for r in range(self.replicas[stage])
                    if (stage, r) in recorders}
            if not mine:
                continue
            calls = [n for n in graph.nodes
                     if any(id(n) in rec.by_node for rec in mine.values())]
            if not calls:
                continue
            by_replica = {r: [bstats.combine(rec.by_node[id(n)]) for n in calls]
                          for r, rec in mine.items()}
            combined = bstats.combine_replicas(
                by_replica, self.replicas[stage],
                lambda lists, tag: self.transport.sum_replicas(stage, lists, tag=tag))
            with tf.device(self.device(stage, min(mine))), tf.name_scope(f"stage{stage}/bn"):
                for node, stats in zip(calls, combined):
                    layer = node.layer
                    mean, variance = bstats.moving_update(layer, stats, *current[id(layer)])
                    current[id(layer)] = (mean, variance)

    def _scaled_one(self, term: tf.Tensor) -> tf.Tensor:
        """d(loss)/d(term): 1, times the loss scale under mixed precision."""
        one = tf.ones_like(term)
        return one if self._loss_scale is None else one * tf.cast(self._loss_scale, term.dtype)

    def _gather_gradients(self, accumulated: Dict[Unit, List[tf.Tensor]]):
        by_var: Dict[int, tf.Tensor] = {}
        for stage, graph in enumerate(self.stages):
            per_replica = {r: accumulated[(stage, r)] for r in range(self.replicas[stage])
                           if (stage, r) in accumulated}
            if not per_replica:
                continue
            summed = self.transport.sum_replicas(stage, per_replica)
            for v, g in zip(graph.trainable_variables, summed):
                by_var[id(v)] = g if id(v) not in by_var else by_var[id(v)] + g
        return [by_var.get(id(v)) for v in self.model.trainable_variables]
