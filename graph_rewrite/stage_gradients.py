"""A unit's backward: the gradients a stage's tape gives for its inputs and variables."""
from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from graph_rewrite.local_transport import Tensors
from graph_rewrite.model_graph import StageGraph


def is_float(t) -> bool:
    return t.dtype.is_floating


def watch_inputs(tape: tf.GradientTape, inputs: Tensors, stage: int) -> None:
    """Watch the float inputs whose gradients go back to the previous stage."""
    if stage > 0:
        for t in inputs.values():
            if is_float(t):
                tape.watch(t)


def stage_gradients(graph: StageGraph, tape, inputs: Tensors, outputs: Tensors, term,
                    upstream: Optional[Tensors], loss_scale: Optional[tf.Tensor] = None,
                    one: Optional[tf.Tensor] = None, zero=None,
                    untargeted: Sequence[tf.Tensor] = (), variables=None):
    """A unit's backward from its forward's tape: (gradients of its float inputs by id,
    gradients of the stage's trainable variables, or of `variables`: their working copies). The last stage differentiates its loss
    term (`upstream` None); the others their float outputs weighted by `upstream`, plus
    their weight-regularization term when they have one. `loss_scale` multiplies the
    gradient of the loss (mixed precision); `one`, when given, is the 1.0 the gradient of a term
    starts from (read from a variable, so the graph optimizer cannot fold it). With `zero`
    (a tensor -> zeros like it, read alike), the forward's other outputs (`untargeted`: the last stage's predictions,
    BatchNormalization statistics) get that zero as their gradient instead of a constant the
    optimizer would fold into a copy of the backward function for every call."""
    targets, output_gradients, float_in = backward_targets(
        graph, inputs, outputs, term, upstream, loss_scale, one, zero, untargeted)
    variables = graph.trainable_variables if variables is None else list(variables)
    sources = [inputs[tid] for tid in float_in] + variables
    grads = tape.gradient(targets, sources, output_gradients=output_gradients,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # Embedding gradients come as tf.IndexedSlices, which do not add up across
    # micro-batches and replicas; dense tensors do (at the cost of a dense table gradient).
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    grads_in = dict(zip(float_in, grads[:len(float_in)]))
    return grads_in, list(grads[len(float_in):])


def backward_targets(graph: StageGraph, inputs: Tensors, outputs: Tensors, term, upstream,
                     loss_scale, one, zero, untargeted):
    """(targets, their output gradients, ids of the float inputs that get gradients)."""
    if upstream is None:
        targets, output_gradients = [term], [scaled_one(term, one, loss_scale)]
    else:
        float_out = [tid for tid in graph.output_ids if is_float(outputs[tid])]
        targets = [outputs[tid] for tid in float_out]
        output_gradients = [upstream[tid] for tid in float_out]
        if term is not None:            # this stage's weight-regularization penalty
            targets.append(term)
            output_gradients.append(scaled_one(term, one, loss_scale))
    # Stage 0's inputs are the model's: nobody reads their gradients.
    if zero is not None:
        for t in untargeted:
            if is_float(t):
                targets.append(t)
                output_gradients.append(zero(t))
    float_in = [] if graph.index == 0 else [tid for tid in graph.input_ids
                                            if is_float(inputs[tid])]
    return targets, output_gradients, float_in


def scaled_one(term: tf.Tensor, one: Optional[tf.Tensor],
               loss_scale: Optional[tf.Tensor]) -> tf.Tensor:
    """d(loss)/d(term): 1, times the loss scale under mixed precision."""
    ones = tf.ones_like(term)
    if one is not None:
        ones = ones * tf.cast(one, term.dtype)
    return ones if loss_scale is None else ones * tf.cast(loss_scale, term.dtype)

