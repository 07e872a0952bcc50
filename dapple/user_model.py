"""A user's model named on the command line (`--model=module:builder`) and random data for it.

`dapple profile` and `dapple verify` build the model by calling `builder()` (keyword arguments
may be given as JSON with `--model_args`), and feed it random data of its input shapes:
normal floats for float inputs, integers for int inputs, in [0, the smallest `input_dim` of the
Embedding layers that read them) so embeddings stay in range (otherwise [0, 2)).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Optional

import numpy as np
import tensorflow as tf

from dapple.keras2 import require_keras2_model


def load_builder(spec: str):
    """`package.module:function` -> the function."""
    if not spec or ":" not in spec:
        raise ValueError(f"--model must be module:builder (e.g. examples.vgg19:build), got "
                         f"{spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())   # a console script does not put the cwd on the path
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"--model={spec}: cannot import {module_name!r} ({e}); run from the "
                         f"directory that contains it or install it") from None
    builder = getattr(module, attr, None)
    if not callable(builder):
        raise ValueError(f"--model={spec}: {module_name!r} has no function {attr!r}")
    return builder


def build_model(spec: str, model_args: Optional[str] = None) -> tf.keras.Model:
    kwargs = json.loads(model_args) if model_args else {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"--model_args must be a JSON object, got {model_args!r}")
    model = load_builder(spec)(**kwargs)
    try:
        require_keras2_model(model, f"--model={spec}")
    except TypeError as e:
        raise ValueError(str(e)) from None
    return model


def _int_high(model: tf.keras.Model, keras_input) -> int:
    highs = []
    for layer in model.layers:
        if type(layer).__name__ == "Embedding" and hasattr(layer, "input_dim"):   # either Keras
            for node in layer._inbound_nodes:       # Keras 2's keras_inputs, Keras 3's input_tensors
                inputs = getattr(node, "keras_inputs", None) or getattr(node, "input_tensors", ())
                if any(t is keras_input for t in tf.nest.flatten(inputs)):
                    highs.append(layer.input_dim)
    return min(highs) if highs else 2


def random_inputs(model: tf.keras.Model, batch: int, seed: int = 0):
    """Random inputs of the model's input shapes and dtypes, nested like `model.input`."""
    rng = np.random.RandomState(seed)
    arrays = []
    for t in model.inputs:
        shape = [batch] + [d if d is not None else 8 for d in t.shape[1:]]
        dtype = tf.as_dtype(t.dtype)             # Keras 3 names it ("int32")
        if dtype.is_integer:
            arrays.append(rng.randint(0, _int_high(model, t), size=shape).astype(dtype.as_numpy_dtype))
        else:
            arrays.append(rng.randn(*shape).astype(dtype.as_numpy_dtype))
    return tf.nest.pack_sequence_as(model.input, arrays) if isinstance(model.input, dict) \
        else (arrays[0] if len(arrays) == 1 else arrays)


def random_targets(model: tf.keras.Model, batch: int, seed: int = 1):
    """Random float targets of the model's output shapes (for a mean squared error)."""
    rng = np.random.RandomState(seed)
    ys = [rng.randn(batch, *[d if d is not None else 8 for d in t.shape[1:]]).astype("float32")
          for t in model.outputs]
    return ys[0] if len(ys) == 1 else ys
