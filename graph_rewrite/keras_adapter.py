"""What cutting and calling a model needs from Keras, once per Keras version.

dapple's rewriter re-executes a functional model's own layer calls stage by stage
(`graph_rewrite.model_graph`). Keras 2 (tf_keras, or TensorFlow 2.15's keras) and Keras 3
(`import keras`, the Keras that TensorFlow ships) record those calls differently; everything
the rewriter reads of them goes through one adapter per version:

- the model's calls (nodes) in the order its Functional runs them, whether it has a graph, its
  output names;
- a node's layer, the ids of its input and output tensors, its output KerasTensors;
- the (args, kwargs) to call a node's layer with, given tensors by id, in training or not;
- a layer's weight regularizers, the losses its call added, whether it draws random numbers;
- building an optimizer's variables before the step is traced; the loss scale under mixed
  precision and who unscales the gradients; the compiled metrics;
- BatchNormalization: which layers are, the options the combined update cannot reproduce,
  the channel axes, the batch variance and the moving-average formula of that Keras
  (`graph_rewrite.batch_statistics` is the one runtime for both).

A tensor is identified by `str(id(keras_tensor))` in both versions (what both Functionals key
their tensors by). `Keras2` is what the rewriter always did, moved here unchanged.

Keras 3 is supported on a thin path for now (docs/keras3.md): functional (and built Sequential)
models without masks or losses from activations; `for_model`
tells the versions apart, and `unsupported_keras3` names what a Keras 3 model uses that is not
supported yet.
"""
from __future__ import annotations

import collections
import functools
import sys
from typing import Dict, List

import tensorflow as tf


def _keras_root(obj) -> str:
    """'keras' (Keras 3), 'tf_keras' (Keras 2) or '' for what defines obj's class."""
    for cls in type(obj).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if root in ("keras", "tf_keras"):
            return root
    return ""


def is_keras3(obj) -> bool:
    """Whether `obj` (a model, layer or node) is Keras 3's (`import keras` on TF >= 2.16)."""
    if _keras_root(obj) != "keras":
        return False
    version = str(getattr(sys.modules.get("keras"), "__version__", "2"))
    return not version.startswith(("1.", "2."))


def keras2_module_of(obj):
    """The Keras 2 API module that defines obj's class (`tf_keras`, or TensorFlow 2.15's
    `keras`), None when obj is not a Keras 2 object. dapple's Keras 2 code names this module,
    never `tf.keras` (which is Keras 3 on TensorFlow 2.16+ unless TF_USE_LEGACY_KERAS=1)."""
    root = _keras_root(obj)
    if not root or is_keras3(obj):
        return None
    return sys.modules.get(root)


def keras_module_of(obj):
    """The Keras API module that defines obj's class, of either Keras (`keras` 3, `tf_keras`,
    TensorFlow 2.15's `keras`), None for what no Keras defines."""
    root = _keras_root(obj)
    return sys.modules.get(root) if root else None


def keras2_api():
    """The Keras 2 API module whatever `tf.keras` is: tf_keras when installed (it imports
    alone), else `tf.keras` when that is Keras 2 (TensorFlow 2.15), else None."""
    try:
        import tf_keras
        return tf_keras
    except ImportError:
        pass
    try:
        api = tf.keras
        root = api.Model.__module__.split(".")[0]
    except (AttributeError, ImportError):
        return None
    version = str(getattr(sys.modules.get(root), "__version__", "2"))
    return api if version.startswith(("1.", "2.")) else None


class _Functional:
    """What both Keras versions' Functionals spell alike."""

    @staticmethod
    def nodes_by_depth(model) -> Dict[int, list]:
        return model._nodes_by_depth

    @staticmethod
    def mask(keras_tensor):
        return getattr(keras_tensor, "_keras_mask", None)


class Keras2(_Functional):
    """tf_keras (and TF 2.15's built-in keras): nodes are `keras.engine.node.Node`."""
    name = "Keras 2"

    @staticmethod
    def is_graph_model(model) -> bool:
        return bool(getattr(model, "_is_graph_network", False))

    @staticmethod
    def output_names(model) -> List[str]:
        return list(model.output_names)

    @staticmethod
    def compiled_metrics(model):
        """The metrics `compile` made (`update_state`, `reset_state`, `metrics`, `built`)."""
        return model.compiled_metrics

    @staticmethod
    def is_input(node) -> bool:
        return node.is_input

    @staticmethod
    def layer(node):
        return node.layer

    @staticmethod
    def input_ids(node) -> List[str]:
        return node.flat_input_ids

    @staticmethod
    def output_ids(node) -> List[str]:
        return node.flat_output_ids

    @staticmethod
    def outputs(node) -> list:
        return tf.nest.flatten(node.outputs)

    @staticmethod
    def call_arguments(node, values: Dict[str, tf.Tensor], training: bool):
        """The mapping Keras's Functional uses (`Node.map_arguments`), plus the training flag
        for layers that take one, unless the model's graph fixed it at that call."""
        lists = collections.defaultdict(list)
        for tid in node.flat_input_ids:
            lists[tid].append(values[tid])
        args, kwargs = node.map_arguments(lists)
        if getattr(node.layer, "_expects_training_arg", False) and "training" not in kwargs:
            kwargs = dict(kwargs, training=training)
        return args, kwargs

    @staticmethod
    def draws_random_numbers(layer) -> bool:
        return (getattr(layer, "_random_generator", None) is not None
                and getattr(layer, "rate", 1.0) != 0)

    @staticmethod
    def weight_penalties(layer) -> list:
        """The layer's (and its sublayers') weight regularizers: (key, callable) pairs, the
        key the same for the same regularizer wherever the layer is called."""
        return [(id(c), c) for sub in layer._flatten_layers() for c in sub._callable_losses]

    @staticmethod
    def added_losses(layer) -> int:
        """0: a Keras 2 model's `losses` name them before a step is built
        (`dapple.checks.check_supported_model`)."""
        return 0

    @staticmethod
    def build_optimizer(optimizer, variables) -> None:
        api = keras2_module_of(optimizer)
        if api is not None and isinstance(optimizer, api.optimizers.Optimizer):
            optimizer.build(variables)                              # LossScaleOptimizerV3 too

    @staticmethod
    def is_loss_scale_optimizer(optimizer) -> bool:
        """A Keras 2 `mixed_precision.LossScaleOptimizer` (`loss_scale`,
        `get_unscaled_gradients`)."""
        api = keras2_module_of(optimizer)
        return api is not None and isinstance(optimizer, api.mixed_precision.LossScaleOptimizer)

    @staticmethod
    def loss_scale(optimizer):
        """The step's loss scale: a `LossScaleOptimizer`'s current `loss_scale`, else None."""
        return optimizer.loss_scale if Keras2.is_loss_scale_optimizer(optimizer) else None

    @staticmethod
    def unscaled(optimizer, gradients: list) -> list:
        """Keras 2's trainer unscales the gradients before `apply_gradients`
        (`get_unscaled_gradients`); the optimizer then skips a non-finite step itself."""
        if Keras2.is_loss_scale_optimizer(optimizer):
            return optimizer.get_unscaled_gradients(gradients)
        return gradients

    unscales_in_apply = False

    @staticmethod
    def tf_variable(variable) -> tf.Variable:
        """The `tf.Variable` holding a model variable's value: tf_keras's are tf.Variables."""
        return variable

    # Working copies (`graph_rewrite.working_copies`): where a layer's calls read its weights

    @staticmethod
    def weight_holders(layer) -> list:
        """The layer and its sublayers: the objects whose attributes hold its variables."""
        return [layer] + list(getattr(layer, "submodules", ()))

    @staticmethod
    def reads_through(name: str) -> bool:
        """Whether a call reads a variable held in attribute `name` there: tf_keras's layers
        read their public attributes (`kernel`, `bias`)."""
        return not name.startswith("_")

    @staticmethod
    def copy_reads_alike(layer, variable) -> bool:
        """Whether a plain tf.Variable copy is read as the variable is (tf_keras's
        AutoCastVariable is copied as one: `working_copies._copy_of`)."""
        return True

    # BatchNormalization (`graph_rewrite.batch_statistics`)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _batch_normalization_class(api):
        """tf_keras's `BatchNormalizationBase` (SyncBatchNormalization too)."""
        for cls in api.layers.BatchNormalization.__mro__:
            if cls.__name__ == "BatchNormalizationBase":
                return cls
        return api.layers.BatchNormalization

    @staticmethod
    def is_batch_normalization(layer) -> bool:
        api = keras2_module_of(layer)
        return api is not None and isinstance(layer, Keras2._batch_normalization_class(api))

    @staticmethod
    def batch_normalization_problem(layer):
        """Why this BatchNormalization's training state cannot be combined, or None."""
        if getattr(layer, "renorm", False):
            return ("batch renormalization (renorm=True) corrects each batch with moving "
                    "statistics that every micro-batch would update")
        if getattr(layer, "virtual_batch_size", None) is not None:
            return ("virtual_batch_size splits the batch inside the layer; a pipeline already "
                    "normalizes per micro-batch slice: remove virtual_batch_size and choose the "
                    "plan's slice size instead")
        if getattr(layer, "adjustment", None) is not None:
            return "an adjustment function depends on the batch shape"
        return None

    @staticmethod
    def normalization_axes(layer, rank: int) -> List[int]:
        """The channel axes (tf_keras keeps them as a list of non-negative ints once built)."""
        return list(layer.axis)

    @staticmethod
    def batch_variance(layer, count: int, m2):
        """The variance Keras moves towards: the fused kernel (4-D and 5-D inputs on the
        channel axis) uses the unbiased one, the non-fused path the biased one."""
        fused = bool(getattr(layer, "fused", False))
        return m2 / (count - 1 if fused and count > 1 else count)

    @staticmethod
    def moving_average(layer, before, value):
        """tf_keras's `_assign_moving_average`: before - (before - value) * (1 - momentum)."""
        decay = tf.cast(1.0 - layer.momentum, before.dtype)
        return before - (before - value) * decay

    @staticmethod
    def fixed_training(node):
        """The training flag the model's graph fixed at this call (tf_keras keeps it: the
        Functional passes its own only when the call did not), or None."""
        return node.call_kwargs.get("training")


class Keras3(_Functional):
    """Keras 3 (`import keras`): nodes are `keras.src.ops.node.Node` (`operation`,
    `arguments`), as `keras.src.ops.function.Function._run_through_graph` runs them."""
    name = "Keras 3"

    @staticmethod
    def graph(model):
        """The Functional whose graph runs `model`: a built Sequential's `_functional` (the
        same layers and tensors), else the model."""
        return getattr(model, "_functional", None) or model

    @staticmethod
    def is_graph_model(model) -> bool:
        return isinstance(getattr(Keras3.graph(model), "_nodes_by_depth", None), dict)

    @staticmethod
    def nodes_by_depth(model) -> Dict[int, list]:
        return Keras3.graph(model)._nodes_by_depth

    @staticmethod
    def output_names(model) -> List[str]:
        return list(Keras3.graph(model).output_names)

    @staticmethod
    def compiled_metrics(model):
        """Keras 3's `CompileMetrics` (`keras.src.trainers.compile_utils`), None before
        compile or without metrics; the same methods as Keras 2's container."""
        return getattr(model, "_compile_metrics", None)

    @staticmethod
    def is_input(node) -> bool:
        return node.is_input or not node.operation

    @staticmethod
    def layer(node):
        return node.operation

    @staticmethod
    def input_ids(node) -> List[str]:
        return [str(id(t)) for t in node.input_tensors]

    @staticmethod
    def output_ids(node) -> List[str]:
        return [str(id(t)) for t in node.outputs]

    @staticmethod
    def outputs(node) -> list:
        return list(node.outputs)

    @staticmethod
    def call_arguments(node, values: Dict[str, tf.Tensor], training: bool):
        """`node.arguments.fill_in` on the tensors by Keras's own int ids, plus the training
        flag as Keras 3's Functional passes it (`functional.operation_fn`: every call-context
        argument the operation registers, overriding the graph's)."""
        args, kwargs = node.arguments.fill_in(
            {int(tid): values[tid] for tid in Keras3.input_ids(node)})
        if "training" in getattr(node.operation, "_call_context_args", ()):
            kwargs = dict(kwargs, training=training)
        return args, kwargs

    @staticmethod
    def draws_random_numbers(layer) -> bool:
        """Keras 3's random layers hold a `keras.random.SeedGenerator` (Dropout only when its
        rate is not 0)."""
        return (getattr(layer, "seed_generator", None) is not None
                and getattr(layer, "rate", 1.0) != 0)

    @staticmethod
    def weight_penalties(layer) -> list:
        """(key, callable) for each of the layer's trainable weights with a regularizer: Keras
        3 computes the penalty from `variable.regularizer` (`Layer._get_regularization_losses`),
        keyed by the variable so a layer called in two stages counts once."""
        return [(id(v), functools.partial(_regularizer_penalty, v))
                for v in weights_of(layer, trainable_only=True)
                if getattr(v, "regularizer", None) is not None]

    @staticmethod
    def added_losses(layer) -> int:
        """How many losses the layer's last call added (`add_loss` in `call`): Keras 3 clears
        them when an outermost call starts, and a model built from such a layer does not
        list them in its `losses`, so only the call shows them."""
        return sum(len(sub._losses) for sub in Keras3.weight_holders(layer))

    @staticmethod
    def build_optimizer(optimizer, variables) -> None:
        if hasattr(optimizer, "build") and not getattr(optimizer, "built", False):
            optimizer.build(variables)

    @staticmethod
    def is_loss_scale_optimizer(optimizer) -> bool:
        """Keras 3's `keras.optimizers.LossScaleOptimizer` (it scales inside `apply`)."""
        keras = sys.modules.get("keras")
        return keras is not None and isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @staticmethod
    def loss_scale(optimizer):
        """What Keras 3's trainer multiplies the loss by (`optimizer.scale_loss`): a
        `LossScaleOptimizer`'s `dynamic_scale` (built before tracing, so the variable's
        current value), or a plain optimizer's `loss_scale_factor`; None when neither."""
        if Keras3.is_loss_scale_optimizer(optimizer):
            return tf.convert_to_tensor(optimizer.dynamic_scale)
        factor = getattr(optimizer, "loss_scale_factor", None)
        return None if factor is None else tf.constant(factor, tf.float32)

    @staticmethod
    def unscaled(optimizer, gradients: list) -> list:
        """Unchanged: Keras 3's optimizer unscales inside `apply` (and a
        `LossScaleOptimizer` skips a non-finite step and halves its scale there)."""
        return gradients

    unscales_in_apply = True

    @staticmethod
    def tf_variable(variable) -> tf.Variable:
        """A `keras.Variable` on the TensorFlow backend wraps a `tf.Variable` (`_value`,
        `keras.src.backend.tensorflow.core.Variable._initialize`); what takes tf.Variables
        and assigns them (Horovod's `broadcast_variables`, inside a tf.function) needs that
        one: a keras.Variable passed to a tf.function arrives as a tensor."""
        inner = getattr(variable, "_value", None)
        return inner if isinstance(inner, tf.Variable) else variable

    @staticmethod
    def weight_holders(layer) -> list:
        """The layer and its sublayers (Keras 3's layers are no `tf.Module`s); none for an
        operation that is not a layer."""
        if not hasattr(layer, "_flatten_layers"):
            return []
        return list(layer._flatten_layers(include_self=True, recursive=True))

    @staticmethod
    def reads_through(name: str) -> bool:
        """Keras 3's layers keep some variables private behind a property that returns them
        (`Dense._kernel`, `Conv._kernel`, `Embedding._embeddings`) and others public (`bias`,
        `gamma`): a call reads whichever attribute holds the variable."""
        return True

    @staticmethod
    def copy_reads_alike(layer, variable) -> bool:
        """A `keras.Variable` read in a layer's call is cast to the layer's compute dtype
        (`KerasVariable.value` under `AutocastScope`); a plain tf.Variable copy would not be:
        copies only where no cast happens."""
        return variable.dtype == getattr(layer, "compute_dtype", variable.dtype)

    # BatchNormalization (`keras.src.layers.normalization.batch_normalization`): the same
    # `moving_mean`/`moving_variance` attributes (tracked by the layer's `_tracker`; the
    # redirect sets them past it), assigned in `call(training=True)` of a trainable layer.

    @staticmethod
    def is_batch_normalization(layer) -> bool:
        keras = sys.modules.get("keras")         # a Keras 3 layer exists: keras is imported
        return keras is not None and isinstance(layer, keras.layers.BatchNormalization)

    @staticmethod
    def batch_normalization_problem(layer):
        if getattr(layer, "renorm", False):
            return ("batch renormalization (renorm=True) corrects each batch with moving "
                    "statistics that every micro-batch would update")
        if getattr(layer, "synchronized", False):
            return ("synchronized=True computes the statistics across tf.distribute replicas; "
                    "a pipeline normalizes per micro-batch slice and combines the moving "
                    "statistics itself: use synchronized=False")
        return None

    @staticmethod
    def normalization_axes(layer, rank: int) -> List[int]:
        """Keras 3 keeps one int axis, possibly negative."""
        return [layer.axis % rank]

    @staticmethod
    def batch_variance(layer, count: int, m2):
        """`ops.moments`: the biased variance, whatever the input's rank."""
        return m2 / count

    @staticmethod
    def moving_average(layer, before, value):
        """`BatchNormalization.call`: moving * momentum + batch * (1 - momentum)."""
        return before * layer.momentum + value * (1.0 - layer.momentum)

    @staticmethod
    def mask(keras_tensor):
        """None: Keras 3's functional graph passes a mask as an argument of its own (the output
        of an operation such as `NotEqual`), which crosses a cut as any tensor does; a tensor
        carries no mask of its own there."""
        return None

    @staticmethod
    def fixed_training(node):
        """None: Keras 3's Functional passes its training flag to every call, overriding the
        graph's (`functional.operation_fn`), as `call_arguments` does."""
        return None


def _regularizer_penalty(variable):
    return variable.regularizer(variable)


def for_model(model):
    """The adapter for a model (or a layer, or a node) of either Keras."""
    return Keras3 if is_keras3(model) else Keras2


def for_node(node):
    return Keras3 if hasattr(node, "operation") and is_keras3(node) else Keras2


def weights_of(layer, trainable_only: bool = False) -> list:
    """A layer's weights (or only its trainable ones); none for a Keras 3 operation that is not
    a layer (`keras.ops` in a functional graph, e.g. the `NotEqual` that computes
    `Embedding(mask_zero=True)`'s mask)."""
    return list(getattr(layer, "trainable_weights" if trainable_only else "weights", ()))


def tf_variables(variables) -> list:
    """`tf_variable` of each variable, of either Keras."""
    return [for_model(v).tf_variable(v) for v in variables]


def layer_of(node):
    """The layer a node (one call) calls, in either Keras."""
    return for_node(node).layer(node)


def unsupported_keras3(model) -> List[str]:
    """What a Keras 3 model uses that dapple's Keras 3 path does not support yet (each named),
    empty when it may be pipelined."""
    problems = []
    for layer in model._flatten_layers(include_self=False):
        kind = type(layer).__name__
        if hasattr(layer, "moving_mean") and not Keras3.is_batch_normalization(layer):
            problems.append(f"layer {layer.name!r} ({kind}): moving statistics")
        if getattr(layer, "activity_regularizer", None) is not None:
            problems.append(f"layer {layer.name!r} ({kind}): activity_regularizer")
    # Weight regularizers are supported (`Keras3.weight_penalties`); any other loss
    # (`add_loss`) is computed from activations and refused, as for Keras 2.
    regularized = sum(getattr(v, "regularizer", None) is not None
                      for v in model.trainable_weights)
    added = len(getattr(model, "losses", None) or []) - regularized
    if added > 0:
        problems.append(f"{added} loss(es) added to the model (add_loss)")
    return problems
