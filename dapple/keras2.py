"""Which Keras a model is, whatever `tf.keras` is; one error for what dapple cannot take.

From TensorFlow 2.16 on, `tf.keras` is Keras 3 unless the environment variable
`TF_USE_LEGACY_KERAS=1` is set before TensorFlow is imported and the `tf_keras` package (Keras 2,
same minor version as TensorFlow) is installed; `import keras` is Keras 3 either way, and
`import tf_keras` is Keras 2 either way. dapple takes models of both (Keras 3 through
`graph_rewrite.keras_adapter.Keras3`: docs/keras3.md) and `import dapple` sets nothing: it may
come before or after `import tensorflow`, and `tf.keras` is what TensorFlow makes it (only the
`dapple` command's demo, verify and profile opt into tf_keras for their own process,
`dapple/__init__.py`). dapple's Keras 2
code names the model's own Keras (`keras_adapter.keras2_module_of`, `keras2_api`), never
`tf.keras`. So:

- `require_keras2_model(model, where)` refuses what is not a Keras model, and a Keras 3 model
  without a layer graph, with its Keras version and the one-line change (`keras3_functional=`:
  those Keras 3 models an entry point accepts);
- `refuse_mixed_keras(model, where, role, objects)` refuses an optimizer, loss, metric or
  callback of the other Keras than the model's, naming both (a mixed setup: a tf_keras model
  with `keras.optimizers.SGD`, say);
- a Keras 3 layer called inside a Keras 2 model is refused by name (`_refuse_other_keras_inside`).
"""
from __future__ import annotations

import sys

ENV = "TF_USE_LEGACY_KERAS"

ONE_LINE_FIX = "replace `import keras` with `import tf_keras as keras`"


def keras_of(obj):
    """(package, version) of the Keras that defines obj's class, e.g. ('keras', '3.5.0');
    None when no Keras package defines it."""
    for cls in type(obj).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if root in ("keras", "tf_keras"):
            return root, str(getattr(sys.modules.get(root), "__version__", "unknown"))
    return None


def require_keras2_model(model, where: str, keras3_functional=None) -> None:
    """Refuse, with one clear message, a model that is not a Keras 2 model (tf_keras, or
    TensorFlow 2.15's keras) nor a Keras 3 model `keras3_functional` accepts.

    `where` names the entry point (`PipelinedModel`, `dapple.profile`, `--model=m:build`);
    `keras3_functional(model)`, when given, accepts the Keras 3 models it is true for (the
    entry points that have a Keras 3 path: docs/keras3.md)."""
    from graph_rewrite.keras_adapter import keras2_module_of

    api = keras2_module_of(model)
    if api is not None and isinstance(model, api.Model):
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
    raise TypeError(f"{where}: dapple needs a Keras model (keras.Model, or tf_keras.Model for "
                    f"Keras 2), got {type(model).__module__}.{type(model).__name__}")


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
                        f"({own[0]}.layers)")


def _family(found) -> str:
    """'Keras 3' or 'Keras 2' for keras_of's (package, version)."""
    return "Keras 2" if found[1].startswith(("1.", "2.")) else "Keras 3"


def _describe(obj, found) -> str:
    return f"{found[0]} {found[1]}'s {type(obj).__name__} ({_family(found)})"


def refuse_mixed_keras(model, where: str, role: str, objects) -> None:
    """Raise TypeError when any of `objects` (an optimizer, a loss, metrics, callbacks: nested
    lists and dicts; names and plain functions pass) is of the other Keras than `model`, with
    both named: "the model 'm' is tf_keras 2.18.0's Functional (Keras 2), the optimizer is
    keras 3.15.1's SGD (Keras 3)". Such a mix fails deep inside Keras, or silently trains
    nothing (each Keras tracks only its own variables)."""
    import tensorflow as tf

    own = keras_of(model)
    if own is None:
        return
    try:
        items = tf.nest.flatten(objects)
    except (TypeError, ValueError):
        items = [objects]
    for obj in items:
        found = keras_of(obj)
        if found is None or (found[0], _family(found)) == (own[0], _family(own)):
            continue
        raise TypeError(
            f"{where}: the model {getattr(model, 'name', '')!r} is {_describe(model, own)}, "
            f"the {role} is {_describe(obj, found)}: a mixed setup. Give it the model's Keras "
            f"(`{own[0]}.{_ROLE_MODULE.get(role, role)}`), or build the model with "
            f"{found[0]}")


_ROLE_MODULE = {"optimizer": "optimizers", "loss": "losses", "metric": "metrics",
                "weighted metric": "metrics", "callback": "callbacks"}


def _flat_arguments(node) -> list:
    import tensorflow as tf

    try:
        return tf.nest.flatten((node.call_args, node.call_kwargs))
    except (AttributeError, TypeError, ValueError):
        return []
