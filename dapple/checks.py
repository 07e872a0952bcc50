"""What `PipelinedModel` checks before anything runs: the plan was made for this model, and the
model computes nothing the pipelined step would compute differently from Keras."""
from __future__ import annotations

import tensorflow as tf

from graph_rewrite import keras_adapter
from graph_rewrite.batch_statistics import check_batch_normalization
from graph_rewrite.model_graph import draws_random_numbers, layer_order, model_signature
from planner.formats.plan import Plan, PlanError


class PlanMismatchError(PlanError):
    """The plan was made for another model or cannot run on it."""


def check_plan_matches_model(plan: Plan, model: tf.keras.Model) -> None:
    layers = layer_order(model)
    plan.validate(num_layers=None)
    if plan.num_layers != len(layers):
        raise PlanMismatchError(
            f"the plan covers {plan.num_layers} layers but model {model.name!r} has "
            f"{len(layers)}: the plan was made for another model; re-plan from this model's "
            f"profile (`dapple profile` then `dapple plan`)")
    names = [l.name for l in layers]
    for i, stage in enumerate(plan.stages):
        if stage.layer_names and stage.layer_names != names[stage.first:stage.last + 1]:
            wrong = next(j for j, (a, b) in enumerate(zip(stage.layer_names,
                                                            names[stage.first:stage.last + 1]))
                         if a != b)
            raise PlanMismatchError(
                f"stage {i}'s layer {stage.first + wrong} is {stage.layer_names[wrong]!r} in the "
                f"plan but {names[stage.first + wrong]!r} in model {model.name!r}: the plan was "
                f"made for another model")
    signature = (plan.profile or {}).get("model_signature")
    if signature and signature != model_signature(model):
        raise PlanMismatchError(
            f"the plan's profile was measured on another model (model signature "
            f"{signature[:12]}... vs {model_signature(model)[:12]}... for {model.name!r}): "
            f"profile this model and plan again")


def check_supported_model(model: tf.keras.Model) -> None:
    """Refuse what the pipelined step would silently compute differently from Keras."""
    for layer in model._flatten_layers(include_self=False):
        check_batch_normalization(layer)
    if keras_adapter.is_keras3(model):
        problems = keras_adapter.unsupported_keras3(model)
        if problems:
            raise ValueError(f"Keras 3 model {model.name!r} uses what dapple's Keras 3 path does "
                             f"not support yet: {'; '.join(problems)} (docs/keras3.md)")
        return
    # Weight regularizers are supported (graph_rewrite.pipeline adds them once per step);
    # losses computed from activations would need the stage's forward and are refused.
    weight_penalties = sum(len(layer._callable_losses) for layer in model._flatten_layers())
    if len(model.losses) > weight_penalties:
        raise ValueError(
            f"model {model.name!r} has {len(model.losses) - weight_penalties} loss(es) computed "
            f"from activations (activity regularizers or add_loss): the pipelined step does not "
            f"include them, so it would train a different objective than Keras; remove them or "
            f"add them to the compiled loss")


def check_recompute(plan: Plan, model: tf.keras.Model) -> None:
    """Recomputation runs a stage's forward twice; a layer that draws random numbers in
    training (Dropout and its kin) would draw a different mask the second time, and the
    backward would not be that of the forward."""
    if not plan.recompute:
        return
    for layer in model._flatten_layers(include_self=False):
        if draws_random_numbers(layer):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) draws random numbers in "
                f"training, and the plan recomputes activations (recompute: true): the "
                f"recomputed forward would draw other numbers than the first, so the gradients "
                f"would be wrong. Set \"recompute\": false in the plan")
