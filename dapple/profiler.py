"""The Keras profiler: per-layer times and sizes of a model, in dapple's native profile format.

    prof = dapple.profile(model, x, y, output="model.profile.json")   # a planner Profile
    prof = measure_profile(model, x)                                  # the same, not written

Layers come in `graph_rewrite.model_graph.layer_order` order, so the profile's positions are
the positions a Plan's `layers: [first, last]` refer to. For each layer:

* `forward_ms`, `backward_ms`: the layer measured on its own, on the local default device, with
  inputs of the right shapes and values taken from one forward pass of the whole model on `x`.
  Each measurement is a `tf.function` (so graph, not eager, costs), run `warmup` times and then
  `runs` times, the median kept. Backward is measured as (forward + gradients of the outputs
  with respect to the float inputs and trainable weights) minus forward, since TensorFlow 2 has
  no separate backward to time; it is floored at 1 microsecond when noise makes it smaller.
* `input_gradient_ms`: the part of the backward that is the input gradient (I of a split
  backward): (forward + gradients of the float inputs only) minus forward, kept between 0 and
  `backward_ms`; the weight gradient (W) is the rest.
  A layer called several times (shared) counts all its calls, at its own (first call's)
  position.
* `output_bytes`: the outputs of the calls made at this position (`model_graph.call_positions`:
  a shared layer's later call runs where its inputs are, possibly at a later position) at the
  profiled batch (exact: elements x dtype size, so halved under mixed precision).
* `inputs`: positions producing what the calls at this position consume, -1 for a model input.
* `parameter_bytes`: the variables (trainable and not) used only at this position. A variable
  used at several positions (a layer called in several places, a variable shared by two layers
  such as a tied embedding) goes to the top-level `shared_parameters` instead: one entry per
  set of positions, `{"bytes": B, "positions": [...]}`, where the positions are the call
  positions of every call whose layer's `weights` hold the variable (identified by object, not
  by name). `planner.formats.profile` says how the planner counts them.

`compute_dtype` is the layers' compute dtype (`mixed_float16` gives float16), the dtype of the
activations the output bytes measure.

`model_signature` ties the profile, and plans made from it, to this model
(`dapple.checks.check_plan_matches_model`). `y` is not needed to profile layers (the
loss is not a layer); it is accepted so the call reads like Keras's and its rows are checked.
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from dapple.keras2 import require_keras2_model
from dapple.measure import MIN_BACKWARD_MS, median_ms
from graph_rewrite.keras_adapter import Keras3, keras_module_of, weights_of
from graph_rewrite.model_graph import (call_positions, layer_order, model_input_ids,
                                       model_signature, node_call_arguments, node_input_ids,
                                       node_layer, node_output_ids)
from planner.formats.profile import Layer, Profile, SharedParameters


def _nbytes(tensors) -> int:
    # tf.as_dtype: a Keras 3 variable's dtype is a name
    return int(sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
                   for t in tf.nest.flatten(tensors) if hasattr(t, "dtype")))


def _node_call(node, values: Dict[str, tf.Tensor]):
    """(args, kwargs) of a Keras node's call, its inputs looked up by tensor id."""
    return node_call_arguments(node, values, training=True)


def _time_node(node, args, kwargs, warmup: int, runs: int):
    layer = node_layer(node)
    float_inputs = [t for t in tf.nest.flatten((args, kwargs))
                    if isinstance(t, tf.Tensor) and t.dtype.is_floating]

    @tf.function
    def forward():
        return layer(*args, **kwargs)

    def forward_and_gradients(weights: bool):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                for t in float_inputs:
                    tape.watch(t)
                outputs = layer(*args, **kwargs)
            targets = [o for o in tf.nest.flatten(outputs) if o.dtype.is_floating]
            sources = float_inputs + (weights_of(layer, trainable_only=True) if weights else [])
            if not targets or not sources:
                return outputs
            return tape.gradient(targets, sources,
                                 output_gradients=[tf.ones_like(o) for o in targets],
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return run

    has_backward = bool(float_inputs or weights_of(layer, trainable_only=True))
    forward_ms = median_ms(forward, warmup, runs)
    if not has_backward:
        return forward_ms, 0.0, 0.0
    backward_ms = max(median_ms(forward_and_gradients(True), warmup, runs) - forward_ms,
                      MIN_BACKWARD_MS)
    # I: the input gradients alone (the weight products go unused and are pruned); W = B - I.
    input_ms = 0.0
    if float_inputs:
        input_ms = median_ms(forward_and_gradients(False), warmup, runs) - forward_ms
    return forward_ms, backward_ms, min(max(input_ms, 0.0), backward_ms)


def measure_profile(model: tf.keras.Model, x, name: Optional[str] = None, warmup: int = 2,
                    runs: int = 5) -> Profile:
    """The planner's `Profile` of `model`, measured on the batch `x`."""
    require_keras2_model(model, "dapple.profile", keras3_functional=Keras3.is_graph_model)
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    order = layer_order(model)
    xs = tf.nest.flatten(x)
    input_ids = model_input_ids(model)
    if len(xs) != len(input_ids):
        raise ValueError(f"model {model.name!r} has {len(input_ids)} inputs, got {len(xs)}")
    values = {tid: tf.cast(tf.convert_to_tensor(v), t.dtype)
              for tid, v, t in zip(input_ids, xs, model.inputs)}
    producer = {tid: -1 for tid in input_ids}
    batch = int(xs[0].shape[0])

    # Every layer gets its own tf.functions; TensorFlow's retracing warning does not apply.
    previous_level = tf.get_logger().level
    tf.get_logger().setLevel("ERROR")
    # Layers run in training mode here, and some move their state when they do
    # (BatchNormalization's moving statistics): profiling must leave the model as it was.
    state = [(v, v.numpy()) for v in model.non_trainable_variables]
    try:
        stats = _measure(model, order, values, producer, warmup, runs)
    finally:
        tf.get_logger().setLevel(previous_level)
        for v, value in state:
            v.assign(value)

    own_bytes, shared = parameter_bytes(model, len(order))
    device = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    threads = tf.config.threading.get_intra_op_parallelism_threads()
    layers = [Layer(name=layer.name, type=type(layer).__name__,
                    forward_ms=float(s["forward_ms"]), backward_ms=float(s["backward_ms"]),
                    input_gradient_ms=float(s["input_gradient_ms"]),
                    output_bytes=float(s["output_bytes"]), parameter_bytes=float(own_bytes[p]),
                    inputs=tuple(s["inputs"]))
              for p, (layer, s) in enumerate(zip(order, stats))]
    return Profile(name=name or model.name, batch_size=float(batch), layers=layers,
                   input_bytes=float(_nbytes([values[tid] for tid in input_ids])),
                   model_signature=model_signature(model),
                   device=f"{device[0].name} ({threads or 'default'} intra-op threads)",
                   shared_parameters=tuple(SharedParameters(float(b), tuple(g))
                                           for g, b in shared),
                   compute_dtype=_compute_dtype(model, order), source=f"dapple.profile({model.name})")


def _compute_dtype(model, order) -> str:
    """The compute dtype most of the layers run in (their mixed-precision policy), else the
    global policy's of the model's Keras."""
    dtypes = collections.Counter(l.compute_dtype for l in order
                                 if getattr(l, "compute_dtype", None))
    if not dtypes:
        api = keras_module_of(model) or tf.keras
        return api.mixed_precision.global_policy().compute_dtype or "float32"
    return dtypes.most_common(1)[0][0]


def _variable_key(v) -> int:
    """A variable's identity; a mixed-precision AutoCastVariable is its wrapped variable."""
    return id(getattr(v, "_variable", v))


def parameter_bytes(model: tf.keras.Model, num_positions: int):
    """(bytes of the variables used at each position alone, shared entries): every variable
    in the `weights` of a call's layer is used at that call's position."""
    used_at: Dict[int, set] = {}
    size: Dict[int, int] = {}
    for node, p in call_positions(model):
        for v in weights_of(node_layer(node)):
            key = _variable_key(v)
            used_at.setdefault(key, set()).add(p)
            size[key] = _nbytes([v])
    own = [0] * num_positions
    groups: Dict[tuple, int] = {}
    for key, positions in used_at.items():
        if len(positions) == 1:
            own[next(iter(positions))] += size[key]
        else:
            group = tuple(sorted(positions))
            groups[group] = groups.get(group, 0) + size[key]
    return own, sorted(groups.items())


def _measure(model, order, values, producer, warmup, runs) -> List[dict]:
    """Run the model call by call on concrete tensors, timing each call on its own inputs.
    Times go to the layer's position; outputs and inputs to the call's position."""
    position = {id(layer): p for p, layer in enumerate(order)}
    stats = [{"forward_ms": 0.0, "backward_ms": 0.0, "input_gradient_ms": 0.0,
              "output_bytes": 0, "inputs": []}
             for _ in order]
    for node, q in call_positions(model):
        args, kwargs = _node_call(node, values)
        outputs = node_layer(node)(*args, **kwargs)
        for tid, y in zip(node_output_ids(node), tf.nest.flatten(outputs)):
            values[tid] = y
        forward_ms, backward_ms, input_ms = _time_node(node, args, kwargs, warmup, runs)
        s = stats[position[id(node_layer(node))]]
        s["forward_ms"] += forward_ms
        s["backward_ms"] += backward_ms
        s["input_gradient_ms"] += input_ms
        s = stats[q]
        s["output_bytes"] += _nbytes(outputs)
        for tid in node_input_ids(node):
            src = producer[tid]
            if src != q and src not in s["inputs"]:
                s["inputs"].append(src)
        for tid in node_output_ids(node):
            producer[tid] = q
    return stats


def profile(model: tf.keras.Model, x, y=None, output: Optional[str] = None,
            name: Optional[str] = None, warmup: int = 2, runs: int = 5):
    """Profile `model` on the batch `x` (its rows are the profile's batch size).

    Returns the planner's `Profile`; writes the native JSON to `output` when given.
    """
    if y is not None:
        ny = int(tf.nest.flatten(y)[0].shape[0])
        nx = int(tf.nest.flatten(x)[0].shape[0])
        if ny != nx:
            raise ValueError(f"x has {nx} rows but y has {ny}")
    measured = measure_profile(model, x, name=name, warmup=warmup, runs=runs)
    if output:
        measured.save(output)
    return measured
