"""Explicit forward/backward split of a Keras (sub-)model through public TF API.

    fwd(x, *extra) -> (y, residuals...)
    bwd(residuals..., dy) -> (dx, dweights...)

Trace forward + `tape.gradient(y, [x] + weights, output_gradients=dy)` into ONE graph with
`tf.compat.v1.wrap_function`; mark every op that depends on `dy` (forward reachability over data
and control edges: public `tf.Operation.outputs`, `tf.Tensor.consumers()`,
`tf.Operation.control_inputs`); residuals = outputs of dy-independent ops consumed by
dy-dependent ops (except constants and the captured variable handles, which the backward keeps
as its own captures). Then cut two functions with `WrappedFunction.prune(feeds, fetches)`:
fwd = prune([x, *extra], [y, *residuals] + stateful update ops), bwd = prune(residuals + [dy],
grads). Every op of the fused graph lands in exactly one of the two (checked by `op_counts`).

Gradients may be IndexedSlices (Embedding): they are fetched as composites and returned as
(values, indices, dense_shape) triples (`SplitStage.unpack` rebuilds them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

import tensorflow as tf

COMPUTE = ("MatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
           "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
           "DepthwiseConv2dNativeBackpropFilter", "FusedBatchNormV3", "FusedBatchNormGradV3",
           "MaxPool", "MaxPoolGrad", "AvgPool", "AvgPoolGrad", "Relu", "ReluGrad", "Tanh",
           "TanhGrad", "Softmax", "ResourceGather", "GatherV2", "UnsortedSegmentSum",
           "RandomUniform", "StatelessRandomUniformV2", "Mean", "Sum")
NO_RESIDUAL = ("Const", "VarHandleOp")
STATEFUL_UPDATES = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp")


@dataclass
class SplitStage:
    fwd: object                     # WrappedFunction: (x, *extra) -> [y, *residuals]
    bwd: object                     # WrappedFunction: (*residuals, dy) -> flat gradients
    residual_specs: List[tf.TensorSpec]
    grad_structure: list            # per gradient: "dense" or "sparse"
    fused: object = None            # the whole wrapped graph (for op counts)
    updates_in_fwd: List[str] = field(default_factory=list)

    def unpack(self, flat: Sequence[tf.Tensor]) -> list:
        out, k = [], 0
        for kind in self.grad_structure:
            if kind == "dense":
                out.append(flat[k]); k += 1
            else:
                out.append(tf.IndexedSlices(flat[k], flat[k + 1], flat[k + 2])); k += 3
        return out


def split_stage(fn, x_spec, extra_specs: Sequence[tf.TensorSpec], variables,
                differentiate_x: bool = True, y_spec=None, keep_updates: bool = True
                ) -> SplitStage:
    """`fn(*xs, *extra) -> y or [ys]` (a Keras call): fwd and bwd as described above.
    `x_spec`/`y_spec`: a TensorSpec or a list of them. Gradients are for the float xs (when
    `differentiate_x`) then `variables`; fwd returns [ys..., residuals...] (`num_outputs`
    ys), bwd takes (residuals..., dys...)."""
    info = {}
    x_specs = list(x_spec) if isinstance(x_spec, (list, tuple)) else [x_spec]
    nx = len(x_specs)

    def as_list(ys):
        return list(ys) if isinstance(ys, (list, tuple)) else [ys]

    if y_spec is None:   # dy needs y's spec: a probe trace (Keras seeds move per trace)
        probe = tf.compat.v1.wrap_function(lambda *a: as_list(fn(*a)), x_specs + list(extra_specs))
        y_specs = [tf.TensorSpec(t.shape, t.dtype) for t in probe.outputs]
    else:
        y_specs = as_list(y_spec)
    ny = len(y_specs)

    def fused(*args):
        xs, dys, extra = args[:nx], args[nx:nx + ny], args[nx + ny:]
        diff_xs = [x for x in xs if differentiate_x and x.dtype.is_floating]
        with tf.GradientTape() as tape:
            for x in diff_xs:
                tape.watch(x)
            ys = as_list(fn(*xs, *extra))
        grads = tape.gradient(ys, diff_xs + list(variables), output_gradients=list(dys),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        info["ys"], info["grads"] = ys, grads
        return ys

    wrapped = tf.compat.v1.wrap_function(fused, x_specs + y_specs + list(extra_specs))
    g = wrapped.graph
    xs_in = list(wrapped.inputs[:nx])
    dys_in = list(wrapped.inputs[nx:nx + ny])
    extra_in = list(wrapped.inputs[nx + ny:nx + ny + len(extra_specs)])
    ys = info["ys"]
    grads = info["grads"]
    # dy-dependent ops: forward closure from dy over data and control edges.
    control_users = {}
    for op in g.get_operations():
        for c in op.control_inputs:
            control_users.setdefault(c, []).append(op)
    dependent = set()
    todo = [d.op for d in dys_in]
    while todo:
        op = todo.pop()
        if op in dependent:
            continue
        dependent.add(op)
        for t in op.outputs:
            todo.extend(t.consumers())
        todo.extend(control_users.get(op, []))
    captured = {id(t) for t in g.internal_captures}

    def rereadable(t):
        # A weight read: the backward reads the variable again (no compute, and no copy of the
        # weights kept per in-flight micro-batch); weights do not change within a step.
        return t.op.type == "ReadVariableOp" and id(t.op.inputs[0]) in captured

    residuals, seen = [], set()
    for op in dependent:
        for t in op.inputs:
            if (t.op in dependent or id(t) in captured or t.op.type in NO_RESIDUAL
                    or rereadable(t)):
                continue
            if t.ref() not in seen:
                seen.add(t.ref())
                residuals.append(t)
        for c in op.control_inputs:
            if c not in dependent and c.type not in NO_RESIDUAL:
                raise ValueError(f"control edge {c.name} -> {op.name} crosses the split")
    flat_grads, kinds = [], []
    for gr in grads:
        if isinstance(gr, tf.IndexedSlices):
            flat_grads += [gr.values, gr.indices, gr.dense_shape]; kinds.append("sparse")
        else:
            flat_grads.append(gr); kinds.append("dense")
    # A fetched gradient part that does not depend on dy (an IndexedSlices' indices) is
    # computed by the forward and handed over as a residual too.
    for t in flat_grads:
        if (t.op not in dependent and id(t) not in captured and t.op.type not in NO_RESIDUAL
                and t.ref() not in seen):
            seen.add(t.ref())
            residuals.append(t)
    residuals.sort(key=lambda t: t.name)
    updates = [op for op in g.get_operations() if op.type in STATEFUL_UPDATES]
    if any(op in dependent for op in updates):
        raise ValueError("a state update depends on dy")
    if not keep_updates:   # e.g. dapple's own once-per-step BN update instead of per call
        updates = []
    fwd = wrapped.prune(xs_in + extra_in, [list(ys) + residuals, updates])
    # prune's lift (tf.__internal__.lift_to_graph) stops at a fed tensor's *op* but its copy
    # walks on upstream of that op: the first prune copies the forward above the residuals too
    # (dead code, stateful RandomUniform included), and fails (KeyError) when such a dead copy
    # reads an unfed output of a multi-output op that produces a residual (FusedBatchNormV3:0
    # when only :3-:5 are residuals). So the first prune feeds every output of every residual
    # producer; the second, now that these are Placeholders without inputs, feeds only the
    # residuals and dy and copies exactly the backward.
    producers = []
    for t in residuals:
        if t.op not in producers:
            producers.append(t.op)
    all_outputs = [o for op in producers for o in op.outputs]
    first = wrapped.prune(all_outputs + dys_in, flat_grads)
    position = {o.ref(): i for i, o in enumerate(all_outputs)}
    keep = ([first.inputs[position[t.ref()]] for t in residuals]
            + list(first.inputs[len(all_outputs):len(all_outputs) + ny]))
    bwd = first.prune(keep, first.outputs)
    out = SplitStage(fwd, bwd, [tf.TensorSpec(t.shape, t.dtype) for t in residuals], kinds,
                     wrapped, [op.name for op in updates])
    out.fused_fetches = list(ys) + flat_grads + updates
    out.num_outputs = ny
    out.num_input_grads = sum(1 for x in xs_in if differentiate_x and x.dtype.is_floating)
    out.residual_names = [t.name for t in residuals]
    return out


def live_ops(graph, fetches) -> list:
    """Ops `fetches` (tensors or ops) depend on, over data and control edges."""
    seen, todo = set(), [f if isinstance(f, tf.Operation) else f.op for f in fetches]
    while todo:
        op = todo.pop()
        if op not in seen:
            seen.add(op)
            todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op for op in graph.get_operations() if op in seen]


def op_counts(graph, types=COMPUTE, fetches=None) -> dict:
    """Compute ops of `graph` by type (only those `fetches` need, if given)."""
    out = {}
    for op in (graph.get_operations() if fetches is None else live_ops(graph, fetches)):
        if op.type in types:
            out[op.type] = out.get(op.type, 0) + 1
    return out
