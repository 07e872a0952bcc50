"""A Keras model's layer graph, its topological layer order, and cutting it into stages.

The layer order defined here is THE layer order of dapple: the profiler writes profiles in it,
and a plan's `layers: [first, last]` are positions in it. It is Keras's own execution order for
functional models (nodes by decreasing depth, as `Functional._run_internal_graph` runs them),
keeping each layer at the position of its first call and leaving out `InputLayer`s.

Cutting re-executes the model's own layer calls (Keras `Node`s) on new tensors, so the stages
share the model's variables: gradients line up with `model.trainable_variables`, and weights saved
from the original model are the pipelined model's weights. A tensor is identified by Keras's
reference id (`str(id(keras_tensor))`, what Keras uses itself). Every tensor that is produced
before a cut and consumed after it crosses that cut, including model inputs that a later stage
reads, and skip connections that span several stages are relayed through the stages in between
(so a boundary's bytes are exactly what the planner counts for that cut).

A layer called several times (shared) sits at the position of its first call; each later call
runs at the position where its inputs are ready (`call_positions`: the layer's own position or,
if later, the latest position that produced one of its inputs), so its calls may fall in
different stages, each of which then holds the layer's variables. Variables shared by different
layers (a tied embedding and output projection) are likewise held by every stage that uses them.

What is read of Keras's graph (nodes, their layers, tensor ids, call arguments, masks) goes
through `graph_rewrite.keras_adapter`, one adapter per Keras version (tf_keras's Keras 2 and
Keras 3).

Limits, each reported with the layer's name: subclassed models (no layer graph), and Keras 2 masks
crossing a cut (a Keras 2 mask rides on its tensor and is not transferred; a Keras 3 mask is a
tensor of the graph, an operation's output, and crosses as any tensor does).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from graph_rewrite import keras_adapter


class CutError(ValueError):
    """The model cannot be cut where the plan says; the message names the layer and why."""


def _check_graph_model(model: tf.keras.Model) -> None:
    if keras_adapter.is_keras3(model):
        if not keras_adapter.Keras3.is_graph_model(model):
            raise CutError(f"Keras 3 model {model.name!r} ({type(model).__name__}) has no "
                           f"functional layer graph: dapple pipelines Keras 3 functional "
                           f"models (keras.Model(inputs, outputs)) and built Sequential ones "
                           f"so far")
        return
    api = keras_adapter.keras2_module_of(model)
    if api is None or not isinstance(model, api.Model):
        raise CutError(f"dapple needs a Keras model, got {type(model).__name__}")
    if not keras_adapter.Keras2.is_graph_model(model):
        if isinstance(model, api.Sequential):
            raise CutError(f"Sequential model {model.name!r} has no layer graph yet: give its "
                           f"first layer an input_shape (or call model.build) before pipelining")
        raise CutError(f"model {model.name!r} is a subclassed Keras model ({type(model).__name__}): "
                       f"it has no layer graph to cut. Build it with the functional API or "
                       f"Sequential")


def nodes_in_execution_order(model: tf.keras.Model):
    """The model's non-input nodes in the order Keras's Functional runs them."""
    keras = keras_adapter.for_model(model)
    by_depth = keras.nodes_by_depth(model)
    out = []
    for depth in sorted(by_depth.keys(), reverse=True):
        for node in by_depth[depth]:
            if not keras.is_input(node):
                out.append(node)
    return out


def layer_order(model: tf.keras.Model) -> List[tf.keras.layers.Layer]:
    """The model's layers (no InputLayers) in dapple's topological order."""
    _check_graph_model(model)
    seen, order = set(), []
    for node in nodes_in_execution_order(model):
        layer = node_layer(node)
        if id(layer) not in seen:
            seen.add(id(layer))
            order.append(layer)
    return order


node_layer = keras_adapter.layer_of


def node_input_ids(node) -> List[str]:
    return keras_adapter.for_node(node).input_ids(node)


def node_output_ids(node) -> List[str]:
    return keras_adapter.for_node(node).output_ids(node)


def call_positions(model: tf.keras.Model) -> List[Tuple[object, int]]:
    """(node, position) for every layer call in execution order: the position of the layer,
    or the latest position producing one of the call's inputs when that is later (a shared
    layer's later call runs where its inputs are)."""
    position = {id(layer): p for p, layer in enumerate(layer_order(model))}
    produced_at = {str(id(t)): -1 for t in model.inputs}
    out = []
    for node in nodes_in_execution_order(model):
        p = max([position[id(node_layer(node))]] + [produced_at.get(tid, -1)
                                                   for tid in node_input_ids(node)])
        for tid in node_output_ids(node):
            produced_at[tid] = p
        out.append((node, p))
    return out


def model_signature(model: tf.keras.Model) -> str:
    """A hash of layer names, types and weight shapes: ties a profile/plan to a model."""
    h = hashlib.sha256()
    for layer in layer_order(model):
        h.update(f"{layer.name}|{type(layer).__name__}|".encode())
        for w in keras_adapter.weights_of(layer):
            h.update(f"{tuple(w.shape)};".encode())
    return h.hexdigest()


@dataclass
class StageGraph:
    """One stage: a contiguous range of layer positions and the tensors entering/leaving it.

    `input_ids` are the tensors it receives (from the previous stage, or model inputs for stage 0);
    `output_ids` the tensors it hands to the next stage (model outputs of the last stage are its
    outputs too). Relayed tensors appear in both.
    """
    index: int
    first: int
    last: int
    layers: List[tf.keras.layers.Layer]
    nodes: list
    input_ids: List[str]
    output_ids: List[str]
    specs: Dict[str, tf.TensorSpec]            # per tensor id; batch dimension is None

    @property
    def called_layers(self) -> List[tf.keras.layers.Layer]:
        """The layers this stage calls: its own, and shared layers whose later calls run here."""
        return _unique(self.layers + [node_layer(node) for node in self.nodes])

    @property
    def trainable_variables(self) -> List[tf.Variable]:
        """Every trainable variable the stage's calls use (a variable shared with another
        stage is in both), once."""
        return _unique(v for layer in self.called_layers
                       for v in keras_adapter.weights_of(layer, trainable_only=True))

    @property
    def variables(self) -> List[tf.Variable]:
        """Every variable, trainable or not, the stage's calls use, once."""
        return _unique(v for layer in self.called_layers for v in keras_adapter.weights_of(layer))

    def call(self, tensors: Dict[str, tf.Tensor], training: bool = True,
             observe=None) -> Dict[str, tf.Tensor]:
        """Run the stage's layer calls on `tensors` (by id); return {id: tensor} of output_ids.
        `observe(node, args, kwargs)`, when given, sees every call before it runs."""
        values: Dict[str, tf.Tensor] = dict(tensors)
        for node in self.nodes:
            args, kwargs = node_call_arguments(node, values, training)
            if observe is not None:
                observe(node, args, kwargs)
            layer = node_layer(node)
            outputs = layer(*args, **kwargs)
            if keras_adapter.for_model(layer).added_losses(layer):
                raise ValueError(
                    f"layer {layer.name!r} ({type(layer).__name__}) adds a loss in its call "
                    f"(add_loss): computed from activations, the pipelined step does not "
                    f"include it, so it would train a different objective than Keras; remove "
                    f"it or add it to the compiled loss")
            for tid, y in zip(node_output_ids(node), tf.nest.flatten(outputs)):
                values[tid] = y
        return {tid: values[tid] for tid in self.output_ids}


def draws_random_numbers(layer) -> bool:
    """Whether `layer` (Dropout and its kin) draws random numbers in training."""
    return keras_adapter.for_model(layer).draws_random_numbers(layer)


def _unique(items) -> list:
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def node_call_arguments(node, values: Dict[str, tf.Tensor], training: bool):
    """(args, kwargs) to call a Keras node's layer with, its input tensors looked up by id:
    the mapping and training flag of that Keras's Functional (`keras_adapter`)."""
    return keras_adapter.for_node(node).call_arguments(node, values, training)


def _spec(keras_tensor) -> tf.TensorSpec:
    shape = list(keras_tensor.shape)
    if shape:
        shape[0] = None
    return tf.TensorSpec(shape, keras_tensor.dtype, name=keras_tensor.name)


def cut_model(model: tf.keras.Model, ranges: Sequence[Tuple[int, int]]) -> List[StageGraph]:
    """Cut `model` into stages covering the inclusive layer-position `ranges`.

    Raises CutError (naming the layer) when the ranges do not cover the model's layers or a
    cut is impossible.
    """
    order = layer_order(model)
    n = len(order)
    expected = 0
    for i, (first, last) in enumerate(ranges):
        if first != expected or last < first:
            raise CutError(f"stage {i} covers layers [{first}, {last}] but must start at layer "
                           f"{expected}: stages must cover consecutive layer ranges")
        expected = last + 1
    if expected != n:
        raise CutError(f"the plan covers layers 0..{expected - 1} but model {model.name!r} has {n} "
                       f"layers (0..{n - 1}); plan and model do not match")
    stage_of_position = {}
    for s, (first, last) in enumerate(ranges):
        for p in range(first, last + 1):
            stage_of_position[p] = s
    S = len(ranges)

    keras_tensor = {}
    producer_stage: Dict[str, int] = {}        # -1 for model inputs
    for t in model.inputs:
        keras_tensor[str(id(t))] = t
        producer_stage[str(id(t))] = -1
    nodes_by_stage: List[list] = [[] for _ in range(S)]
    last_consumer: Dict[str, int] = {}
    keras = keras_adapter.for_model(model)
    for node, p in call_positions(model):
        layer = keras.layer(node)
        s = stage_of_position[p]
        for tid in keras.input_ids(node):
            if tid not in producer_stage:
                raise CutError(f"layer {layer.name!r} reads a tensor that no earlier layer "
                               f"produces; the model graph is not supported")
            last_consumer[tid] = max(last_consumer.get(tid, -1), s)
        for tid, kt in zip(keras.output_ids(node), keras.outputs(node)):
            keras_tensor[tid] = kt
            producer_stage[tid] = s
        nodes_by_stage[s].append(node)
    for t in model.outputs:
        last_consumer[str(id(t))] = S      # the loss consumes model outputs "after" the last stage

    output_ids_model = [str(id(t)) for t in model.outputs]
    stages = []
    for s, (first, last) in enumerate(ranges):
        # Tensors crossing the cut before stage s: produced before s, consumed at or after s.
        crossing_in = [tid for tid in keras_tensor
                       if producer_stage[tid] < s and last_consumer.get(tid, -2) >= s]
        crossing_out = [tid for tid in keras_tensor
                        if producer_stage[tid] <= s and last_consumer.get(tid, -2) > s]
        if s == S - 1:
            crossing_out = [tid for tid in output_ids_model]
        for tid in crossing_out if s < S - 1 else []:
            if keras.mask(keras_tensor[tid]) is not None:
                layer = keras_tensor[tid]._keras_history[0]     # either Keras's producer
                raise CutError(f"the output of layer {layer.name!r} carries a "
                               f"Keras mask and would cross the cut after stage {s}; masks are not "
                               f"transferred between stages: move the cut")
        stages.append(StageGraph(
            index=s, first=first, last=last,
            layers=order[first:last + 1], nodes=nodes_by_stage[s],
            input_ids=crossing_in, output_ids=crossing_out,
            specs={tid: _spec(keras_tensor[tid]) for tid in set(crossing_in) | set(crossing_out)},
))
    return stages


def variable_holders(stages: Sequence[StageGraph]) -> Dict[int, List[int]]:
    """For every trainable variable (by id), the stages that use it, in order."""
    holders: Dict[int, List[int]] = {}
    for graph in stages:
        for v in graph.trainable_variables:
            holders.setdefault(id(v), []).append(graph.index)
    return holders


def model_input_ids(model: tf.keras.Model) -> List[str]:
    return [str(id(t)) for t in model.inputs]


def model_output_ids(model: tf.keras.Model) -> List[str]:
    return [str(id(t)) for t in model.outputs]
