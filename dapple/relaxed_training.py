"""Training with a relaxed schedule (pipedream, 2bw, avgpipe): `PipelinedModel`'s side of it.

* A run is `steps_per_execution` global batches (compile's argument; by default the plan's
  `batches`), one schedule without a flush (`graph_rewrite.relaxed_step`). `fit` (the model's
  Keras's own, one run a Keras step: `runs_dataset`) groups the dataset's global batches into
  runs (AvgPipe: N of them a step, one per pipeline, so a run is
  N x steps_per_execution batches); a shorter last run is a run of its own (traced once more),
  and under AvgPipe batches left over from a whole step are skipped, as `fit` logs.
  `train_step(x, y)` runs whatever whole number of steps `x` holds as one run.
* The update rule does not depend on where runs start and end: the versions a run reads from
  before its start are kept between runs. The rule starts afresh (every earlier version, each
  AvgPipe pipeline and the reference := the model's weights) at the first training run after
  `compile` or `load_weights`.
* Optimizers: each stage's update (each pipeline's, under AvgPipe) is a step of an optimizer of
  its own, as each rank has its own under horovodrun: the compiled optimizer for the first
  this process runs, fresh copies from its config for the others.
* `evaluate`, `predict` and `gradients` run the plan's synchronous step (1F1B on the same
  stages), on the model's weights: between runs the latest version, AvgPipe's reference z.
* Refused, with the reason: BatchNormalization (its moving statistics have no rule per update
  yet), mixed precision (a loss scale per update), `global_clipnorm` (a norm over all stages,
  which update at different times), a variable used by two stages (two updates of one weight).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Tuple

import tensorflow as tf

from dapple.eager_build import build_metrics, build_optimizer
from graph_rewrite import keras_adapter
from graph_rewrite.batch_statistics import is_batch_normalization
from planner.schedules.relaxed_lists import DEFAULT_BATCHES
from planner.formats.plan import Plan
from planner.schedules.one_f_one_b import ONE_F_ONE_B


def is_relaxed(plan: Plan) -> bool:
    return plan.schedule.relaxed


def synchronous_plan(plan: Plan) -> Plan:
    """A relaxed plan's stages under 1F1B (what evaluate, predict and gradients run); other
    plans as they are."""
    if not is_relaxed(plan):
        return plan
    return dataclasses.replace(plan, schedule=ONE_F_ONE_B, batches=None, advance=None,
                               vertical_sync=None)


def check_relaxed(model: tf.keras.Model, plan: Plan, optimizer, stages) -> None:
    """Refuse what the relaxed runtime would not train by its rule (module docstring)."""
    name = plan.schedule.name
    for layer in model._flatten_layers(include_self=False):
        if is_batch_normalization(layer):
            raise ValueError(f"schedule {name!r} does not train BatchNormalization yet (layer "
                             f"{layer.name!r}): its moving statistics have no update rule per "
                             f"weight update; use a synchronous schedule (1f1b)")
    if keras_adapter.for_model(optimizer).is_loss_scale_optimizer(optimizer):
        raise ValueError(f"schedule {name!r} does not run mixed precision yet (the loss scale "
                         f"would change between a run's updates); use a float32 policy")
    if getattr(optimizer, "global_clipnorm", None):
        raise ValueError(f"schedule {name!r} updates each stage at its own time, so there is no "
                         f"whole gradient to clip by its global norm: use clipnorm (per "
                         f"variable) or a synchronous schedule")
    holders = {}
    for s, graph in enumerate(stages):
        for v in graph.trainable_variables:
            first = holders.setdefault(id(v), s)
            if first != s:
                raise ValueError(f"variable {v.name!r} is used by stages {first} and {s}; under "
                                 f"schedule {name!r} each stage updates its weights at its own "
                                 f"time: cut the model so that one stage holds it")


class RelaxedTraining:
    """The relaxed step of a compiled `PipelinedModel`, its optimizers and its runs."""

    def __init__(self, model, plan: Plan, runtime, loss, optimizer,
                 steps_per_execution: Optional[int], update_metrics: Callable,
                 pipeline_loop: bool = False):
        check_relaxed(model, plan, optimizer, runtime.stages)
        k = steps_per_execution if steps_per_execution is not None else (
            plan.batches or DEFAULT_BATCHES)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"steps_per_execution must be a positive integer, got {k!r}")
        self.model, self.plan, self.runtime = model, plan, runtime
        self.steps_per_execution = k
        self.pipelines = plan.schedule.pipelines(plan)
        self.step = runtime.make_relaxed_step(model, plan, loss, k, pipeline_loop)
        self.optimizer = optimizer
        self._update_metrics = update_metrics
        self._train_fn = None
        self.fresh = True

    def _build_optimizers(self) -> None:
        for i, key in enumerate(self.step.optimizer_keys()):
            opt = self.optimizer if i == 0 else type(self.optimizer).from_config(
                self.optimizer.get_config())
            build_optimizer(opt, self.step.stages[key[0]].trainable_variables)
            self.step.optimizers[key] = opt

    def check_rows(self, n: int) -> None:
        per_step = self.plan.global_batch_size * self.pipelines
        if n % per_step or n == 0:
            raise ValueError(f"a run of schedule {self.plan.schedule.name!r} takes whole steps of "
                             f"{per_step} rows ({self.pipelines} global batch(es) of "
                             f"{self.plan.global_batch_size}); got {n} rows")

    def prepare(self) -> None:
        """Eagerly, before a run is traced or run: every optimizer this process's updates use
        built, and the rule started afresh when it is due (module docstring)."""
        if not self.step.optimizers:
            self._build_optimizers()
        if self.fresh:
            self.step.reset_history()
            self.fresh = False

    def run(self, x, y, sample_weight=None):
        """One run over the steps `x` holds (graph code): (its `StepResult`, and y and
        sample_weight in the row order of the result's predictions)."""
        x, y, sample_weight = self.step.arrange((x, y, sample_weight))
        return self.step.run(x, y, sample_weight=sample_weight), y, sample_weight

    def train(self, x, y, sample_weight=None) -> tf.Tensor:
        """One run over the steps `x` holds; the loss per global batch."""
        if self._train_fn is None:
            build_metrics(self.model, y)
            self.prepare()
            step, update_metrics = self.step, self._update_metrics

            @tf.function
            def train_fn(x, y, sample_weight):
                result, y, sample_weight = self.run(x, y, sample_weight)
                update_metrics(y, result, sample_weight, step)
                return result.loss
            self._train_fn = self.runtime.compiled("relaxed train step", train_fn)
        self.prepare()
        return self._train_fn(x, y, sample_weight)

    def runs_dataset(self, ds: tf.data.Dataset, steps: Optional[int]) -> Tuple[
            tf.data.Dataset, Optional[int]]:
        """`fit`'s dataset: `ds`'s global batches grouped into runs, one element each (a
        shorter last run of its own), and `steps` (global batches an epoch, or None) as runs."""
        group, per_step = self.steps_per_execution * self.pipelines, self.pipelines
        if steps is not None and steps % group:
            raise ValueError(f"steps_per_epoch={steps} global batches is not a whole number of "
                             f"runs of {group} ({self.steps_per_execution} steps_per_execution "
                             f"x {per_step} pipeline(s)) under schedule "
                             f"{self.plan.schedule.name!r}: give a multiple of {group}")
        card = int(ds.cardinality())
        if card > 0 and card % group % per_step:
            logging.warning("fit: %d global batch(es) at the end of the epoch do not make a "
                            "whole step of %d pipelines and are skipped",
                            card % group % per_step, per_step)

        def joined(*parts):
            def one(t):
                whole = tf.shape(t)[0] // per_step * per_step  # AvgPipe: whole steps only
                rest = [d if d is not None else tf.shape(t)[i + 2]
                        for i, d in enumerate(t.shape[2:])]
                return tf.reshape(t[:whole], [-1] + rest)
            return tf.nest.map_structure(one, parts if len(parts) > 1 else parts[0])

        runs = ds.batch(group).map(joined)
        if per_step > 1:
            runs = runs.filter(lambda *parts: tf.shape(tf.nest.flatten(parts)[0])[0] > 0)
            if card >= 0:               # what filter hides from Keras's progress and epochs
                runs = runs.apply(tf.data.experimental.assert_cardinality(
                    card // group + int(card % group >= per_step)))
        return runs, None if steps is None else steps // group
