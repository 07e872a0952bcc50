"""BatchNormalization's moving statistics, updated once per step from the whole global batch.

In a pipeline every (stage, replica, micro-batch) unit runs its BatchNormalization calls in
training mode, and each call normalizes with its own slice's statistics, as in GPipe and the
DAPPLE paper (plain Keras would use the global batch's; `dapple verify` compares with the plain
model run slice by slice). What must not change is the layer's *state*: plain `fit` moves
`moving_mean` and `moving_variance` once per step, towards the statistics of the whole batch.

So each unit records, for every BatchNormalization call it makes, the slice's row count, mean
and sum of squared deviations (`SliceStatistics`); the step combines them over micro-batches
and the stage's replicas (Chan et al.'s pairwise formula, exact for any split), and applies one
update with the layer's momentum: `moving = momentum * moving_before_step + (1 - momentum) *
value`, where value is the mean, and the variance with Keras's convention for that layer (in
tf_keras the fused kernel, used for 4-D and 5-D inputs on the channel axis, updates with the
unbiased variance, the non-fused path with the biased one; Keras 3 always with the biased
one). The step reads the variables before the first unit and assigns the combined update after
the last. What differs between the Keras versions (the layer class, its options, channel axes,
variance and moving-average formula) is asked of `graph_rewrite.keras_adapter`.

Keras's own update still runs inside every training call of the layer, but into scratch
variables of the unit's device (`ScratchStatistics`), not the layer's: a function call that
writes a variable is ordered after every earlier call that writes it (`tf.function`'s automatic
control dependencies), so writing the layer's own statistics would run every forward of the
step one after another, across devices too (docs/runtime.md shows the four lanes of a
replicated ResNet-50 running in turn).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import tensorflow as tf

from graph_rewrite.keras_adapter import for_model, layer_of


class UnsupportedLayerError(ValueError):
    """A layer whose training behaviour the pipelined step cannot reproduce; names it and why."""


def is_batch_normalization(layer) -> bool:
    """A BatchNormalization layer of either Keras (the adapter of the layer's Keras)."""
    return for_model(layer).is_batch_normalization(layer)


def check_batch_normalization(layer) -> None:
    """Refuse the BatchNormalization options whose training state depends on the batch in ways
    the combined update cannot reproduce."""
    if not is_batch_normalization(layer):
        return
    why = for_model(layer).batch_normalization_problem(layer)
    if why:
        raise UnsupportedLayerError(f"layer {layer.name!r} ({type(layer).__name__}) cannot be "
                                    f"pipelined: {why}")


def updates_in_training(layer, kwargs) -> bool:
    """Whether this call of a BatchNormalization layer moves its statistics (Keras: training
    mode, and a trainable layer; a frozen layer runs in inference mode)."""
    return is_batch_normalization(layer) and layer.trainable and kwargs.get("training") is True


@dataclass
class SliceStatistics:
    """Row count (static), per-channel mean and sum of squared deviations of some rows."""
    count: int
    mean: tf.Tensor
    m2: tf.Tensor


def slice_statistics(layer, inputs: tf.Tensor) -> SliceStatistics:
    """What one call of `layer` on `inputs` contributes: reduced over every axis but the
    layer's channel axes, in float32."""
    # Moving statistics are not differentiated (as in Keras); without a path back, a traced
    # stage's backward does not depend on them.
    x = tf.cast(tf.stop_gradient(inputs), tf.float32)
    channels = for_model(layer).normalization_axes(layer, x.shape.rank)
    axes = [i for i in range(x.shape.rank) if i not in channels]
    count = 1
    for i in axes:
        if x.shape[i] is None:
            raise UnsupportedLayerError(
                f"layer {layer.name!r} normalizes over axis {i} of unknown size; give the "
                f"model's inputs static shapes")
        count *= int(x.shape[i])
    mean = tf.reduce_mean(x, axis=axes)
    shape = [1 if i in axes else x.shape[i] for i in range(x.shape.rank)]
    m2 = tf.reduce_sum(tf.square(x - tf.reshape(mean, shape)), axis=axes)
    return SliceStatistics(count, mean, m2)


def combine(parts: Sequence[SliceStatistics]) -> SliceStatistics:
    """The statistics of the union of disjoint row sets, all K at once (the K-group form of
    Chan, Golub and LeVeque): mean = sum n_k mean_k / N, m2 = sum m2_k + sum n_k (mean_k -
    mean)^2. A few ops per call however many parts (one part per micro-batch)."""
    if len(parts) == 1:
        return parts[0]
    n = sum(p.count for p in parts)
    weights = tf.constant([p.count / n for p in parts], tf.float32)
    means = tf.stack([p.mean for p in parts])                 # [K, channels]
    shape = [-1] + [1] * (means.shape.rank - 1)
    mean = tf.reduce_sum(means * tf.reshape(weights, shape), axis=0)
    counts = tf.reshape(tf.constant([float(p.count) for p in parts]), shape)
    m2 = tf.add_n([p.m2 for p in parts]) + tf.reduce_sum(
        counts * tf.square(means - mean), axis=0)
    return SliceStatistics(n, mean, m2)


def joined(parts: Sequence[tf.Tensor]) -> tf.Tensor:
    """Statistics of several calls as one vector, end to end (a loop writes each forward's
    as one row, whatever the layers)."""
    return tf.concat([t if t.shape.rank == 1 else tf.reshape(t, [-1]) for t in parts], 0)


def combine_stacked(count, means: tf.Tensor, m2s: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(mean, m2) of K parts of equal row counts, their means and m2s stacked on axis 0
    (`combine` for equal parts). `count`: rows of one part, a number or a tensor that
    broadcasts against one part's mean (calls of different sizes side by side)."""
    mean = tf.reduce_mean(means, axis=0)
    return mean, tf.reduce_sum(m2s, axis=0) + count * tf.reduce_sum(tf.square(means - mean), 0)


class CallCombiner:
    """`combine` for every BatchNormalization call of a unit in one non-inlined function call:
    op by op, combining ResNet-50's 53 calls put ~17 ops per call and replica into the step's
    graph. Traced once per signature (shapes and row counts), run on the call site's device."""

    def __init__(self):
        self._function = tf.function(self._combine_all,
                                     experimental_attributes={"_noinline": True})

    def __call__(self, parts_by_call: Sequence[Sequence[SliceStatistics]]
                 ) -> List[SliceStatistics]:
        if all(len(parts) == 1 for parts in parts_by_call):
            return [parts[0] for parts in parts_by_call]
        counts = tuple(tuple(p.count for p in parts) for parts in parts_by_call)
        means, m2s = self._function([[p.mean for p in parts] for parts in parts_by_call],
                                    [[p.m2 for p in parts] for parts in parts_by_call], counts)
        return [SliceStatistics(sum(c), mean, m2) for c, mean, m2 in zip(counts, means, m2s)]

    @staticmethod
    def _combine_all(means, m2s, counts):
        out = [combine([SliceStatistics(n, mean, m2) for n, mean, m2 in zip(c, ms, vs)])
               for c, ms, vs in zip(counts, means, m2s)]
        return [s.mean for s in out], [s.m2 for s in out]


def combine_replicas(by_replica: Dict[int, List[SliceStatistics]], replicas: int,
                     sum_over_replicas: Callable[[Dict[int, List[tf.Tensor]], str],
                                                 List[tf.Tensor]]
                     ) -> List[SliceStatistics]:
    """Statistics over all `replicas` replicas of a stage, from those of the replicas held here
    (`by_replica`: one entry per call, equal counts across replicas). `sum_over_replicas(lists,
    tag)` adds lists of tensors elementwise across all replicas (an add locally, an allreduce
    named by `tag` in the stage's process set across processes)."""
    if replicas == 1:
        return next(iter(by_replica.values()))
    means = sum_over_replicas({r: [s.mean for s in stats] for r, stats in by_replica.items()},
                              "bnmean")
    means = [m / replicas for m in means]
    spread = sum_over_replicas({r: [s.m2 + s.count * tf.square(s.mean - m)
                                    for s, m in zip(stats, means)]
                                for r, stats in by_replica.items()}, "bnspread")
    first = next(iter(by_replica.values()))
    return [SliceStatistics(s.count * replicas, m, v) for s, m, v in zip(first, means, spread)]


def moving_update(layer, stats: SliceStatistics, before_mean: tf.Tensor,
                  before_variance: tf.Tensor):
    """Assign the layer's moving statistics one Keras update from `before_*` with `stats`
    (the batch variance and moving-average formula of the layer's Keras); returns the new
    (mean, variance)."""
    keras = for_model(layer)
    variance = keras.batch_variance(layer, stats.count, stats.m2)
    new = []
    for var, before, value in ((layer.moving_mean, before_mean, stats.mean),
                               (layer.moving_variance, before_variance, variance)):
        updated = keras.moving_average(layer, before, tf.cast(value, var.dtype))
        var.assign(updated)
        new.append(updated)
    return tuple(new)


class StatisticsRecorder:
    """Collects the statistics of one unit's BatchNormalization calls, by call (node)."""

    def __init__(self):
        self.by_node: Dict[int, List[SliceStatistics]] = {}    # id(node) -> per call

    def __call__(self, node, args, kwargs) -> None:
        layer = layer_of(node)
        if not updates_in_training(layer, kwargs):
            return
        inputs = args[0] if args else kwargs["inputs"]
        if getattr(inputs, "_keras_mask", None) is not None and not getattr(layer, "fused", False):
            raise UnsupportedLayerError(
                f"layer {layer.name!r} normalizes a masked tensor; masked moving statistics are "
                f"not combined across micro-batches")
        self.by_node.setdefault(id(node), []).append(slice_statistics(layer, inputs))


def normalization_layers(nodes) -> List:
    """The BatchNormalization layers that `nodes` call, once each, in call order."""
    seen, out = set(), []
    for node in nodes:
        layer = layer_of(node)
        if is_batch_normalization(layer) and id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out


class ScratchStatistics:
    """Per device, a pair of variables shaped like each layer's moving statistics, for Keras's
    per-call updates to write instead of the layer's own (see the module's docstring)."""

    def __init__(self, layers: Sequence):
        self.layers = list(layers)
        self._by_device: Dict[str, List[tf.Variable]] = {}

    def make(self, device: str) -> None:
        """Create `device`'s pairs (eagerly: a `tf.function` that creates variables traces
        twice)."""
        if device in self._by_device or not self.layers:
            return
        with tf.init_scope(), tf.device(device):
            self._by_device[device] = [
                tf.Variable(tf.zeros_like(v), trainable=False, name="dapple_scratch")
                for layer in self.layers for v in (layer.moving_mean, layer.moving_variance)]

    def on(self, device: str) -> List[tf.Variable]:
        return self._by_device.get(device, [])

    @contextlib.contextmanager
    def redirect(self, scratch: Sequence[tf.Variable], nodes, training: bool):
        """While tracing a stage's calls (`nodes`, in training if `training`): the
        `moving_mean` and `moving_variance` of every layer whose calls all update are
        `scratch`'s pairs (a frozen layer, or a call fixed to inference, reads its own). Set
        past Keras's attribute tracking, so the layers' weights and checkpoints never see
        them, and put back on exit."""
        saved = [(layer, layer.moving_mean, layer.moving_variance) for layer in self.layers]
        try:
            for i, layer in enumerate(self.layers if scratch and training is True else ()):
                fixed = [for_model(layer).fixed_training(n) for n in nodes
                         if layer_of(n) is layer]
                if layer.trainable and all(f is None or f is True for f in fixed):
                    object.__setattr__(layer, "moving_mean", scratch[2 * i])
                    object.__setattr__(layer, "moving_variance", scratch[2 * i + 1])
            yield
        finally:
            for layer, mean, variance in saved:
                object.__setattr__(layer, "moving_mean", mean)
                object.__setattr__(layer, "moving_variance", variance)


def read_moving_statistics(stages, units) -> Dict[int, Tuple[tf.Tensor, tf.Tensor]]:
    """The moving statistics of the BatchNormalization layers of `units`' stages before any
    unit runs."""
    return {id(layer): (tf.identity(layer.moving_mean), tf.identity(layer.moving_variance))
            for layer in normalization_layers(
                [n for s in sorted({s for s, _ in units}) for n in stages[s].nodes])}


def update_moving_statistics(stages, replicas: Sequence[int], recorders, moving_before,
                             sum_replicas, device, combine_calls: CallCombiner) -> None:
    """One Keras update per BatchNormalization call from the global batch's statistics:
    `recorders` by (stage, replica), `sum_replicas(stage, lists, tag=...)` sums over a stage's
    replicas, `device(stage, replica)` places the update."""
    current = dict(moving_before)
    for stage, graph in enumerate(stages):
        mine = {r: recorders[(stage, r)] for r in range(replicas[stage])
                if (stage, r) in recorders}
        if not mine:
            continue
        calls = [n for n in graph.nodes if any(id(n) in rec.by_node for rec in mine.values())]
        if not calls:
            continue
        by_replica = {}
        for r, rec in mine.items():
            with tf.device(device(stage, r)):
                by_replica[r] = combine_calls([rec.by_node[id(n)] for n in calls])
        combined = combine_replicas(by_replica, replicas[stage],
                                    lambda lists, tag: sum_replicas(stage, lists, tag=tag))
        with tf.device(device(stage, min(mine))), tf.name_scope(f"stage{stage}/bn"):
            for node, stats in zip(calls, combined):
                layer = layer_of(node)
                current[id(layer)] = moving_update(layer, stats, *current[id(layer)])
