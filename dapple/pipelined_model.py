"""`PipelinedModel`: a Keras model trained with a Plan, with Keras's own conventions.

    pm = dapple.PipelinedModel(model, plan)          # plan: a Plan or a JSON path
    pm.compile(optimizer, loss, metrics=None, loss_weights=None, weighted_metrics=None)
    history = pm.fit(x, y, batch_size=..., epochs=..., callbacks=[...],
                     sample_weight=None, class_weight=None)
    pm.evaluate(x, y, sample_weight=None); pm.predict(x)
    pm.save_weights(path); pm.load_weights(path)
    grads = pm.gradients(x, y)                       # aligned with model.trainable_variables

The wrapped model keeps its variables: the pipelined step computes their gradients stage by
stage and applies them with the user's optimizer, so the plain model *is* the trained model,
checkpoints are the plain model's (Keras format) and restore into it or into any other plan.

Keras's training semantics hold: sample and class weights weigh the loss as in Keras; under a
mixed-precision policy the loss is scaled by the `LossScaleOptimizer` that `compile` makes and
the gradients unscaled once after accumulation, so its dynamic loss scale and skipped steps
are Keras's; clipping (`clipnorm`, `global_clipnorm`, `clipvalue`) sees the whole gradient.

The plan is checked against the model before anything runs: its layer count, its layer names
(when the plan has them), and the model signature of the profile it was made from (when
present). The global batch must be the plan's, and must divide into micro-batches x replicas.

Where the step runs is a `Runtime` (`dapple.runtime.base`) chosen once, when it is made
(`dapple.runtime.choice`): every unit in this process (`dapple.runtime.local.runtime`), one unit per
Horovod rank under horovodrun (`dapple.runtime.horovod.runtime`), or every unit from this process on
a TensorFlow cluster's tasks (`dapple.runtime.tf_cluster`). This class runs the same actions on all.

A step's micro-batches run as loops, so its first call hardly grows with M: a data-parallel
plan's lanes (`graph_rewrite.micro_batch_loop`) and a pipeline's steady 1F1B, GPipe, zb-h1 or
interleaved periods (`graph_rewrite.schedule_loop`), in one process, across horovodrun's ranks or
across a TensorFlow cluster's tasks. `micro_batch_loop=False` unrolls every step, for comparison;
`pipeline_loop` decides for pipelines alone; by default they loop in one process and run unrolled
across processes (Horovod's ranks, a cluster's tasks), where every iteration of a loop waits on
the other processes and a looped step measured 18-44% slower (docs/runtime.md, "Which steps loop
by default"). A relaxed plan runs unrolled unless `pipeline_loop=True` (then its lists loop where
they are periodic: PipeDream's updates inside the loop, 2BW's between loops); recomputing plans
and evaluation run unrolled.

An unrolled step calls each stage's functions once per micro-batch. Across processes (a
TensorFlow cluster's tasks, Horovod's ranks) those calls are inlined into the step by default:
their steady step measured faster, for a longer first call. In one process they stay out of
line: the graph optimizer rewrites a stage once, not once per call, and the first call stays
short. `inline_stage_calls=True` or `False` chooses, None keeps each runtime's default
(docs/runtime.md, "Inlined stage calls").
"""
from __future__ import annotations

import os
from typing import List, Optional, Union

import numpy as np
import tensorflow as tf

from dapple.checks import check_plan_matches_model, check_recompute, check_supported_model
from dapple.data import (check_whole_batches, dataset_batch_rows, global_batches, rows,
                         unpack_validation_data)
from dapple.eager_build import build_metrics
from dapple.keras2 import refuse_mixed_keras, require_keras2_model
from dapple.relaxed_training import RelaxedTraining, is_relaxed, synchronous_plan
from dapple.runtime.base import Runtime, loss_scale
from dapple.runtime.choice import make_runtime
from graph_rewrite.keras_adapter import Keras3, for_model, is_keras3, keras2_module_of
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.pipeline import PipelineStep
from planner.formats.plan import Plan
from planner.schedules.by_name import require_runtime_support
from planner.formats.slicing import check_even


class PipelinedModel:
    def __init__(self, model: tf.keras.Model, plan: Union[Plan, str], devices=None,
                 runtime: Optional[str] = None, micro_batch_loop: bool = True,
                 pipeline_loop: Optional[bool] = None,
                 inline_stage_calls: Optional[bool] = None):
        require_keras2_model(model, "PipelinedModel", keras3_functional=Keras3.is_graph_model)
        self.model = model
        self._keras3 = is_keras3(model)
        self.plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        # Checked before the runtime starts (Horovod's, too): a clear error on every rank.
        check_plan_matches_model(self.plan, model)
        check_supported_model(model)
        check_recompute(self.plan, model)
        require_runtime_support(self.plan)
        self.runtime = make_runtime(runtime, model, self.plan, devices)
        self.micro_batch_loop = micro_batch_loop
        self.pipeline_loop = (micro_batch_loop and self.runtime.loops_pipelines
                              if pipeline_loop is None else pipeline_loop)
        # A relaxed plan loops only when asked: its first call stays flat in M, but its looped
        # steady step measured 1.0-1.3x the unrolled one (2BW), 1.6-1.7x (PipeDream) here
        # (docs/runtime.md).
        self._relaxed_loop = pipeline_loop is True
        self.inline_stage_calls = inline_stage_calls
        self._loss: Optional[PipelineLoss] = None
        self._step: Optional[PipelineStep] = None     # relaxed plans: their synchronous step
        self._relaxed: Optional[RelaxedTraining] = None
        self.optimizer = None
        self._train_fn = self._grad_fn = None
        self._metrics_built = False
        self._trainer = None            # the Keras model that fit/evaluate/predict run
        self._compiled_metrics_args = (None, None)
        self._compiled_loss_args = (None, None)

    # ---- Keras-style API ---------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                weighted_metrics=None, steps_per_execution=None, **kwargs):
        """Keras's compile. `steps_per_execution`: global batches one run of a relaxed schedule
        covers (default the plan's `batches`; see `dapple.relaxed_training`)."""
        if steps_per_execution not in (None, 1) and not is_relaxed(self.plan):
            raise ValueError(f"steps_per_execution applies to the relaxed schedules (pipedream, "
                             f"2bw, avgpipe); schedule {self.plan.schedule.name!r} runs one batch")
        if kwargs:
            raise TypeError(f"PipelinedModel.compile does not support {sorted(kwargs)}")
        for role, given in (("optimizer", optimizer), ("loss", loss), ("metric", metrics),
                            ("weighted metric", weighted_metrics)):
            refuse_mixed_keras(self.model, "PipelinedModel.compile", role, given)
        # The plain model's compile gives us Keras's optimizer (a LossScaleOptimizer under a
        # mixed-precision policy) and metric conventions.
        self.model.compile(optimizer=optimizer, loss=loss, metrics=metrics,
                           loss_weights=loss_weights, weighted_metrics=weighted_metrics)
        self.optimizer = self.model.optimizer
        self._loss = PipelineLoss(loss, for_model(self.model).output_names(self.model),
                                  loss_weights)
        self._step = self.runtime.make_step(self.model, synchronous_plan(self.plan), self._loss,
                                            micro_batch_loop=self.micro_batch_loop,
                                            pipeline_loop=self.pipeline_loop,
                                            inline_stage_calls=self.inline_stage_calls)
        self._relaxed = RelaxedTraining(
            self.model, self.plan, self.runtime, self._loss, self.optimizer, steps_per_execution,
            self._update_metrics, self._relaxed_loop) if is_relaxed(self.plan) else None
        self._train_fn = self._grad_fn = None
        self._metrics_built = False
        self._trainer = None
        self._compiled_metrics_args = (metrics, weighted_metrics)
        self._compiled_loss_args = (loss, loss_weights)

    def _keras_trainer(self):
        """The model's Keras's `Model` whose steps are this pipeline (`dapple.pipeline_trainer`),
        compiled like the plain model (its optimizer, metrics) once `compile` has run."""
        if self._trainer is None:
            if self._keras3:
                from dapple.keras3_model import PipelineTrainer
            else:
                from dapple.tf_keras_model import trainer_class
                PipelineTrainer = trainer_class(keras2_module_of(self.model))
            if self._step is None:          # predict before compile: a forward-only step
                self._step = self.runtime.make_step(self.model, synchronous_plan(self.plan),
                                                    None,
                                                    inline_stage_calls=self.inline_stage_calls)
            trainer = PipelineTrainer(self)
            if self._loss is not None:
                # Its optimizer variables as the runtime builds them (under horovodrun: this
                # rank's stage's), before Keras would build them for every variable.
                self.runtime.prepare_optimizer(self._step, self.optimizer)
                metrics, weighted_metrics = self._compiled_metrics_args
                loss, loss_weights = self._compiled_loss_args
                if len(for_model(self.model).output_names(self.model)) < 2:
                    loss = loss_weights = None      # Keras logs no per-output loss for one
                # The loss only for Keras's per-output logs (`<output>_loss`): the pipelined
                # step computes the loss that is trained and logged as `loss`.
                trainer.compile(optimizer=self.optimizer, loss=loss, loss_weights=loss_weights,
                                metrics=metrics, weighted_metrics=weighted_metrics,
                                jit_compile=False)
            self._trainer = trainer
        return self._trainer

    # ---- the pipelined steps as graph code (`PipelineTrainer` runs them) ----------------------
    def pipelined_train(self, x, y, sample_weight, predictions: bool):
        """One step and its optimizer update on a global batch (relaxed plans: one run of the
        global batches `x` holds): (loss, every output's predictions or None, y, sample_weight),
        y and sample_weight in the predictions' row order (AvgPipe's run reorders its rows)."""
        if self._relaxed:
            result, y, sample_weight = self._relaxed.run(x, y, sample_weight)
            step = self._relaxed.step
        else:
            result, step = self._train_result(x, y, sample_weight), self._step
        return (result.loss, self.runtime.predictions(step, result) if predictions else None,
                y, sample_weight)

    def pipelined_evaluate(self, x, y, sample_weight, predictions: bool):
        """The loss of a global batch, without a backward: (loss, predictions or None)."""
        result = self._step.run(x, y, training=False, sample_weight=sample_weight)
        return result.loss, (self.runtime.predictions(self._step, result) if predictions
                             else None)

    def pipelined_predict(self, x) -> List[tf.Tensor]:
        """Every output's predictions for a global batch."""
        result = self._step.run(x, None, training=False)
        # Added as an exact 0, the loss keeps the step's transfers and closing collective
        # alive on every rank across processes (Grappler drops what nothing reads).
        zero = tf.cast(result.loss, tf.float32) * 0.0
        return [p + tf.cast(zero, p.dtype) for p in self.runtime.predictions(self._step, result)]

    # ---- where this process runs (the runtime's) ------------------------------------------------
    @property
    def devices(self) -> List[str]:
        """The device of every plan device id (under horovodrun: this rank's, for all)."""
        return self.runtime.devices

    @property
    def rank(self) -> int:
        """This process's Horovod rank (0 when one process runs every unit)."""
        return self.runtime.rank

    @property
    def stage(self) -> Optional[int]:
        """The stage this process runs under horovodrun (None when it runs every stage)."""
        return self.runtime.stage

    @property
    def replica(self) -> Optional[int]:
        """The replica of `stage` this process runs under horovodrun (else None)."""
        return self.runtime.replica

    def gather_weights(self) -> None:
        """Make this process's copy of the model current (under horovodrun each rank trains
        only its stage; locally there is nothing to gather)."""
        self.runtime.gather_weights()

    @property
    def global_batch_size(self) -> Optional[int]:
        return self.plan.global_batch_size

    @property
    def pipeline_step(self) -> PipelineStep:
        """The pipelined step (`graph_rewrite.pipeline.PipelineStep`) that `train_step`,
        `gradients`, `evaluate` and `predict` run, for inspection: its stages (`stages`), the
        device of each unit (`device(stage, replica)`), `run(x, y)` to trace it alone. Made by
        `compile` (or a `predict` before it); relaxed plans: their synchronous step."""
        if self._step is None:
            raise RuntimeError("no pipelined step yet: call compile(optimizer, loss) first")
        return self._step

    @property
    def training_step(self) -> PipelineStep:
        """The step `train_step` and `fit` run: a relaxed plan's (`graph_rewrite.relaxed_step`),
        else `pipeline_step`."""
        return self._relaxed.step if self._relaxed is not None else self.pipeline_step

    @property
    def train_function(self):
        """The compiled train step `train_step` calls (as Keras's `Model.train_function`),
        None until it is made (`make_train_function`, or the first `train_step`)."""
        return self._train_fn

    def make_train_function(self, force: bool = False):
        """Make (again, with `force`) the compiled train step, as Keras's
        `Model.make_train_function`; the next `train_step` traces it."""
        self._require_compiled()
        if self._train_fn is None or force:
            self._train_fn = self._build_train_fn()
        return self._train_fn

    def check_batch_size(self, n: int) -> None:
        """Raise ValueError unless `n` rows are one global batch of the plan."""
        self._check_batch(n)

    def _require_compiled(self):
        if self._loss is None:
            raise RuntimeError("call compile(optimizer, loss) before training or evaluating")

    def _check_batch(self, n: int, where: str = "") -> None:
        if self.plan.global_batch_size is not None and n != self.plan.global_batch_size:
            raise ValueError(f"batch size {n}{where} differs from the plan's global_batch_size "
                             f"{self.plan.global_batch_size}: the plan (micro-batches, replica "
                             f"slices, memory) was made for that batch; use it or re-plan"
                             + (" (batch a tf.data.Dataset with drop_remainder=True)" if where
                                else ""))
        check_even(n, self.plan.micro_batches, [s.replicas for s in self.plan.stages])

    def _check_dataset(self, ds, what: str) -> None:
        """A dataset's batches against the plan's global batch, before its first element."""
        rows_per_batch = dataset_batch_rows(ds, self.model, self.plan.global_batch_size, what)
        if rows_per_batch is not None:
            self._check_batch(rows_per_batch, where=f" of {what}")

    def _check_rows(self, x, what: str) -> None:
        """Arrays (or a dataset) that `evaluate` runs in whole global batches."""
        if isinstance(x, tf.data.Dataset):
            self._check_dataset(x, what)
        else:
            check_whole_batches(rows(x), self.plan.global_batch_size, what)

    def _compiled_metrics(self):
        return for_model(self.model).compiled_metrics(self.model)

    def _metrics(self) -> list:
        cm = self._compiled_metrics()
        return list(cm.metrics) if cm is not None else []

    def _has_metrics(self) -> bool:
        cm = self._compiled_metrics()
        return bool(getattr(cm, "_user_metrics", None) or getattr(cm, "_user_weighted_metrics",
                                                                     None))

    def _update_metrics(self, y, result, sample_weight=None, step=None) -> None:
        if self._has_metrics():
            y_pred = self.runtime.predictions(step or self._step, result)
            self._compiled_metrics().update_state(
                y, y_pred[0] if len(y_pred) == 1 else y_pred, sample_weight)

    # ---- training ------------------------------------------------------------------------------
    def gradients(self, x, y, sample_weight=None) -> List[tf.Tensor]:
        """Gradients of the compiled loss on the global batch (x, y), pipelined; for checks.
        Aligned with `model.trainable_variables` (None for variables this process does not
        train, under horovodrun)."""
        self._require_compiled()
        self.runtime.model_may_have_changed()
        self._check_batch(rows(x))
        if self._grad_fn is None:
            @tf.function
            def grad_fn(x, y, sample_weight):
                result = self._step.run(x, y, sample_weight=sample_weight)
                return result.loss, result.gradients
            self._grad_fn = self.runtime.compiled("gradients step", grad_fn)
        loss, grads = self._grad_fn(x, y, sample_weight)
        return grads

    def _build_train_fn(self):
        self.runtime.prepare_optimizer(self._step, self.optimizer)

        @tf.function
        def train_fn(x, y, sample_weight):
            result = self._train_result(x, y, sample_weight)
            self._update_metrics(y, result, sample_weight)
            return result.loss
        return self.runtime.compiled("train step", train_fn)

    def _train_result(self, x, y, sample_weight):
        """The pipelined step of a global batch and its optimizer update (graph code)."""
        result = self._step.run(x, y, sample_weight=sample_weight,
                                loss_scale=loss_scale(self.optimizer))
        self.runtime.apply_gradients(self._step, self.optimizer, result)
        return result

    def train_step(self, x, y, sample_weight=None) -> tf.Tensor:
        """One optimizer step on one global batch; returns the loss. Relaxed schedules: one run
        of the steps `x` holds (whole global batches; AvgPipe: N a step)."""
        self._require_compiled()
        self.runtime.model_may_have_changed()
        (self._relaxed.check_rows if self._relaxed else self._check_batch)(rows(x))
        return self._train(x, y, sample_weight)

    def _train(self, x, y, sample_weight):
        if self._relaxed:
            return self._relaxed.train(x, y, sample_weight)
        if not self._metrics_built:
            build_metrics(self.model, y)
            self._metrics_built = True
        return self.make_train_function()(x, y, sample_weight)

    def _batch_size(self, batch_size) -> int:
        if batch_size is None:
            batch_size = self.plan.global_batch_size
        if batch_size is None:
            raise ValueError("batch_size is needed: the plan has no global_batch_size")
        self._check_batch(batch_size)
        return batch_size

    def _dataset(self, x, y, batch_size, shuffle, what: str, sample_weight=None,
                 class_weight=None):
        if not isinstance(x, tf.data.Dataset):
            batch_size = self._batch_size(batch_size)
        return global_batches(x, y, batch_size, shuffle, what, sample_weight, class_weight,
                              self.runtime.shuffle_seed)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None,
            initial_epoch=0, steps_per_epoch=None, validation_split=0.0, validation_freq=1):
        """Keras's `fit`: the model's Keras's own `Model.fit` of a `PipelineTrainer`
        (`dapple.pipeline_trainer`) on whole global batches: arrays shuffled with the
        runtime's seed, the rows past the last whole batch left out; a dataset's batches
        checked against the plan. `validation_split` takes the last rows before shuffling, as
        Keras does. On a relaxed schedule one Keras step is one run of `steps_per_execution`
        global batches (of each of the plan's pipelines)."""
        self._require_compiled()
        self.runtime.model_may_have_changed()
        refuse_mixed_keras(self.model, "PipelinedModel.fit", "callback", list(callbacks or []))
        verbose = 1 if verbose == "auto" else verbose
        if validation_split and validation_data is None:
            if isinstance(x, tf.data.Dataset):
                raise ValueError("validation_split needs arrays (as in Keras): with a "
                                 "tf.data.Dataset pass validation_data")
            # Keras's split: the last `validation_split` of the rows, before shuffling.
            split_at = int(np.floor(rows(x) * (1.0 - validation_split)))
            head = lambda a: tf.nest.map_structure(lambda v: np.asarray(v)[:split_at], a)
            tail = lambda a: tf.nest.map_structure(lambda v: np.asarray(v)[split_at:], a)
            validation_data = ((tail(x), tail(y)) if sample_weight is None
                               else (tail(x), tail(y), tail(sample_weight)))
            x, y = head(x), head(y)
            sample_weight = None if sample_weight is None else head(sample_weight)
        ds = self._dataset(x, y, batch_size, shuffle, "fit", sample_weight, class_weight)
        self._check_dataset(ds, "fit's data")
        validation = None
        if validation_data is not None:     # checked now, not after a whole epoch of training
            vx, vy, vsw = unpack_validation_data(validation_data)
            self._check_rows(vx, "validation_data")
            validation = self._dataset(vx, vy, None, False, "validation_data", vsw)
        if self._relaxed:                   # one run a Keras step
            ds, steps_per_epoch = self._relaxed.runs_dataset(ds, steps_per_epoch)
        trainer = self._keras_trainer()
        trainer.build_metrics(ds)
        hooks = trainer.callback_list(list(callbacks or []), verbose, epochs,
                                      self._steps(ds, steps_per_epoch))
        history = trainer.fit(ds, epochs=epochs, verbose=verbose, callbacks=hooks, shuffle=False,
                              validation_data=validation, initial_epoch=initial_epoch,
                              steps_per_epoch=steps_per_epoch, validation_freq=validation_freq)
        self.model.history = history
        return history

    @staticmethod
    def _steps(ds, steps_per_epoch) -> Optional[int]:
        if steps_per_epoch is not None:
            return steps_per_epoch
        card = int(ds.cardinality())
        return card if card >= 0 else None

    def predict(self, x, batch_size=None, verbose=0):
        """Forward through the pipeline (no backward) in global batches, by the model's Keras's
        own `predict`; numpy outputs.

        Works before `compile`. A last partial batch is padded to the global batch (by
        repeating its last row) and the padding's outputs dropped, so every row is predicted.
        """
        self.runtime.model_may_have_changed()
        trainer = self._keras_trainer()
        verbose = verbose if self.runtime.is_writer else 0
        if isinstance(x, tf.data.Dataset):
            if batch_size is not None:
                raise ValueError("do not pass batch_size with a tf.data.Dataset")
            self._check_dataset(x, "predict's data")
            return trainer.predict(x, verbose=verbose)
        batch_size = self._batch_size(batch_size)
        n = rows(x)
        if n == 0:
            raise ValueError("predict got no input rows")
        pad = -n % batch_size
        padded = tf.nest.map_structure(
            lambda a: np.concatenate([np.asarray(a), np.repeat(np.asarray(a)[-1:], pad, 0)]), x)
        out = trainer.predict(padded, batch_size=batch_size, verbose=verbose)
        return tf.nest.map_structure(lambda o: o[:n], out)

    def evaluate(self, x, y=None, batch_size=None, verbose=0, sample_weight=None,
                 return_dict=False):
        """Loss and compiled metrics over full global batches, through the pipeline (no
        backward), by the model's Keras's own `evaluate`. Returns what Keras returns: the
        loss, or [loss, metrics...], or a dict."""
        self._require_compiled()
        self.runtime.model_may_have_changed()
        ds = self._dataset(x, y, batch_size, False, "evaluate", sample_weight)
        self._check_dataset(ds, "evaluate's data")
        if int(ds.cardinality()) == 0:
            raise ValueError("evaluate got no full global batch of data")
        trainer = self._keras_trainer()
        trainer.build_metrics(ds)
        return trainer.evaluate(ds, verbose=verbose if self.runtime.is_writer else 0,
                                return_dict=return_dict)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_weights(self, path: str) -> None:
        """The plain model's weights in Keras's format, written atomically (once, under
        horovodrun, after every stage's weights are gathered)."""
        self.runtime.save_weights(self.model, path)

    def load_weights(self, path: str):
        """Keras's `load_weights` into the plain model (so any plan's checkpoint loads)."""
        self.weights_loaded()
        return self.runtime.load_weights(self.model, path)

    @property
    def relaxed_training(self) -> Optional[RelaxedTraining]:
        """A relaxed plan's training once compiled (`dapple.relaxed_training`), else None."""
        return self._relaxed

    def weights_loaded(self) -> None:
        """The model's weights were replaced: a relaxed rule starts afresh from them."""
        if self._relaxed:
            self._relaxed.fresh = True


