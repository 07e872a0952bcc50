"""One rank of a job that counts the Horovod collectives in its traced train step.

Builds `dapple.PipelinedModel(model, plan)` (tests.models.mlp_with_skip, Adam), trains 2 steps
(the step runs, so the graph counted is one that works), then reads the train step's graph and
its function library and prints one `DAPPLE_RESULT <json>` line: the Horovod op types by count
over the whole step, and those found in functions a while loop's body reaches (the
data-parallel lane's loop over micro-batches, a pipeline's loops with `--pipeline_loop`), those
an update of a variable depends on (what sits on the update's critical path), with the rank's
stage.
"""
import argparse
import collections
import json

import dapple
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

parser = argparse.ArgumentParser()
parser.add_argument("--cuts", default="")
parser.add_argument("--replicas", default="2")
parser.add_argument("--micro_batches", type=int, default=4)
parser.add_argument("--global_batch", type=int, default=16)
parser.add_argument("--schedule", default="A")
parser.add_argument("--pipeline_loop", action="store_true")
args = parser.parse_args()

model = models.mlp_with_skip(seed=3)
cuts = [int(c) for c in args.cuts.split(",") if c]
replicas = [int(r) for r in args.replicas.split(",")]
plan = straight_plan(cuts, len(layer_order(model)), args.micro_batches, args.global_batch,
                     replicas=replicas, schedule=args.schedule)
pm = dapple.PipelinedModel(model, plan, pipeline_loop=args.pipeline_loop)
pm.compile(optimizer=tf.keras.optimizers.Adam(1e-2), loss=models.losses_for(model))
x, y = models.data_for(model, args.global_batch, seed=5)
losses = [float(pm.train_step(x, y)) for _ in range(2)]

call = pm.make_train_function()
train_fn = next(c.cell_contents for c in call.__closure__
                if hasattr(c.cell_contents, "get_concrete_function"))
graph = train_fn.get_concrete_function(x, y, None).graph.as_graph_def()
functions = {f.signature.name: f for f in graph.library.function}


def called(nodes):
    """Names of the functions `nodes` call (function-valued attributes)."""
    out = set()
    for node in nodes:
        for value in node.attr.values():
            if value.HasField("func"):
                out.add(value.func.name)
            for f in value.list.func:
                out.add(f.name)
    return out


def reachable(names):
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        todo.extend(called(functions[name].node_def))
    return seen


everything = reachable(called(graph.node))
in_step = collections.Counter(n.op for n in graph.node if n.op.startswith("Horovod"))
for name in everything:
    in_step.update(n.op for n in functions[name].node_def if n.op.startswith("Horovod"))
loop_bodies = set()
# in the step's own graph (a pipeline's loops) or in a function it calls (a lane's loop)
for node in list(graph.node) + [n for name in everything for n in functions[name].node_def]:
    if node.op in ("While", "StatelessWhile"):
        loop_bodies.add(node.attr["body"].func.name)
in_loops = collections.Counter()
for name in reachable(loop_bodies):
    in_loops.update(n.op for n in functions[name].node_def if n.op.startswith("Horovod"))
UPDATES = ("AssignSubVariableOp", "AssignAddVariableOp", "AssignVariableOp")


def ancestors(nodes, targets):
    """Names of the nodes `targets` depend on, through data and control inputs."""
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in nodes}
    seen, todo = set(), [t.name for t in targets]
    while todo:
        for parent in inputs.get(todo.pop(), []):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


# The optimizer's updates are in the step's own graph (Keras 2's optimizers, no jit_compile);
# so are the transport's collectives, which the step calls directly.
updates = [n for n in graph.node if n.op.startswith(("ResourceApply",) + UPDATES)]
assert updates, "no variable update found in the train step's graph"
before_update = ancestors(graph.node, updates)
gating = collections.Counter(n.op for n in graph.node
                             if n.op.startswith("Horovod") and n.name in before_update)
# Calls in the step's own graph of functions that must not be inlined (stage calls, the lane's
# loop): such a call's outputs all appear when it ends.
noinline_calls = sum(1 for name in called(graph.node)
                     if name in functions and functions[name].attr["_noinline"].b)
print("DAPPLE_RESULT " + json.dumps({
    "rank": pm.rank, "stage": pm.runtime.stage, "ops": dict(in_step),
    "loop_ops": dict(in_loops), "loops": len(loop_bodies), "gating": dict(gating),
    "noinline_calls": noinline_calls,
    "losses": losses}), flush=True)
