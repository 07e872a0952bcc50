"""A stage's forward and backward as two functions, with the forward's residuals between them.

A loop over a pipeline's steady periods runs micro-batch j's forward in one iteration and its
backward in a later one. A `tf.GradientTape` keeps what the backward needs only within one
graph, so it cannot cross iterations; recomputing the forward in the backward costs a third
more compute. Here the forward hands its residuals over explicitly, as loop variables can
carry them:

    forward(inputs, labels, weights) -> (outputs, term, statistics, residuals)
    backward(residuals, output gradients) -> (input gradients, weight gradients)

The residuals travel packed, one flat tensor per dtype for the small ones
(`packing.PackedElements`), packed inside the forward's function and unpacked inside the
backward's: a call site, or a loop carrying them, holds a few tensors, not one op per residual
(MobileNetV2's interleaved loop at M = 8 held 2,600 Reshape ops before).

Both come from one graph, traced once with `tf.compat.v1.wrap_function`: the stage's forward
(`StageFunction.inline`, so BatchNormalization statistics are returned as in the unrolled
step) and `tape.gradient` of its targets with respect to its float inputs and weights, weighted
by placeholders for the output gradients. Every op that depends on those placeholders (over
data and control edges) is backward; the residuals are the forward tensors backward ops read
(not constants, captured variables or reads of them: the backward reads the weights again,
which do not change within a synchronous step; a relaxed schedule's do, so there the forward's
reads are residuals, `stash_weights`). `WrappedFunction.prune` then cuts the two functions; each
op of the traced graph lands in exactly one of them, so nothing is computed twice.

The backward is pruned twice: a first prune from the residuals would copy what lies above
their ops too (dead code, random ops included), and fails when such a copy reads an output of
a multi-output op that is not a residual (FusedBatchNormV3's first output when only its saved
statistics are residuals); feeding every output of every residual's producer first, then only
the residuals, copies exactly the backward.

Zero-bubble schedules cut the backward once more (`split_weights`), from the same graph: I is
what the input gradients need of the backward ops (with the output gradients it receives), W
the rest of what the weight gradients need (MatMul's and Conv2DBackpropFilter's weight products,
bias sums). W reads forward residuals, which I hands on, and tensors of I (the gradients of the
layers' outputs), which I returns; an op both need is I's. Each backward op lands in one of
them. The unrolled step calls the same functions, one call op per action (`pipeline.py`),
kept a call when the step is optimized (`StageSplit.called`).

Keras's own moving-statistics updates (writes to the device's scratch variables,
`batch_statistics.ScratchStatistics`) are left out: the step applies its own once per step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from graph_rewrite import batch_statistics as bstats
from graph_rewrite.local_transport import Tensors
from graph_rewrite.packing import PackedElements
from graph_rewrite.stage_function import StageFunction
from graph_rewrite.stage_gradients import is_float, watch_inputs

# Ops whose outputs are never residuals: the backward makes its own.
NOT_RESIDUAL = ("Const", "VarHandleOp")


@dataclass
class StageSplit:
    """One stage on one device, for slices of fixed rows; see the module docstring."""
    forward_function: object        # WrappedFunction: (*inputs, *extra) -> [returned, residuals]
    backward_function: object           # WrappedFunction: (*residuals, *dys) -> gradients
    input_ids: List[str]
    output_ids: List[str]               # the stage's outputs, in the order returned
    differentiated_inputs: List[str]    # float inputs that get gradients (none on stage 0)
    differentiated_outputs: List[str]   # float outputs whose gradients backward takes
    has_term: bool
    statistics_keys: List[str]          # BatchNormalization calls, as `StageFunction` keys
    residual_specs: List[tf.TensorSpec]
    gradient_shapes: List[tf.TensorShape]   # of the differentiated inputs, then of the weights
    # With `split_weights`: the backward again as I (input gradients) then W (weight gradients).
    input_function: object = None       # (*residuals, *dys) -> [input gradients, W's from I]
    weight_function: object = None      # (*W's from the forward, *W's from I) -> weight grads
    weight_residuals: List[int] = None  # the residuals W reads, by index
    pending_specs: List[tf.TensorSpec] = None   # what W reads: those residuals, then I's
    kept_called: bool = False           # its functions stay call ops (`called`)
    _called: Optional["StageSplit"] = dataclasses.field(default=None, repr=False, compare=False)
    _functions: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _pending: Optional[PackedElements] = dataclasses.field(default=None, repr=False,
                                                           compare=False)

    def __post_init__(self):
        # The residuals leave the forward packed and are unpacked inside what reads them, so a
        # call site (a loop carrying them, every warm-up call) holds no per-residual ops.
        self.residual_packing = PackedElements(self.residual_specs)

    @property
    def packed_residual_specs(self) -> List[tf.TensorSpec]:
        """The residuals as `forward` returns them."""
        return self.residual_packing.packed_specs()

    def _function(self, name: str, run):
        """`run` as a `tf.function`, made once per split: inlined where it is called unless
        `kept_called`."""
        if name not in self._functions:
            self._functions[name] = tf.function(
                run, autograph=False,
                experimental_attributes={"_noinline": True} if self.kept_called else None)
        return self._functions[name]

    def _forward_packed(self, *args):
        flat = list(self.forward_function(*args)[0])
        cut = len(flat) - len(self.residual_specs)
        return flat[:cut] + self.residual_packing.pack(flat[cut:])

    def _forward_joined(self, *args):
        """`_forward_packed` with the BatchNormalization statistics as one flat (means, m2s)
        pair: a loop writes them in two ops whatever the layers."""
        flat = self._forward_packed(*args)
        k = len(self.output_ids) + int(self.has_term)
        n = 2 * len(self.statistics_keys)
        statistics = flat[k:k + n]
        joined = [bstats.joined(statistics[0::2]), bstats.joined(statistics[1::2])] if n else []
        return flat[:k] + joined + flat[k + n:]

    def _backward_packed(self, *args):
        n = len(self.residual_packing.groups)
        return self.backward_function(*self.residual_packing.unpack(list(args[:n])), *args[n:])

    def _input_packed(self, *args):
        n = len(self.residual_packing.groups)
        residuals = self.residual_packing.unpack(list(args[:n]))
        flat = list(self.input_function(*residuals, *args[n:]))
        k = len(self.differentiated_inputs)
        pending = [residuals[i] for i in self.weight_residuals] + flat[k:]
        return flat[:k] + self._pending_packing().pack(pending)

    def _weight_packed(self, *pending):
        return self.weight_function(*self._pending_packing().unpack(list(pending)))

    def _pending_packing(self) -> PackedElements:
        """How I hands W what it reads (`pending_specs`, set after the split is made)."""
        if self._pending is None:
            self._pending = PackedElements(self.pending_specs)
        return self._pending

    def forward(self, inputs: Tensors, labels=None, weights=None,
                joined_statistics: bool = False):
        """(outputs by id, loss term or None, {key: (mean, m2)}, residuals); with
        `joined_statistics` the statistics are one (means, m2s) pair of flat tensors, the
        keys' in order (None without BatchNormalization)."""
        extra = [t for t in list(labels or []) + list(weights or []) if t is not None]
        run = self._forward_joined if joined_statistics else self._forward_packed
        flat = self._function("forward_joined" if joined_statistics else "forward", run)(
            *[inputs[t] for t in self.input_ids], *extra)
        n = len(self.output_ids)
        outputs = dict(zip(self.output_ids, flat[:n]))
        term = flat[n] if self.has_term else None
        k = n + int(self.has_term)
        if joined_statistics:
            width = 2 if self.statistics_keys else 0
            statistics = tuple(flat[k:k + 2]) if width else None
        else:
            width = 2 * len(self.statistics_keys)
            statistics = {key: (flat[k + 2 * i], flat[k + 2 * i + 1])
                          for i, key in enumerate(self.statistics_keys)}
        return outputs, term, statistics, list(flat[k + width:])

    def backward(self, residuals: Sequence[tf.Tensor], output_gradients: Sequence[tf.Tensor]):
        """(gradients of the differentiated inputs by id, gradients of the stage's weights);
        `output_gradients`: of the loss term (last stage) or of `differentiated_outputs`."""
        flat = self._function("backward", self._backward_packed)(*residuals, *output_gradients)
        for g, shape in zip(flat, self.gradient_shapes):   # a pruned graph may lose them
            g.set_shape(shape)
        n = len(self.differentiated_inputs)
        return dict(zip(self.differentiated_inputs, flat[:n])), list(flat[n:])

    def backward_input(self, residuals: Sequence[tf.Tensor],
                       output_gradients: Sequence[tf.Tensor]):
        """I: (gradients of the differentiated inputs by id, what W reads, packed)."""
        flat = self._function("input", self._input_packed)(*residuals, *output_gradients)
        n = len(self.differentiated_inputs)
        for g, shape in zip(flat[:n], self.gradient_shapes):
            g.set_shape(shape)
        return dict(zip(self.differentiated_inputs, flat[:n])), list(flat[n:])

    def called(self) -> "StageSplit":
        """The same split whose functions stay call ops when the step is optimized (an
        unrolled step calls them once per micro-batch: inlined, the optimizer would rewrite a
        copy of each per call, as `StageFunction` says). A loop calls them once in its body."""
        if self._called is None:
            self._called = dataclasses.replace(self, kept_called=True, _called=None,
                                               _functions={})
        return self._called

    def backward_weight(self, pending: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        """W: the gradients of the stage's weights from what I left."""
        flat = self._function("weight", self._weight_packed)(*pending)
        for g, shape in zip(flat, self.gradient_shapes[len(self.differentiated_inputs):]):
            g.set_shape(shape)
        return list(flat)


def split_stage(function: StageFunction, stage: int, rows: int, global_rows: int,
                scratch, input_specs: Dict[str, tf.TensorSpec],
                label_specs: Optional[List[tf.TensorSpec]] = None,
                weight_specs: Optional[List[Optional[tf.TensorSpec]]] = None,
                split_weights: bool = False,
                variables: Optional[Sequence[tf.Variable]] = None,
                stash_weights: bool = False) -> StageSplit:
    """Split `function` (stage `stage`) for slices of `rows` rows in training mode; `scratch`
    is the calling device's `function.on(device)`; the specs give the slice's inputs (by id),
    labels and sample weights (last stage, None where a weight is absent). `split_weights`:
    also cut the backward into I and W (zero-bubble schedules); `variables`: what the weight
    gradients are taken for (default the stage's trainable variables; the device's working
    copies where its calls read them); `stash_weights`: the forward's reads of the weights are
    residuals too, so the backward differentiates at the weights its forward read though they
    change in between (the relaxed schedules' weight stashing)."""
    graph = function.graph
    input_ids = list(graph.input_ids)
    label_specs = list(label_specs or [])
    weight_specs = list(weight_specs or [])
    extra_specs = label_specs + [w for w in weight_specs if w is not None]
    x_specs = [tf.TensorSpec([rows] + input_specs[t].shape[1:].as_list(), input_specs[t].dtype)
               for t in input_ids]
    last = function.last
    if last:
        dy_ids, dy_specs = [], [tf.TensorSpec([], tf.float32)]
    else:
        dy_ids = [t for t in graph.output_ids if graph.specs[t].dtype.is_floating]
        dy_specs = [tf.TensorSpec([rows] + graph.specs[t].shape[1:].as_list(),
                                  graph.specs[t].dtype) for t in dy_ids]
    nx, ny = len(x_specs), len(dy_specs)
    variables = list(graph.trainable_variables if variables is None else variables)
    found = {}

    def fused(*args):
        inputs = dict(zip(input_ids, args[:nx]))
        dys, extra = args[nx:nx + ny], list(args[nx + ny:])
        labels = extra[:len(label_specs)] if last else None
        rest = iter(extra[len(label_specs):])
        weights = [None if w is None else next(rest) for w in weight_specs] if last else None
        with tf.GradientTape() as tape:
            watch_inputs(tape, inputs, stage)
            outputs, term, statistics = function.inline(inputs, True, labels, weights, rows,
                                                        global_rows, scratch)
        float_in = [t for t in input_ids if stage > 0 and is_float(inputs[t])]
        targets = [term] if last else [outputs[t] for t in dy_ids]
        grads = tape.gradient(targets, [inputs[t] for t in float_in] + variables,
                              output_gradients=list(dys),
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # Embedding gradients come as IndexedSlices, which do not add up across micro-batches.
        found["gradients"] = [tf.convert_to_tensor(g) for g in grads]
        found["float_in"] = float_in
        found["keys"] = keys = sorted(statistics)
        found["term"] = term is not None
        returned = [outputs[t] for t in graph.output_ids] + ([term] if term is not None else [])
        return returned + [t for k in keys for t in statistics[k]]

    wrapped = tf.compat.v1.wrap_function(fused, x_specs + dy_specs + extra_specs)
    xs = list(wrapped.inputs[:nx])
    dys = list(wrapped.inputs[nx:nx + ny])
    extra = list(wrapped.inputs[nx + ny:nx + ny + len(extra_specs)])
    gradients = found["gradients"]
    residuals = _residuals(wrapped.graph, dys, gradients, stash_weights)
    forward = wrapped.prune(xs + extra, [list(wrapped.outputs) + residuals, []])
    backward = _prune_exactly(wrapped, residuals + dys, gradients)
    split = StageSplit(forward, backward, input_ids, list(graph.output_ids), found["float_in"],
                       dy_ids, found["term"], found["keys"],
                       [tf.TensorSpec(t.shape, t.dtype) for t in residuals],
                       [g.shape for g in gradients])
    if split_weights:
        n = len(found["float_in"])
        from_forward, from_input = _weight_residuals(wrapped.graph, dys, gradients[:n],
                                                     gradients[n:], residuals)
        split.input_function = _prune_exactly(wrapped, residuals + dys,
                                              gradients[:n] + from_input)
        split.weight_function = _prune_exactly(wrapped, from_forward + from_input, gradients[n:])
        index = {t.ref(): i for i, t in enumerate(residuals)}
        split.weight_residuals = [index[t.ref()] for t in from_forward]
        split.pending_specs = [tf.TensorSpec(t.shape, t.dtype) for t in from_forward + from_input]
    return split


def _prune_exactly(wrapped, feeds: Sequence[tf.Tensor], fetches: Sequence[tf.Tensor]):
    """`wrapped` pruned to compute `fetches` from `feeds`, copying none of the ops above them
    (see the module docstring): first from every output of the feeds' producers, then from
    the feeds alone."""
    producers = list(dict.fromkeys(t.op for t in feeds))
    every_output = [o for op in producers for o in op.outputs]
    first = wrapped.prune(every_output, list(fetches))
    position = {o.ref(): i for i, o in enumerate(every_output)}
    return first.prune([first.inputs[position[t.ref()]] for t in feeds], first.outputs)


def _after(graph, dys: Sequence[tf.Tensor]) -> set:
    """The ops that depend on `dys` over data and control edges."""
    control_users: Dict[tf.Operation, List[tf.Operation]] = {}
    for op in graph.get_operations():
        for c in op.control_inputs:
            control_users.setdefault(c, []).append(op)
    after, todo = set(), [d.op for d in dys]
    while todo:
        op = todo.pop()
        if op in after:
            continue
        after.add(op)
        for t in op.outputs:
            todo.extend(t.consumers())
        todo.extend(control_users.get(op, []))
    return after


def _before(tensors: Sequence[tf.Tensor], within: set) -> set:
    """The ops of `within` that `tensors` depend on (data and control edges)."""
    found, todo = set(), [t.op for t in tensors if t.op in within]
    while todo:
        op = todo.pop()
        if op in found:
            continue
        found.add(op)
        todo.extend(t.op for t in op.inputs if t.op in within)
        todo.extend(c for c in op.control_inputs if c in within)
    return found


def _weight_residuals(graph, dys, input_gradients, weight_gradients, residuals):
    """(the forward's residuals W reads, the tensors of I that W reads): I is what the input
    gradients need of the backward, W the rest of what the weight gradients need."""
    backward = _after(graph, dys)
    input_ops = _before(input_gradients, backward) | {d.op for d in dys}   # I receives dys
    weight_ops = _before(weight_gradients, backward) - input_ops
    forward = {t.ref() for t in residuals}
    from_forward, from_input = {}, {}
    needed = [t for op in weight_ops for t in op.inputs] + [
        t for t in weight_gradients if t.op not in weight_ops]
    for t in needed:
        if t.op in weight_ops:
            continue
        if t.op in input_ops:
            from_input.setdefault(t.ref(), t)
        elif t.ref() in forward:
            from_forward.setdefault(t.ref(), t)
    for op in weight_ops:
        for c in op.control_inputs:
            if c in input_ops:
                raise ValueError(f"control edge {c.name} -> {op.name} crosses the I/W split")
    by_name = lambda ts: sorted(ts.values(), key=lambda t: t.name)     # noqa: E731
    return by_name(from_forward), by_name(from_input)


def _residuals(graph, dys: Sequence[tf.Tensor], fetched: Sequence[tf.Tensor],
               stash_weights: bool = False) -> List[tf.Tensor]:
    """The tensors computed without the output gradients that the backward reads (with
    `stash_weights`, the forward's reads of captured variables among them)."""
    backward = _after(graph, dys)
    captured = {id(t) for t in graph.internal_captures}

    def kept(t) -> bool:
        reread = (not stash_weights and t.op.type == "ReadVariableOp"
                  and id(t.op.inputs[0]) in captured)
        return not (t.op in backward or id(t) in captured or t.op.type in NOT_RESIDUAL
                    or reread)

    residuals = {}
    for op in backward:
        for t in op.inputs:
            if kept(t):
                residuals.setdefault(t.ref(), t)
        for c in op.control_inputs:
            if c not in backward and c.type not in NOT_RESIDUAL:
                raise ValueError(f"control edge {c.name} -> {op.name} crosses the split")
    # A gradient that does not depend on the output gradients (zeros of an unconnected weight)
    # is computed by the forward and handed over too.
    for t in fetched:
        if kept(t):
            residuals.setdefault(t.ref(), t)
    return sorted(residuals.values(), key=lambda t: t.name)
