"""One rank of a relaxed-schedule job (pipedream, 2bw, avgpipe) for the multi-process tests.

Every rank trains `dapple.PipelinedModel` with plain SGD for 5 steps (M = 4), cut into runs of
the given lengths (`--runs`), or by `fit` in runs of `--fit` global batches; gathers every
stage's weights, and compares them with the schedule's rule computed here on the plain,
unpipelined Keras model (`tests/relaxed_rules.py`) and with synchronous training on the same
data. It prints one `DAPPLE_RESULT <json>` line.
"""
import argparse
import json

import dapple
import tensorflow as tf

from planner.formats.plan import straight_plan
from tests import models
from tests import relaxed_rules as rules

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", required=True)
parser.add_argument("--cuts", default="2")
parser.add_argument("--replicas", default="1,1")
parser.add_argument("--runs", default="2,3", help="global batches (steps) per train_step")
parser.add_argument("--vertical_sync", action="store_true")
parser.add_argument("--advance", type=int, default=None)
parser.add_argument("--fit", type=int, default=None, metavar="STEPS_PER_EXECUTION",
                    help="train with the model's Keras's fit instead of train_step runs")
parser.add_argument("--loop", action="store_true",
                    help="PipelinedModel(pipeline_loop=True): the lists' periodic parts as loops")
args = parser.parse_args()

B, M, LR = 16, 4, 0.5
LAYERS = ["d1", "d2", "add", "d3", "out"]
cuts = [int(c) for c in args.cuts.split(",") if c]
replicas = [int(r) for r in args.replicas.split(",")]
runs = [int(r) for r in args.runs.split(",")]
steps = sum(runs)
N = replicas[0] if args.schedule == "avgpipe" else 1

plan = straight_plan(cuts, 5, M, B, replicas=replicas, schedule=args.schedule)
if args.vertical_sync:
    plan.vertical_sync = True
if args.advance is not None:
    plan.advance = args.advance
plan.validate()
model = models.mlp_with_skip(seed=3)
loss = models.losses_for(model)
x, y = models.data_for(model, steps * N * B, seed=1)

pm = dapple.PipelinedModel(model, plan, pipeline_loop=True if args.loop else None)
if args.fit:
    pm.compile(tf.keras.optimizers.SGD(LR), loss, steps_per_execution=args.fit)
    history = pm.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    last_loss = history.history["loss"][-1]
else:
    pm.compile(tf.keras.optimizers.SGD(LR), loss)
    lo = 0
    for k in runs:
        last_loss = float(pm.train_step(x[lo:lo + k * N * B], y[lo:lo + k * N * B]))
        lo += k * N * B
pm.gather_weights()
got = [v.numpy() for v in model.trainable_variables]

batches = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(steps * N)]
plain = models.mlp_with_skip(seed=3)
if args.schedule == "avgpipe":
    grouped = [batches[t * N:(t + 1) * N] for t in range(steps)]
    want, _ = rules.avgpipe(plain, loss, grouped, LR)
    sync = rules.data_parallel(models.mlp_with_skip(seed=3), loss, grouped, LR)
else:
    sync = rules.synchronous(models.mlp_with_skip(seed=3), loss, batches, LR)
    if args.schedule == "2bw":
        want = rules.two_bw(plain, loss, batches, LR)
    else:
        mb = B // M
        bounds = [0] + cuts + [len(LAYERS)]
        stage_of = rules.stage_of_variables(
            plain, [LAYERS[a:b] for a, b in zip(bounds, bounds[1:])])
        S = len(replicas)
        want = rules.pipedream(plain, loss, [(x[j * mb:(j + 1) * mb], y[j * mb:(j + 1) * mb])
                                             for j in range(steps * M)], LR, stage_of,
                               [S - s for s in range(S)], args.vertical_sync)

print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank, "stage": pm.stage, "replica": pm.replica,
    "rule_diff": rules.max_difference(got, want), "sync_diff": rules.max_difference(got, sync),
    "loss": last_loss, "schedule_loops": pm.training_step.schedule_loops}), flush=True)
