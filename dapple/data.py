"""Keras's data conventions for `PipelinedModel`: global batches of arrays or datasets, batch
sizes, validation data, class weights, padded prediction batches."""
from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf


def rows(x) -> int:
    first = tf.nest.flatten(x)[0]
    n = first.shape[0]
    if n is None:
        raise ValueError("the global batch size must be static; batch datasets with "
                         "drop_remainder=True")
    return int(n)


def dataset_batch_rows(ds, model, global_batch, what: str):
    """The rows of `ds`'s batches as its element spec states them (None: not a dataset, or a
    scalar first input); raises what to change when it is unbatched or of unknown size."""
    if not isinstance(ds, tf.data.Dataset):
        return None
    spec = ds.element_spec
    first = tf.nest.flatten(spec[0] if isinstance(spec, tuple) else spec)[0]
    model_input = model.inputs[0]      # flatten(model.input)[0]; a Keras 3 Sequential has no .input
    fix = f".batch({global_batch or 'global_batch_size'}, drop_remainder=True)"
    # len(): Keras 3's KerasTensor shape is a tuple, Keras 2's a TensorShape of known rank
    if first.shape.rank is not None and first.shape.rank == len(model_input.shape) - 1:
        raise ValueError(f"{what} is not batched: its elements have shape {first.shape}, the "
                         f"model's input {model_input.shape}. Batch it with {fix}")
    if not first.shape.rank:
        return None
    if first.shape[0] is None:
        raise ValueError(f"{what} yields batches of unknown size, so a last partial batch would "
                         f"fail only when reached: batch it with {fix}")
    return int(first.shape[0])


def check_whole_batches(n: int, global_batch, what: str) -> None:
    """`n` rows that evaluation runs in whole global batches."""
    if global_batch and (n < global_batch or n % global_batch):
        raise ValueError(
            f"{what} has {n} rows, and evaluation runs whole global batches of {global_batch} "
            f"(the plan's global_batch_size): pass a multiple of {global_batch} rows"
            + (f", e.g. the first {n - n % global_batch}" if n >= global_batch else ""))


def unpack_validation_data(data):
    """(x, y, sample_weight) from Keras's forms of `validation_data`."""
    if isinstance(data, tf.data.Dataset):
        return data, None, None
    if isinstance(data, (tuple, list)) and len(data) in (2, 3):
        return tuple(data) + (None,) * (3 - len(data))
    raise ValueError("validation_data must be (x_val, y_val), (x_val, y_val, sample_weight) or "
                     "a tf.data.Dataset of (x, y[, sample_weight])")


def class_weight_fn(class_weight: dict):
    """Keras's class weighting of a batched dataset: each row's weight is its class's (the
    label, or its argmax when one-hot), times its sample weight when there is one."""
    keys = sorted(class_weight)
    if keys != list(range(len(keys))):
        raise ValueError(f"class_weight must map every class id 0..{len(keys) - 1} to a weight, "
                         f"got keys {keys}")
    table = tf.constant([float(class_weight[k]) for k in keys])

    def apply(*batch):
        x, y, sw = (tuple(batch) + (None, None))[:3]
        if y is None or isinstance(y, (tuple, list, dict)):
            raise ValueError("class_weight needs a model with a single output and labels")
        if y.shape.rank is not None and y.shape.rank > 2:
            raise ValueError("class_weight is not supported for 3+ dimensional targets")
        if y.shape.rank == 2 and y.shape[1] is not None and y.shape[1] > 1:
            classes = tf.argmax(y, axis=1)
        else:
            classes = tf.cast(tf.reshape(y, [-1]), tf.int64)
        cw = tf.gather(table, classes)
        if sw is not None:
            sw = tf.cast(sw, cw.dtype)
            cw = cw * (tf.reshape(sw, [-1]) if sw.shape.rank == 2 and sw.shape[1] == 1 else sw)
        return x, y, cw
    return apply


def padded_batches(x, batch_size: int):
    """(batch, valid rows) over numpy-like `x` (or a nest of them), the last batch padded."""
    flat = [np.asarray(a) for a in tf.nest.flatten(x)]
    n = len(flat[0])
    for lo in range(0, n, batch_size):
        hi = min(lo + batch_size, n)
        parts = []
        for a in flat:
            part = a[lo:hi]
            if hi - lo < batch_size:
                pad = np.repeat(part[-1:], batch_size - (hi - lo), axis=0)
                part = np.concatenate([part, pad])
            parts.append(part)
        yield tf.nest.pack_sequence_as(x, parts), hi - lo


def global_batches(x, y, batch_size, shuffle: bool, what: str, sample_weight=None,
                   class_weight=None, seed=None):
    """(x, y[, sample_weight]) batches of `batch_size` (the plan's global batch); a
    tf.data.Dataset is used as given. `class_weight` becomes (or multiplies) the sample
    weights, as in Keras. `seed`: the shuffle's (None: a fresh one)."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("pass labels and sample weights inside the tf.data.Dataset "
                             "(x, y, sample_weight), not as arguments")
        if batch_size is not None:
            raise ValueError("do not pass batch_size with a tf.data.Dataset: batch the "
                             "dataset itself (drop_remainder=True) with the plan's "
                             "global_batch_size")
        return x.map(class_weight_fn(class_weight)) if class_weight else x
    # tf.data would stack a list into one tensor; Keras reads a list as one array per
    # input/output, which is what a tuple means to tf.data.
    x, y, sample_weight = (tuple(a) if isinstance(a, list) else a
                           for a in (x, y, sample_weight))
    n = rows(x)
    if n % batch_size:
        if what == "fit":
            logging.warning("fit: %d rows are not a multiple of the global batch %d; the "
                            "last %d rows of each epoch are left out", n, batch_size,
                            n % batch_size)
        else:
            raise ValueError(f"{what}: {n} rows are not a multiple of the plan's global "
                             f"batch {batch_size}; every pipelined step needs a full global "
                             f"batch: pass a multiple of {batch_size} rows")
    if sample_weight is not None and y is None:
        raise ValueError("sample_weight needs labels y")
    elements = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
    ds = tf.data.Dataset.from_tensor_slices(elements)
    if shuffle:
        ds = ds.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(class_weight_fn(class_weight)) if class_weight else ds
