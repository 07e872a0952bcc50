"""One rank of a pipelined job for the multi-process tests.

Every rank builds the same tiny model from the same seed and a plain reference copy of it, runs
`dapple.PipelinedModel(model, plan)` (which detects horovodrun), and checks itself against the
plain single-process Keras model computed right here: its stage's gradients for 3 different
global batches (different data in every micro-batch), the loss, and all weights after 3 Adam
steps (gathered from every stage). It prints one `DAPPLE_RESULT <json>` line; the test asserts.

`--fail_step S --fail_rank R` makes rank R raise at the start of step S, and `--stall_step S
--stall_rank R` makes it hang there (the failure tests).
"""
import argparse
import json
import time

import dapple
import numpy as np
import tensorflow as tf

from dapple.runtime.tf_cluster.runtime import TFClusterRuntime
from graph_rewrite.model_graph import layer_order
from planner.search.chunking import interleaved_plan
from planner.formats.plan import straight_plan
from tests import models

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlp_with_skip")
parser.add_argument("--cuts", default="2", help="first layers of stages 1.., comma separated")
parser.add_argument("--replicas", default="1,1")
parser.add_argument("--micro_batches", type=int, default=4)
parser.add_argument("--schedule", default="A")
parser.add_argument("--global_batch", type=int, default=24)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--fail_step", type=int, default=-1)
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--stage_devices", default="",
                    help="devices per stage, e.g. 2,0/1 (default: consecutive)")
parser.add_argument("--stall_step", type=int, default=-1)
parser.add_argument("--stall_rank", type=int, default=-1)
parser.add_argument("--checkpoint", default="")
parser.add_argument("--virtual_stages", type=int, default=0,
                    help="chunks per device group: an interleaved plan (--replicas per group)")
parser.add_argument("--pipeline_loop", action="store_true", default=None,
                    help="PipelinedModel(..., pipeline_loop=True): steady periods as loops "
                         "(reports how many traces built them); without it, the default")
parser.add_argument("--inline_stage_calls", action="store_true", default=None,
                    help="PipelinedModel(..., inline_stage_calls=True); without either, the "
                         "runtime's default")
parser.add_argument("--out_of_line_stage_calls", action="store_false", dest="inline_stage_calls",
                    help="PipelinedModel(..., inline_stage_calls=False)")
args = parser.parse_args()

builder = getattr(models, args.model)
model, reference = builder(seed=3), builder(seed=3)
cuts = [int(c) for c in args.cuts.split(",") if c]
replicas = [int(r) for r in args.replicas.split(",")]
if args.virtual_stages:
    plan = interleaved_plan(cuts, len(layer_order(model)), args.micro_batches,
                            args.virtual_stages, args.global_batch, replicas)
else:
    plan = straight_plan(cuts, len(layer_order(model)), args.micro_batches, args.global_batch,
                         replicas=replicas, schedule=args.schedule)
if args.stage_devices:
    for stage, devices in zip(plan.stages, args.stage_devices.split("/")):
        stage.devices = [int(d) for d in devices.split(",")]
    plan.validate()
loss = models.losses_for(model)

pm = dapple.PipelinedModel(model, plan, pipeline_loop=args.pipeline_loop,
                           inline_stage_calls=args.inline_stage_calls)
pm.compile(optimizer=tf.keras.optimizers.Adam(1e-2), loss=loss)
ref_opt = tf.keras.optimizers.Adam(1e-2)


grad_diff, loss_diff, own_gradients = 0.0, 0.0, 0
for step in range(args.steps):
    if step == args.fail_step and pm.rank == args.fail_rank:
        raise RuntimeError(f"injected failure in step {step}")
    if step == args.stall_step and pm.rank == args.stall_rank:
        time.sleep(3600)      # a rank that hangs outside any collective
    x, y = models.data_for(model, args.global_batch, seed=100 + step)
    got = pm.gradients(x, y)
    print(f"rank {pm.rank}: step {step} gradients done", flush=True)
    want_loss, want = models.plain_loss_and_grads(reference, loss, x, y)
    own_gradients = sum(g is not None for g in got)
    for g, w in zip(got, want):
        if g is not None:
            # the plain model's embedding gradients are tf.IndexedSlices
            dense = tf.convert_to_tensor(w).numpy()
            grad_diff = max(grad_diff, float(np.max(np.abs(g.numpy() - dense))))
    got_loss = pm.train_step(x, y)
    print(f"rank {pm.rank}: step {step} train step done", flush=True)
    ref_opt.apply_gradients(zip(want, reference.trainable_variables))
    loss_diff = max(loss_diff, abs(float(got_loss) - float(want_loss)))

pm.gather_weights()
weight_diff = max(float(np.max(np.abs(a - b)))
                  for a, b in zip(model.get_weights(), reference.get_weights()))
checkpoint_diff = None
if args.checkpoint:
    pm.save_weights(args.checkpoint)
    # Every rank reads it back into a fresh plain model (other initial weights).
    fresh = builder(seed=11)
    fresh.load_weights(args.checkpoint)
    checkpoint_diff = max(float(np.max(np.abs(a - b)))
                          for a, b in zip(fresh.get_weights(), reference.get_weights()))
while_ops = None
# While ops of the step, traced again for a batch alike: on the TF cluster, where tracing builds
# no collectives (under horovodrun a second trace of the step wants process sets again).
if args.pipeline_loop and isinstance(pm.runtime, TFClusterRuntime):
    x, y = models.data_for(model, args.global_batch, seed=0)
    step_graph = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients
                             ).get_concrete_function(x, y).graph
    graph_def = step_graph.as_graph_def()     # its own ops and those of the functions it calls
    while_ops = sum(node.op in ("While", "StatelessWhile") for node in list(graph_def.node) + [
        n for f in graph_def.library.function for n in f.node_def])
# This rank's device group runs chunks stage, stage + S, ... (one stage unless interleaved).
stage_vars = sum(len(graph.trainable_variables) for c, graph in enumerate(pm.pipeline_step.stages)
                 if c % plan.num_positions == pm.stage)
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank, "stage": pm.stage, "replica": pm.replica, "grad_diff": grad_diff,
    "loss_diff": loss_diff, "weight_diff": weight_diff, "own_gradients": own_gradients,
    "stage_variables": stage_vars, "final_loss": float(got_loss),
    "checkpoint_diff": checkpoint_diff, "while_ops": while_ops,
    "schedule_loops": pm.pipeline_step.schedule_loops, "pipeline_loop": pm.pipeline_loop,
    "lane_loops": sum(lane.traces for lane in pm.pipeline_step.lane_loops),
    "inlined_stage_calls": sorted({f.inlined for f in pm.pipeline_step.functions}),
    "summed_on_every_replica": sorted(pm.pipeline_step.sum_on_every_replica),
    "accumulator_devices": {f"{s},{r}": sorted({v.device for v in a.variables})
                            for (s, r), a in pm.pipeline_step.loop_accumulators.items()},
    "unit_devices": [pm.pipeline_step.device(s, r) for s, st in enumerate(plan.stages)
                     for r in range(st.replicas)]}), flush=True)
