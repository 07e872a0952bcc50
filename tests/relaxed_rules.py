"""The relaxed schedules' update rules, written out on the plain, unpipelined Keras model with
plain SGD (no momentum): the references of tests/dapple/test_relaxed_schedules.py and of the
multi-process script. Nothing here calls dapple: each rule is taken from its paper.

Weights are lists of numpy arrays in `model.trainable_variables` order; a gradient "at" some
weights is the plain model's, with its variables set to them. `batches` are (x, y) pairs.
"""
from typing import List, Sequence

import numpy as np
import tensorflow as tf


def _gradient_at(model, loss, weights, x, y) -> List[np.ndarray]:
    for v, w in zip(model.trainable_variables, weights):
        v.assign(w)
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
        if model.losses:                  # weight penalties, as Keras's compiled loss adds them
            value = value + tf.add_n(model.losses)
    return [g.numpy() for g in tape.gradient(value, model.trainable_variables)]


def _sgd(weights, gradient, lr):
    return [w - lr * g for w, g in zip(weights, gradient)]


def initial(model) -> List[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables]


def synchronous(model, loss, batches, lr) -> List[np.ndarray]:
    """Plain SGD, one step per batch: W(t+1) = W(t) - lr grad f_t(W(t))."""
    w = initial(model)
    for x, y in batches:
        w = _sgd(w, _gradient_at(model, loss, w, x, y), lr)
    return w


def two_bw(model, loss, batches, lr) -> List[np.ndarray]:
    """PipeDream-2BW (Narayanan's dissertation §3.2.1): W(t+1) = W(t) - lr grad f_t(W(t-1)),
    W(-1) = W(0)."""
    history = [initial(model)]
    for t, (x, y) in enumerate(batches):
        g = _gradient_at(model, loss, history[max(t - 1, 0)], x, y)
        history.append(_sgd(history[t], g, lr))
    return history[-1]


def pipedream(model, loss, minibatches, lr, stage_of: Sequence[int], depths: Sequence[int],
              vertical_sync: bool = False) -> List[np.ndarray]:
    """PipeDream with weight stashing (SOSP'19 §3.3): a minibatch (here a micro-batch) j runs
    stage s on the version made by the stage's first max(j - K_s + 1, 0) updates (K_s its
    warm-up depth; vertical sync: stage 0's count on every stage), and update j of every stage
    applies minibatch j's gradient (its mean loss) there:
    W(t+1) = W(t) - lr grad f(W_1(t-K_1+1), ..., W_S(t-K_S+1)). `stage_of`: the stage of each
    trainable variable."""
    S = len(depths)
    versions = [initial(model)]              # versions[u][k]: variable k after u updates
    for j, (x, y) in enumerate(minibatches):
        read = [max(j - (depths[0] if vertical_sync else depths[s]) + 1, 0) for s in range(S)]
        mixed = [versions[read[stage_of[k]]][k] for k in range(len(stage_of))]
        g = _gradient_at(model, loss, mixed, x, y)
        versions.append(_sgd(versions[j], g, lr))
    return versions[-1]


def avgpipe(model, loss, steps, lr):
    """AvgPipe's elastic averaging (PPoPP'23 §3.2, as the issue reads it): each step, pipeline
    i takes its own batch, Delta_i = -lr grad f_i(w_i), w_i <- (1 - a) w_i + a z + Delta_i with
    z from before the step, z <- z + (1/N) sum_i Delta_i, a = 1/N. `steps`: per step, the N
    pipelines' batches. Returns (z, [w_i])."""
    N = len(steps[0])
    a = 1.0 / N
    z = initial(model)
    w = [list(z) for _ in range(N)]
    for batches in steps:
        deltas = []
        for i, (x, y) in enumerate(batches):
            delta = [-lr * g for g in _gradient_at(model, loss, w[i], x, y)]
            deltas.append(delta)
            w[i] = [(1 - a) * wi + a * zi + d for wi, zi, d in zip(w[i], z, delta)]
        z = [zk + sum(d[k] for d in deltas) / N for k, zk in enumerate(z)]
    return z, w


def data_parallel(model, loss, steps, lr) -> List[np.ndarray]:
    """Synchronous data parallelism over the same steps: W <- W - lr mean_i grad f_i(W)."""
    w = initial(model)
    for batches in steps:
        grads = [_gradient_at(model, loss, w, x, y) for x, y in batches]
        w = [wk - lr * sum(g[k] for g in grads) / len(grads) for k, wk in enumerate(w)]
    return w


def stage_of_variables(model, stage_layers: Sequence[Sequence[str]]) -> List[int]:
    """The stage of each trainable variable, from the layer names of each stage."""
    stage = {name: s for s, names in enumerate(stage_layers) for name in names}
    # tf_keras names a variable "d1/kernel:0", Keras 3 paths it "d1/kernel"
    return [stage[(getattr(v, "path", None) or v.name).split("/")[0]]
            for v in model.trainable_variables]


def max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))
