"""`PipelinedModel`: a Keras model trained with a Plan, with Keras's own conventions.

    pm = dapple.PipelinedModel(model, plan)          # plan: a Plan or a JSON path
    pm.compile(optimizer, loss, metrics=None, loss_weights=None)
    history = pm.fit(x, y, batch_size=..., epochs=..., callbacks=[...])
    pm.evaluate(x, y); pm.predict(x)
    pm.save_weights(path); pm.load_weights(path)
    grads = pm.gradients(x, y)                       # aligned with model.trainable_variables

The wrapped model keeps its variables: the pipelined step computes their gradients stage by
stage and applies them with the user's optimizer, so the plain model *is* the trained model,
checkpoints are the plain model's (Keras format) and restore into it or into any other plan.

The plan is checked against the model before anything runs: its layer count, its layer names
(when the plan has them), and the model signature of the profile it was made from (when
present). The global batch must be the plan's, and must divide into micro-batches x replicas.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import List, Optional, Union

import numpy as np
import tensorflow as tf

from dapple.devices import local_devices
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.micro_batch import check_divisible
from graph_rewrite.model_graph import layer_order, model_signature
from graph_rewrite.pipeline import LocalTransport, PipelineStep
from planner.plan import Plan, PlanError


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


class PipelinedModel:
    def __init__(self, model: tf.keras.Model, plan: Union[Plan, str], devices=None):
        self.model = model
        self.plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        check_plan_matches_model(self.plan, model)
        self.devices = list(devices) if devices is not None else local_devices(
            max(d for s in self.plan.stages for d in s.devices) + 1)
        self._transport_factory = LocalTransport
        self._loss: Optional[PipelineLoss] = None
        self.optimizer = None
        self._train_fn = self._grad_fn = self._predict_fn = self._eval_fn = None

    # ---- Keras-style API ---------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None, **kwargs):
        if kwargs:
            raise TypeError(f"PipelinedModel.compile does not support {sorted(kwargs)}")
        # The plain model's compile gives us Keras's optimizer and metric conventions.
        self.model.compile(optimizer=optimizer, loss=loss, metrics=metrics,
                           loss_weights=loss_weights)
        self.optimizer = self.model.optimizer
        self._loss = PipelineLoss(loss, self.model.output_names, loss_weights)
        self._step = PipelineStep(self.model, self.plan, self._loss, self.devices,
                                  self._transport_factory)
        self._train_fn = self._grad_fn = self._predict_fn = self._eval_fn = None

    @property
    def global_batch_size(self) -> Optional[int]:
        return self.plan.global_batch_size

    def _require_compiled(self):
        if self._loss is None:
            raise RuntimeError("call compile(optimizer, loss) before training or evaluating")

    def _check_batch(self, n: int) -> None:
        if self.plan.global_batch_size is not None and n != self.plan.global_batch_size:
            raise ValueError(f"batch size {n} differs from the plan's global_batch_size "
                             f"{self.plan.global_batch_size}: the plan (micro-batches, replica "
                             f"slices, memory) was made for that batch; use it or re-plan")
        check_divisible(n, self.plan.micro_batches, [s.replicas for s in self.plan.stages])

    def gradients(self, x, y) -> List[tf.Tensor]:
        """Gradients of the compiled loss on the global batch (x, y), pipelined; for checks."""
        self._require_compiled()
        self._check_batch(int(tf.nest.flatten(x)[0].shape[0]))
        if self._grad_fn is None:
            @tf.function
            def grad_fn(x, y):
                result = self._step.run(x, y)
                return result.loss, result.gradients
            self._grad_fn = grad_fn
        loss, grads = self._grad_fn(x, y)
        return grads

    def _build_train_fn(self):
        @tf.function
        def train_fn(x, y):
            result = self._step.run(x, y)
            pairs = [(g, v) for g, v in zip(result.gradients, self.model.trainable_variables)
                     if g is not None]
            self.optimizer.apply_gradients(pairs)
            y_pred = [tf.concat(p, axis=0) for p in result.predictions]
            self.model.compiled_metrics.update_state(
                y, y_pred[0] if len(y_pred) == 1 else y_pred)
            return result.loss
        return train_fn

    def train_step(self, x, y) -> tf.Tensor:
        """One optimizer step on one global batch; returns the loss."""
        self._require_compiled()
        self._check_batch(int(tf.nest.flatten(x)[0].shape[0]))
        if self._train_fn is None:
            self._train_fn = self._build_train_fn()
        return self._train_fn(x, y)

    def _dataset(self, x, y, batch_size, shuffle):
        if isinstance(x, tf.data.Dataset):
            if y is not None:
                raise ValueError("pass labels inside the tf.data.Dataset, not as y")
            return x
        if batch_size is None:
            batch_size = self.plan.global_batch_size
        if batch_size is None:
            raise ValueError("batch_size is needed: the plan has no global_batch_size")
        self._check_batch(batch_size)
        ds = tf.data.Dataset.from_tensor_slices((x, y) if y is not None else (x,))
        if shuffle:
            n = len(tf.nest.flatten(x)[0])
            ds = ds.shuffle(n, reshuffle_each_iteration=True)
        return ds.batch(batch_size, drop_remainder=True)

    def _metric_logs(self, loss_mean) -> dict:
        logs = {"loss": float(loss_mean.result())}
        for m in self.model.compiled_metrics.metrics:
            logs[m.name] = float(m.result())
        return logs

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            shuffle=True, steps_per_epoch=None, initial_epoch=0):
        self._require_compiled()
        ds = self._dataset(x, y, batch_size, shuffle)
        steps = steps_per_epoch
        if steps is None:
            card = int(ds.cardinality())
            steps = card if card >= 0 else None
        if verbose == "auto":
            verbose = 1
        cbs = tf.keras.callbacks.CallbackList(callbacks, add_history=True,
                                              add_progbar=verbose != 0, model=self.model,
                                              verbose=verbose, epochs=epochs, steps=steps)
        self.model.stop_training = False
        if self._train_fn is None:
            self._train_fn = self._build_train_fn()
        loss_mean = tf.keras.metrics.Mean()
        cbs.on_train_begin()
        logs = {}
        for epoch in range(initial_epoch, epochs):
            loss_mean.reset_state()
            for m in self.model.compiled_metrics.metrics:
                m.reset_state()
            cbs.on_epoch_begin(epoch)
            for step, batch in enumerate(ds):
                if steps is not None and step >= steps:
                    break
                bx, by = batch[0], (batch[1] if len(batch) > 1 else None)
                self._check_batch(int(tf.nest.flatten(bx)[0].shape[0]))
                cbs.on_train_batch_begin(step)
                loss_mean.update_state(self._train_fn(bx, by))
                logs = self._metric_logs(loss_mean)
                cbs.on_train_batch_end(step, logs)
                if self.model.stop_training:
                    break
            cbs.on_epoch_end(epoch, logs)
            if self.model.stop_training:
                break
        cbs.on_train_end(logs)
        return self.model.history

    def predict(self, x, batch_size=None, verbose=0):
        """Forward through the pipeline (no backward), batch by batch; numpy outputs."""
        if self._predict_fn is None:
            @tf.function
            def predict_fn(x):
                result = self._step.run(x, None, training=False)
                return [tf.concat(p, axis=0) for p in result.predictions]
            self._predict_fn = predict_fn
        if not hasattr(self, "_step"):
            raise RuntimeError("call compile() before predict()")
        ds = self._dataset(x, None, batch_size, shuffle=False)
        outs = None
        for (bx,) in ds:
            preds = self._predict_fn(bx)
            outs = [[] for _ in preds] if outs is None else outs
            for acc, p in zip(outs, preds):
                acc.append(p.numpy())
        if outs is None:
            raise ValueError("predict needs at least one full global batch of inputs")
        arrays = [np.concatenate(o) for o in outs]
        return arrays[0] if len(arrays) == 1 else arrays

    def evaluate(self, x, y, batch_size=None, verbose=0, return_dict=False):
        """Loss and compiled metrics over full global batches, through the pipeline."""
        self._require_compiled()
        if self._eval_fn is None:
            @tf.function
            def eval_fn(x, y):
                result = self._step.run(x, y, training=False)
                y_pred = [tf.concat(p, axis=0) for p in result.predictions]
                self.model.compiled_metrics.update_state(
                    y, y_pred[0] if len(y_pred) == 1 else y_pred)
                return result.loss
            self._eval_fn = eval_fn
        eval_fn = self._eval_fn
        loss_mean = tf.keras.metrics.Mean()
        for m in self.model.compiled_metrics.metrics:
            m.reset_state()
        for bx, by in self._dataset(x, y, batch_size, shuffle=False):
            loss_mean.update_state(eval_fn(bx, by))
        logs = self._metric_logs(loss_mean)
        return logs if return_dict else ([logs["loss"]] + [v for k, v in logs.items()
                                                           if k != "loss"] if len(logs) > 1
                                         else logs["loss"])

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_weights(self, path: str) -> None:
        """The plain model's weights in Keras's format, written atomically."""
        save_weights_atomically(self.model, path)

    def load_weights(self, path: str) -> None:
        self.model.load_weights(path)


def save_weights_atomically(model: tf.keras.Model, path: str) -> None:
    """`model.save_weights(path)` with no partial result visible at `path` if it fails.

    HDF5 (`.h5`/`.keras` suffix): one file, written beside and renamed into place. TensorFlow
    format (any other path): the files are written in a temporary directory beside the target
    and renamed into place with the `.index` file last, since TensorFlow reads a checkpoint
    through its index.
    """
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmpdir = tempfile.mkdtemp(dir=parent, prefix=".dapple-ckpt-")
    try:
        base = os.path.basename(path)
        if path.endswith((".h5", ".keras", ".hdf5")):
            tmp = os.path.join(tmpdir, base if not base.endswith(".keras") else base + ".h5")
            model.save_weights(tmp, save_format="h5")
            os.replace(tmp, path)
            return
        model.save_weights(os.path.join(tmpdir, base), save_format="tf")
        names = sorted(os.listdir(tmpdir), key=lambda n: (n.endswith(".index"), n == "checkpoint"))
        for name in names:
            if name == "checkpoint":
                continue    # TF's "latest checkpoint" bookkeeping; rewritten below for `parent`
            os.replace(os.path.join(tmpdir, name), os.path.join(parent, name))
        with open(os.path.join(tmpdir, "checkpoint"), "w") as f:
            f.write(f'model_checkpoint_path: "{base}"\nall_model_checkpoint_paths: "{base}"\n')
        os.replace(os.path.join(tmpdir, "checkpoint"), os.path.join(parent, "checkpoint"))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
