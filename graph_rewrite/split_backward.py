"""The split backward of zero-bubble schedules: I (input gradients) now, W (weight gradients)
later, from one forward's tape, with no work done twice and no per-layer code.

TensorFlow already computes a layer's input and weight gradients as separate ops (MatMul's two
products, Conv2DBackpropInput and Conv2DBackpropFilter); what a tape cannot do is stop between
them. So the split is made at the ops that use a weight (found in the forward's own ops, from
the variables' reads):

* I asks the tape for the gradients of the stage's float inputs and of every weight-using op's
  outputs (g). That walks the whole chain of activation gradients; the weight-gradient products
  the walk would also build are unused and pruned.
* W asks, for each read of a variable, the gradient of the outputs of the ops using that read
  with respect to the read, weighted by their g: only those ops' weight products (and the
  read's casts and reshapes) are built. The sum over a variable's reads is its gradient.

A weight-using op is the first consumer of a read past ops that only move the weight
(`MOVES`: casts of mixed precision, reshapes of `tensordot`). Ops that take a variable's handle
themselves (an embedding's `ResourceGather`) are weight-using ops whose source is the variable.
The stage runs inlined (its ops must be visible to the tape), so a split stage's graph grows
with micro-batches, as the runtime before traced-once stage functions did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import tensorflow as tf

MOVES = ("Cast", "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze")


@dataclass
class WeightUse:
    variable: int                     # index in the stage's trainable variables
    source: tf.Tensor                 # the read (or the variable) W differentiates against
    targets: List[tf.Tensor]          # float outputs of the ops using it


def _first_users(tensor: tf.Tensor) -> List[tf.Operation]:
    out = []
    for op in tensor.consumers():
        if op.type in MOVES:
            out += [u for t in op.outputs for u in _first_users(t)]
        else:
            out.append(op)
    return out


def find_weight_uses(ops: Sequence[tf.Operation], variables: Sequence[tf.Variable],
                     graph) -> List[WeightUse]:
    """The weight uses among `ops` (a forward's ops, in the function graph `graph`)."""
    by_handle = {id(v.handle): i for i, v in enumerate(variables)}
    index: Dict[int, int] = {id(internal): by_handle[id(external)]
                             for external, internal in graph.captures
                             if id(external) in by_handle}
    window = set(ops)
    uses = []
    for op in ops:
        if not op.inputs or id(op.inputs[0]) not in index:
            continue
        i = index[id(op.inputs[0])]
        if op.type == "ReadVariableOp":
            users = [u for u in _first_users(op.outputs[0]) if u in window]
            source = op.outputs[0]
        else:                         # uses the handle itself (ResourceGather)
            users, source = [op], variables[i]
        targets = [t for u in users for t in u.outputs if t.dtype.is_floating]
        if targets:
            uses.append(WeightUse(i, source, targets))
    return uses


def input_pass(tape: tf.GradientTape, targets, output_gradients, inputs: Sequence[tf.Tensor],
               uses: Sequence[WeightUse]):
    """I: (gradients of `inputs`, gradients of every use's targets)."""
    outs = [t for u in uses for t in u.targets]
    grads = tape.gradient(targets, list(inputs) + outs, output_gradients=output_gradients,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return grads[:len(inputs)], grads[len(inputs):]


def weight_pass(tape: tf.GradientTape, uses: Sequence[WeightUse], target_gradients,
                variables: Sequence[tf.Variable]) -> List[tf.Tensor]:
    """W: every variable's gradient (dense), from I's gradients of the uses' targets."""
    sums: Dict[int, tf.Tensor] = {}
    k = 0
    for use in uses:
        g = target_gradients[k:k + len(use.targets)]
        k += len(use.targets)
        grad = tape.gradient(use.targets, use.source, output_gradients=g,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grad = tf.convert_to_tensor(grad)
        sums[use.variable] = grad if use.variable not in sums else sums[use.variable] + grad
    return [sums[i] if i in sums else tf.zeros_like(v) for i, v in enumerate(variables)]
