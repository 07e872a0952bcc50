"""Keras losses turned into per-micro-batch terms that sum to the plain model's loss.

Keras reduces a loss over the batch (`SUM_OVER_BATCH_SIZE`: the sum of the per-element losses
divided by their count). A micro-batch slice therefore contributes the sum of its per-element
losses divided by the element count of the WHOLE global batch; summing the terms of all slices
gives exactly the plain model's loss on the global batch, and so the same gradients.
`SUM` reduction contributes the plain sum. Per-output losses and `loss_weights` follow Keras's
`compile` conventions (single, list or dict by output name).

Sample weights multiply the per-element losses before the sum, broadcast as Keras broadcasts
them (`compute_weighted_loss`); the divisor stays the element count, as in Keras, not the sum of
the weights.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from graph_rewrite import keras_adapter


def _per_element_fn(loss) -> Tuple[Any, str]:
    if keras_adapter.is_keras3(loss):           # a Keras 3 `keras.losses.Loss`
        reduction = getattr(loss, "reduction", None)
        if reduction not in ("sum_over_batch_size", "sum") or not hasattr(loss, "call"):
            raise ValueError(f"cannot use {loss!r} (reduction {reduction!r}) as a loss yet: "
                             f"Keras 3 losses with sum_over_batch_size or sum reduction")
        return loss.call, "sum" if reduction == "sum" else "mean"
    # A Keras 2 loss object by its own Keras; a name or a function by Keras 2's `losses.get`
    # (the same per-element losses as Keras 3's), else by `tf.keras`'s.
    api = (keras_adapter.keras2_module_of(loss) or keras_adapter.keras2_api()
           or tf.keras)
    obj = api.losses.get(loss)
    if isinstance(obj, api.losses.Loss):
        reduction = obj.reduction
        mode = "sum" if reduction == "sum" else "mean"     # Keras 2's Reduction.SUM is "sum"
        return obj.call, mode
    if callable(obj):
        return obj, "mean"
    raise ValueError(f"cannot use {loss!r} as a loss")


class PipelineLoss:
    """Per-output loss functions, weights and reductions for a model's outputs."""

    def __init__(self, loss, output_names: Sequence[str], loss_weights=None):
        names = list(output_names)
        if loss is None:
            raise ValueError("compile() needs a loss")
        if isinstance(loss, dict):
            unknown = set(loss) - set(names)
            if unknown:
                raise ValueError(f"loss given for unknown outputs {sorted(unknown)}; the model's "
                                 f"outputs are {names}")
            losses = [loss.get(n) for n in names]
        elif isinstance(loss, (list, tuple)):
            if len(loss) != len(names):
                raise ValueError(f"{len(loss)} losses for {len(names)} model outputs {names}")
            losses = list(loss)
        else:
            losses = [loss] * len(names)
        if loss_weights is None:
            weights = [1.0] * len(names)
        elif isinstance(loss_weights, dict):
            weights = [float(loss_weights.get(n, 1.0)) for n in names]
        else:
            weights = [float(w) for w in loss_weights]
        self.terms: List[Tuple[Any, str, float] | None] = []
        for l, w in zip(losses, weights):
            self.terms.append(None if l is None else (*_per_element_fn(l), w))

    def micro_batch_term(self, y_true: Sequence[tf.Tensor], y_pred: Sequence[tf.Tensor],
                         rows: int, global_rows: int,
                         sample_weights: Optional[Sequence[Optional[tf.Tensor]]] = None
                         ) -> tf.Tensor:
        """This slice's share of the global-batch loss (a scalar); `sample_weights` has one
        entry (or None) per output, holding this slice's rows."""
        total = []
        weights = sample_weights or [None] * len(self.terms)
        for term, yt, yp, sw in zip(self.terms, y_true, y_pred, weights):
            if term is None:
                continue
            fn, mode, weight = term
            values = tf.cast(fn(yt, yp), tf.float32)
            if sw is not None:
                values = values * _broadcast_like_keras(tf.cast(sw, tf.float32), values)
            summed = tf.reduce_sum(values)
            if mode == "mean":
                # element count of the global batch = this slice's count * global_rows / rows
                count = tf.cast(tf.size(values), tf.float32) * (global_rows / rows)
                summed = summed / count
            total.append(weight * summed)
        return tf.add_n(total)


def _broadcast_like_keras(weights: tf.Tensor, losses: tf.Tensor) -> tf.Tensor:
    """Keras's `squeeze_or_expand_dimensions`: drop a trailing 1 the losses lack, or add one
    they have, then broadcast."""
    rank, want = weights.shape.rank, losses.shape.rank
    if rank == want + 1 and weights.shape[-1] == 1:
        weights = tf.squeeze(weights, axis=-1)
    elif rank == want - 1:
        weights = tf.expand_dims(weights, axis=-1)
    return weights


def per_output(sample_weight, outputs: int) -> List[Optional[tf.Tensor]]:
    """`sample_weight` (None, one tensor for every output, or one per output) as one per
    output."""
    if sample_weight is None:
        return [None] * outputs
    if isinstance(sample_weight, (list, tuple)):
        if len(sample_weight) != outputs:
            raise ValueError(f"{len(sample_weight)} sample weight arrays for {outputs} outputs")
        return list(sample_weight)
    return [sample_weight] * outputs


def weight_penalties_by_stage(stages) -> List[list]:
    """Each weight regularizer (Keras's callable losses) in the first stage that calls a layer
    holding it, so a layer shared by two stages is penalized once, as in Keras."""
    seen, out = set(), []
    for graph in stages:
        mine = []
        for layer in graph.called_layers:
            for key, c in keras_adapter.for_model(layer).weight_penalties(layer):
                if key not in seen:
                    seen.add(key)
                    mine.append(c)
        out.append(mine)
    return out
