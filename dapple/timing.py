"""Holding the cost model to measurements: a plan's stage units and step, timed on this machine.

    measured = measure_plan(pm, x, y)        # pm: a compiled dapple.PipelinedModel
    report = timing_report(pm.plan, profile, topology, measured)
    print(format_report(report))

Three step times of one plan, side by side (`dapple verify --timing` prints them):

* predicted: the planner's formula, `planner.estimate.cost_model.evaluate(plan, profile, topology)`;
* simulated: the discrete-event replay of the plan's schedule with the cost model's task
  durations, `planner.estimate.simulator.simulate_plan(plan, pipeline_costs(...))`;
* measured: the median of `PipelinedModel.train_step` calls after warm-up (the optimizer's
  apply included, which the cost model does not charge; `gradients_ms`, the pipelined
  forward/backward alone, is measured too so the two can be told apart).

A fourth, "simulated from measured units", replays the same schedule with the per-stage times
measured here instead of the profile's: it separates an error of the per-task durations (the
profile, its batch scaling, TASK_OVERHEAD_MS) from an error of the pipeline model (overlap of
stages, transfers, contention for cores).

Per-stage times (decisions): each stage's unit (its layers, `graph_rewrite.model_graph.
StageGraph.call`, the code the pipeline runs) is timed alone, replica 0's slice of micro-batch
0, pinned to its device, inputs computed by running the earlier stages on that micro-batch.
Forward is a `tf.function` of the stage's forward; backward is (forward + gradients, as
`graph_rewrite.pipeline` asks its tape: the last stage differentiates its loss term, others
their outputs weighted by upstream gradients) minus forward, floored at 1 microsecond. Each is
warmed up, then the median of `runs` calls is kept (the machine is shared: medians, not means).
Transfers between logical CPU devices of one process are not timed (they are memory reads).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import tensorflow as tf

from graph_rewrite.stage_gradients import stage_gradients
from dapple.measure import MIN_BACKWARD_MS, median_ms, median_wall_and_cpu_ms

@dataclass
class StageTiming:
    stage: int
    device: str
    rows: int                # samples of the timed slice (one micro-batch on one replica)
    forward_ms: float
    backward_ms: float


@dataclass
class MeasuredPlan:
    stages: List[StageTiming]
    step_ms: float           # median train_step (forward, backward, apply)
    gradients_ms: float      # median pipelined forward/backward without the apply
    warmup: int
    runs: int
    step_cpu_ms: float = 0.0  # median process CPU time of a train_step (all threads)

    @property
    def cores_used(self) -> float:
        """Cores the process kept busy during a step, on average (CPU time / wall time)."""
        return self.step_cpu_ms / self.step_ms if self.step_ms > 0 else 0.0


def _slice(tensors: Dict[str, tf.Tensor], lo: int, hi: int) -> Dict[str, tf.Tensor]:
    return {tid: t[lo:hi] for tid, t in tensors.items()}


def measure_stages(pm, x, y, warmup: int = 3, runs: int = 10) -> List[StageTiming]:
    """Forward and backward ms of every stage's unit (replica 0, micro-batch 0), each alone."""
    step = pm.pipeline_step
    if step.loss is None:
        raise RuntimeError("call compile(optimizer, loss) before training or evaluating")
    xs = tf.nest.flatten(x)
    ys = [tf.convert_to_tensor(t) for t in tf.nest.flatten(y)]
    batch = int(xs[0].shape[0])
    pm.check_batch_size(batch)
    mb_lo, mb_hi = step.rows(0, 0, 0, batch)
    # Micro-batch 0 through every stage, eagerly: the inputs each stage's unit sees.
    values = {tid: tf.convert_to_tensor(t) for tid, t in zip(step.input_ids, xs)}
    micro = _slice(values, *_whole_micro_batch(step, batch))
    stage_inputs = []
    for graph in step.stages:
        inputs = {tid: micro[tid] for tid in graph.input_ids}
        stage_inputs.append(inputs)
        micro.update(graph.call(inputs, training=True))

    out = []
    S = len(step.stages)
    for s, graph in enumerate(step.stages):
        lo, hi = step.rows(s, 0, 0, batch)
        first_lo = _whole_micro_batch(step, batch)[0]
        device = step.device(s, 0)
        with tf.device(device):
            inputs = {tid: tf.identity(t[lo - first_lo:hi - first_lo])
                      for tid, t in stage_inputs[s].items()}
            labels = [t[lo:hi] for t in ys]
        out.append(_time_stage(step, s, graph, device, inputs, labels, hi - lo,
                               last=(s == S - 1), warmup=warmup, runs=runs, batch=batch))
    return out


def _whole_micro_batch(step, batch: int):
    """Rows of micro-batch 0 over all replicas of stage 0 (stages differ only in slicing)."""
    lo = min(step.rows(0, r, 0, batch)[0] for r in range(step.replicas[0]))
    hi = max(step.rows(0, r, 0, batch)[1] for r in range(step.replicas[0]))
    return lo, hi


def _time_stage(step, s, graph, device, inputs, labels, rows, last, warmup, runs,
                batch) -> StageTiming:
    float_in = [tid for tid in graph.input_ids if inputs[tid].dtype.is_floating]
    with tf.device(device):
        upstream = {tid: tf.random.normal(tf.shape(t)) for tid, t in
                    graph.call(inputs, training=True).items() if t.dtype.is_floating}

    @tf.function
    def forward():
        with tf.device(device):
            return graph.call(inputs, training=True)

    @tf.function
    def forward_backward():
        with tf.device(device):
            with tf.GradientTape() as tape:
                for tid in float_in:
                    tape.watch(inputs[tid])
                outs = graph.call(inputs, training=True)
                term = step.loss.micro_batch_term(
                    labels, [outs[t] for t in step.output_ids], rows=rows,
                    global_rows=batch) if last else None
            return stage_gradients(graph, tape, inputs, outs, term,
                                   None if last else upstream)

    forward_ms = median_ms(forward, warmup, runs)
    total_ms = median_ms(forward_backward, warmup, runs)
    return StageTiming(stage=s, device=device, rows=rows, forward_ms=forward_ms,
                       backward_ms=max(total_ms - forward_ms, MIN_BACKWARD_MS))


def measure_step_ms(pm, x, y, warmup: int = 3, runs: int = 10):
    """(wall, CPU) median ms of `pm.train_step(x, y)` (a full optimizer step) after warm-up."""
    return median_wall_and_cpu_ms(lambda: pm.train_step(x, y), warmup, runs)


def measure_gradients_ms(pm, x, y, warmup: int = 3, runs: int = 10) -> float:
    """Median ms of the pipelined forward/backward of one global batch, without the apply."""
    return median_ms(lambda: pm.gradients(x, y), warmup, runs)


def measure_plan(pm, x, y, warmup: int = 3, runs: int = 10) -> MeasuredPlan:
    """Per-stage unit times, then the step and the gradients-only step, all medians."""
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    stages = measure_stages(pm, x, y, warmup, runs)
    step_ms, step_cpu_ms = measure_step_ms(pm, x, y, warmup, runs)
    return MeasuredPlan(stages=stages, step_ms=step_ms,
                        gradients_ms=measure_gradients_ms(pm, x, y, warmup, runs),
                        warmup=warmup, runs=runs, step_cpu_ms=step_cpu_ms)


# ---- the comparison (planner side; no TensorFlow below) -----------------------------------------

@dataclass
class TimingReport:
    predicted_ms: float                  # cost_model.evaluate
    simulated_ms: float                  # simulate_plan with pipeline_costs
    simulated_measured_ms: float         # simulate_plan with the measured unit times
    measured_ms: float                   # median train_step
    gradients_ms: float                  # median pipelined forward/backward
    predicted_stages: List[tuple]        # (forward_ms, backward_ms) per stage, from the profile
    measured_stages: List[StageTiming] = field(default_factory=list)
    cores_used: float = 0.0              # process CPU / wall during the measured step
    expected_cores: float = 0.0          # busy unit time / simulated_measured_ms

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured_ms / self.predicted_ms


def timing_report(plan, profile, topology, measured: MeasuredPlan) -> TimingReport:
    from planner.estimate.cost_model import evaluate, pipeline_costs
    from planner.estimate.pipeline_costs import PipelineCosts
    from planner.estimate.simulator import simulate_plan

    costs = pipeline_costs(plan, profile, topology)
    estimate = evaluate(plan, profile, topology)
    simulated = simulate_plan(plan, costs).iteration_ms
    measured_costs = PipelineCosts(
        forward_ms=[st.forward_ms for st in measured.stages],
        backward_ms=[st.backward_ms for st in measured.stages],
        send_forward_ms=list(costs.send_forward_ms), send_backward_ms=list(costs.send_backward_ms),
        allreduce_ms=list(costs.allreduce_ms), activation_bytes=list(costs.activation_bytes))
    simulated_measured = simulate_plan(plan, measured_costs).iteration_ms
    busy = plan.micro_batches * sum(st.replicas * (m.forward_ms + m.backward_ms)
                                    for st, m in zip(plan.stages, measured.stages))
    return TimingReport(
        predicted_ms=estimate.latency_ms, simulated_ms=simulated,
        simulated_measured_ms=simulated_measured,
        measured_ms=measured.step_ms, gradients_ms=measured.gradients_ms,
        predicted_stages=list(zip(costs.forward_ms, costs.backward_ms)),
        measured_stages=list(measured.stages), cores_used=measured.cores_used,
        expected_cores=busy / simulated_measured if simulated_measured > 0 else 0.0)


def format_report(report: TimingReport) -> str:
    lines = [f"{'stage':<7}{'rows':>6}{'F pred':>10}{'F meas':>10}{'B pred':>10}{'B meas':>10}"
             f"  device"]
    for (pf, pb), m in zip(report.predicted_stages, report.measured_stages):
        lines.append(f"{m.stage:<7}{m.rows:>6}{pf:>10.2f}{m.forward_ms:>10.2f}{pb:>10.2f}"
                     f"{m.backward_ms:>10.2f}  {m.device}")
    lines.append("(per micro-batch slice, ms; pred = profile scaled by the cost model, "
                 "meas = the stage's unit timed alone)")
    lines += [
        f"step time, ms:  predicted {report.predicted_ms:.2f}  simulated {report.simulated_ms:.2f}"
        f"  measured {report.measured_ms:.2f}",
        f"measured / predicted: {report.ratio:.2f}   (simulated from measured units "
        f"{report.simulated_measured_ms:.2f}; measured without the optimizer's apply "
        f"{report.gradients_ms:.2f})",
        f"cores: the schedule keeps {report.expected_cores:.2f} busy on average (measured units "
        f"replayed); the process had {report.cores_used:.2f} (CPU / wall time of the step)"
        + (" -- fewer: the stages did not compute side by side (other processes on the "
           "machine taking cores, or devices not running concurrently)"
           if report.cores_used < 0.8 * report.expected_cores else ""),
    ]
    return "\n".join(lines)
