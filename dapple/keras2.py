"""dapple runs Keras 2 models: `tf.keras` is made the Keras 2 API; Keras 3 models are refused
except by the entry points with a Keras 3 path (`PipelinedModel`: functional models, see
docs/keras3.md).

From TensorFlow 2.16 on, `tf.keras` is Keras 3 unless the environment variable
`TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported and the `tf_keras` package (Keras 2,
same minor version as TensorFlow) is installed; `import keras` is Keras 3 either way. dapple's
rewriter cuts Keras 2's layer graph, so:

- `select_before_tensorflow()`, called by `import dapple` before anything of TensorFlow loads,
  sets `TF_USE_LEGACY_KERAS=1` when `tf_keras` is installed (child processes, such as
  horovodrun's ranks, inherit it);
- `check_tf_keras()`, called once TensorFlow is loaded, fails with what to do when `tf.keras`
  is Keras 3 all the same: TensorFlow imported first without that variable, or no `tf_keras`;
- `require_keras2_model(model, where)` refuses a Keras 3 model with its Keras version and the
  one-line change (`keras3_functional=`: those Keras 3 models it accepts).

TensorFlow 2.15 has Keras 2 built in (`tf.keras` is `keras` 2.15), but reads the variable too:
set without `tf_keras` installed, its `tf.keras` fails to load. Hence "when `tf_keras` is
installed".
"""
from __future__ import annotations

import importlib.util
import os
import sys

ENV = "TF_USE_LEGACY_KERAS"

ONE_LINE_FIX = ("replace `import keras` with `import tf_keras as keras` (or use `tf.keras` "
                "after `import dapple`)")


class Keras2Error(ImportError):
    """TensorFlow's `tf.keras` is not Keras 2 and dapple cannot make it so."""


def _has_tf_keras() -> bool:
    return importlib.util.find_spec("tf_keras") is not None


def select_before_tensorflow() -> None:
    """Point `tf.keras` at tf_keras (Keras 2) if it is installed and TensorFlow not loaded yet."""
    if "tensorflow" not in sys.modules and _has_tf_keras():
        os.environ[ENV] = "1"


def _tf_keras_major(tf) -> int:
    """2 for Keras 2 behind `tf.keras` (tf_keras, or TF 2.15's keras); 3 for Keras 3."""
    root = tf.keras.Model.__module__.split(".")[0]
    return int(getattr(sys.modules[root], "__version__", "2").split(".")[0])


def check_tf_keras() -> None:
    """Raise Keras2Error unless `tf.keras` is Keras 2 (TensorFlow must be importable)."""
    import tensorflow as tf

    major_minor = ".".join(tf.__version__.split(".")[:2])
    try:
        major = _tf_keras_major(tf)
    except ImportError as e:   # TF_USE_LEGACY_KERAS=1 without tf_keras installed
        raise Keras2Error(
            f"dapple needs Keras 2 with TensorFlow {tf.__version__}: pip install "
            f"'tf_keras=={major_minor}.*' ({e})") from None
    if major >= 3 and not _has_tf_keras():
        raise Keras2Error(
            f"tf.keras is Keras 3 here, and dapple needs Keras 2: with TensorFlow "
            f"{tf.__version__} that is the tf_keras package, not installed. pip install "
            f"'tf_keras=={major_minor}.*'")
    if major >= 3:
        raise Keras2Error(
            f"tf.keras is Keras 3 here: TensorFlow {tf.__version__} was imported before dapple "
            f"without {ENV}=1, and dapple needs Keras 2. Put `import dapple` before "
            f"`import tensorflow`, or set {ENV}=1 in the environment")


def keras_of(obj):
    """(package, version) of the Keras that defines obj's class, e.g. ('keras', '3.5.0');
    None when no Keras package defines it."""
    for cls in type(obj).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if root in ("keras", "tf_keras"):
            return root, str(getattr(sys.modules.get(root), "__version__", "unknown"))
    return None


def require_keras2_model(model, where: str, keras3_functional=None) -> None:
    """Refuse, with one clear message, a model that is not a `tf.keras` (Keras 2) model.

    `where` names the entry point (`PipelinedModel`, `dapple.profile`, `--model=m:build`);
    `keras3_functional(model)`, when given, accepts the Keras 3 models it is true for (the
    entry points that have a Keras 3 path: docs/keras3.md)."""
    import tensorflow as tf

    if isinstance(model, tf.keras.Model):
        _refuse_other_keras_inside(model, where)
        return
    found = keras_of(model)
    if found and not found[1].startswith(("1.", "2.")):          # Keras 3
        name = getattr(model, "name", "")
        if keras3_functional is None:
            raise TypeError(
                f"{where}: the model {name!r} is a Keras {found[1]} model (`import keras`), and "
                f"dapple pipelines Keras 2 models. One-line fix: {ONE_LINE_FIX}")
        if keras3_functional(model):
            return
        raise TypeError(
            f"{where}: the model {name!r} is a Keras {found[1]} model (`import keras`) of type "
            f"{type(model).__name__}, and dapple pipelines Keras 2 models and, so far, Keras 3 "
            f"functional models (keras.Model(inputs, outputs)) and built Sequential ones; "
            f"docs/keras3.md. One-line fix: {ONE_LINE_FIX}")
    raise TypeError(f"{where}: dapple needs a tf.keras.Model (Keras 2), got "
                    f"{type(model).__module__}.{type(model).__name__}")


def _refuse_other_keras_inside(model, where: str) -> None:
    """A Keras 3 layer called inside a Keras 2 model is traced into TensorFlow-op layers that
    capture its variables untracked: those weights would never train. Refuse it by name."""
    own = keras_of(model)
    for layer in model.submodules:
        found = keras_of(layer)
        if found and own and found[0] != own[0]:
            raise TypeError(f"{where}: layer {layer.name!r} of model {model.name!r} is a "
                            f"{found[0]} {found[1]} layer inside a {own[0]} model; build every "
                            f"layer with one Keras ({own[0]})")
        for node in getattr(layer, "_inbound_nodes", []):
            for arg in _flat_arguments(node):
                found = keras_of(arg)
                if found and own and found[0] != own[0]:
                    owner = str(getattr(arg, "path", None) or getattr(arg, "name", "?"))
                    raise TypeError(
                        f"{where}: model {model.name!r} computes with {found[0]} {found[1]}'s "
                        f"variable {owner!r} (in its layer {layer.name!r}): a {found[0]} layer "
                        f"({owner.split('/')[0]!r}) was called inside this {own[0]} model, and "
                        f"its weights would never train. Build every layer with one Keras "
                        f"({own[0]}: `tf.keras.layers` after `import dapple`)")


def _flat_arguments(node) -> list:
    import tensorflow as tf

    try:
        return tf.nest.flatten((node.call_args, node.call_kwargs))
    except (AttributeError, TypeError, ValueError):
        return []
