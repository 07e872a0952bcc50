"""A Keras 3 `keras.Model` whose steps run a `PipelinedModel`'s pipeline, so that Keras 3's own
`Model.fit`, `evaluate` and `predict` drive it: every callback, `initial_epoch`,
`validation_freq`, `steps_per_epoch`, History and the progress bar are Keras's.

* Its one layer is the plain model, so its weights are the plain model's, in the same order
  (`get_weights`/`set_weights`: EarlyStopping's best weights).
* `save_weights` and `save` write the plain model's files, atomically, on the first process
  only (callbacks write after `ProcessCallbacks` gathered every stage's weights);
  `load_weights` is the runtime's. A Keras 3 `.weights.h5` holds the optimizer's variables too,
  so BackupAndRestore resumes the optimizer.
* Across processes (horovodrun) its callbacks run in a `ProcessCallbacks`: the file-writing
  callbacks and the progress bar on the first process only; every stage's weights gathered
  before the hooks where callbacks read weights; the first process's stop flag, initial epoch
  and (when a callback changed them) weights hold on every process; BackupAndRestore keeps each
  process's own state (its stage's optimizer variables) under `backup_dir/rank{R}`.

The steps are the `PipelinedModel`'s (`pipelined_train`, `pipelined_evaluate`,
`pipelined_predict`): this module only adapts them to Keras's step conventions.
"""
from __future__ import annotations

import os
from typing import List, Sequence

import keras
import tensorflow as tf

from dapple.callbacks import fingerprint
from dapple.checkpoint import save_model_atomically, save_weights_atomically
from dapple.eager_build import build_metrics
from graph_rewrite.keras_adapter import for_model


class _Link:
    """The `PipelinedModel`, held where Keras's attribute tracking does not look."""
    def __init__(self, pipelined):
        self.pipelined = pipelined


def _rows(x) -> tf.Tensor:
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _one_or_all(outputs: List[tf.Tensor]):
    return outputs[0] if len(outputs) == 1 else outputs


class PipelineTrainer(keras.Model):
    """The plain model as a `keras.Model` whose train, test and predict steps are pipelined."""

    def __init__(self, pipelined):
        super().__init__(name=pipelined.model.name)
        self.plain = pipelined.model
        self._dapple = _Link(pipelined)
        self._own_files: List[str] = []       # BackupAndRestore's files of this process
        self.built = True

    def call(self, x, training=None):
        return self.plain(x, training=training)

    @property
    def output_names(self):
        """The plain model's (what Keras names per-output metrics by)."""
        return for_model(self.plain).output_names(self.plain)

    def build_metrics(self, dataset: tf.data.Dataset) -> None:
        """The compiled metrics' variables made before Keras traces a step (else TensorFlow
        traces the step, the whole pipeline, twice), from the labels `dataset` yields."""
        spec = dataset.element_spec
        if isinstance(spec, tuple) and len(spec) > 1:
            labels = tf.nest.map_structure(
                lambda s: tf.zeros([1 if d is None else d for d in s.shape], s.dtype), spec[1])
            build_metrics(self, labels, outputs=self.plain.outputs)

    # ---- steps -----------------------------------------------------------------------------
    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, y_pred, y, sample_weight = self._dapple.pipelined.pipelined_train(
            x, y, sample_weight, predictions=self._needs_predictions)
        return self._logs(x, y, y_pred, sample_weight, loss)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, y_pred = self._dapple.pipelined.pipelined_evaluate(
            x, y, sample_weight, predictions=self._needs_predictions)
        return self._logs(x, y, y_pred, sample_weight, loss)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return _one_or_all(self._dapple.pipelined.pipelined_predict(x))

    # Keras makes its step functions (a `tf.function` over the steps above) once; the
    # runtime's `compiled` wraps each call (under horovodrun: its watchdog).
    def make_train_function(self, force=False):
        if self.train_function is None or force:
            relaxed = self._dapple.pipelined.relaxed_training
            if relaxed is None:
                super().make_train_function(force=True)
                self.train_function = self._runtime.compiled("train step", self.train_function)
            else:
                self.train_function = self._runs_function(relaxed)
        return self.train_function

    def _runs_function(self, relaxed):
        """A relaxed plan's train function: one run a dataset element, traced for the run's
        number of global batches (a shorter last run once more), which its schedule is built
        for; Keras's own would trace once with the rows unknown."""
        step = self._runtime.compiled("relaxed train step", tf.function(self.train_step))

        def function(iterator):
            data = next(iterator)
            relaxed.prepare()           # eagerly: optimizers built, the rule afresh when due
            return step(data)
        return function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            super().make_test_function(force=True)
            self.test_function = self._runtime.compiled("evaluate step", self.test_function)
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            super().make_predict_function(force=True)
            self.predict_function = self._runtime.compiled("predict step",
                                                           self.predict_function)
        return self.predict_function

    @property
    def _needs_predictions(self) -> bool:
        return self._compile_metrics is not None or self._compile_loss is not None

    def _logs(self, x, y, y_pred, sample_weight, loss):
        # As Keras's own steps: the loss weighed by the batch's rows, then the compiled metrics.
        self._loss_tracker.update_state(loss, sample_weight=_rows(x))
        if y_pred is None:
            return self.get_metrics_result()
        y_pred = _one_or_all(y_pred)
        if self._compile_loss is not None:
            # Keras's own CompileLoss on the global batch's predictions updates its Mean per
            # output (`<output>_loss`, unweighted), as in Keras's step; its total is the
            # pipelined step's loss, already counted above.
            self._compile_loss(y, y_pred, sample_weight)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ---- files: the plain model's, written once --------------------------------------------
    @property
    def _runtime(self):
        return self._dapple.pipelined.runtime

    # Callbacks write between `ProcessCallbacks`' gathering and agreeing, so a write needs no
    # collective of its own: callbacks given on rank 0 only (Horovod's habit) work too.
    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        filepath = os.fspath(filepath)
        # This process's own BackupAndRestore state: every process writes its own.
        if self._runtime.is_writer or os.path.abspath(filepath) in self._own_files:
            save_weights_atomically(self.plain, filepath)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        filepath = os.fspath(filepath)
        self._dapple.pipelined.weights_loaded()
        if os.path.abspath(filepath) in self._own_files:
            return self.plain.load_weights(filepath)
        return self._runtime.load_weights(self.plain, filepath)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        if self._runtime.is_writer:
            save_model_atomically(self.plain, filepath)

    # ---- callbacks -------------------------------------------------------------------------
    def callback_list(self, callbacks: Sequence, verbose: int, epochs: int, steps):
        """Keras's callback list for `fit` on this process (see the module's docstring)."""
        runtime = self._runtime
        mine, self._own_files = [], []
        for c in callbacks:
            if not runtime.is_writer and isinstance(c, WRITER_ONLY):
                continue
            if isinstance(c, keras.callbacks.BackupAndRestore) and runtime.processes > 1:
                c = keras.callbacks.BackupAndRestore(
                    os.path.join(c.backup_dir, f"rank{runtime.rank}"), save_freq=c.save_freq,
                    double_checkpoint=c.double_checkpoint,
                    delete_checkpoint=c.delete_checkpoint)
                weights = os.path.abspath(os.path.join(c.backup_dir, "latest.weights.h5"))
                self._own_files += [weights, weights + ".bkp"]
            mine.append(c)
        verbose = verbose if runtime.is_writer else 0
        return ProcessCallbacks(runtime, mine, add_history=True, add_progbar=verbose != 0,
                                model=self, verbose=verbose, epochs=epochs, steps=steps)


WRITER_ONLY = (keras.callbacks.TensorBoard, keras.callbacks.CSVLogger,
               keras.callbacks.ProgbarLogger)
NEVER_STOP_MID_EPOCH = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore,
                        keras.callbacks.TensorBoard, keras.callbacks.CSVLogger,
                        keras.callbacks.ProgbarLogger, keras.callbacks.History,
                        keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau,
                        keras.callbacks.LearningRateScheduler)


def _saves_by_batch(callback) -> bool:
    return (isinstance(callback, (keras.callbacks.ModelCheckpoint,
                                  keras.callbacks.BackupAndRestore))
            and isinstance(callback.save_freq, int))


def _overrides(callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook)


class ProcessCallbacks(keras.callbacks.CallbackList):
    """Keras's `CallbackList`, with every process's weights gathered before callbacks read
    them and the first process's decisions (stop, initial epoch, weights) taken by all.
    With one process, gathering and agreeing cost nothing."""

    def __init__(self, runtime, callbacks, **kwargs):
        super().__init__(callbacks, **kwargs)
        self.runtime = runtime
        self.gather_by_batch = any(_saves_by_batch(c) for c in self.callbacks)
        self.agree_by_batch = any(_overrides(c, "on_train_batch_end")
                                  and not isinstance(c, NEVER_STOP_MID_EPOCH)
                                  for c in self.callbacks)

    def _fingerprint(self) -> List[float]:
        # Only the first process's changes are carried to the others; one process needs none.
        if self.runtime.processes > 1 and self.runtime.is_writer:
            return fingerprint(self.model.plain)
        return []

    def _agreeing(self, hook, *more: int) -> List[int]:
        """Runs `hook`; then rank 0's stop flag, its weights if the hook changed them, and its
        values of `more` hold everywhere (returned)."""
        before = self._fingerprint()
        hook()
        got = self.runtime.from_writer([bool(self.model.stop_training),
                                        int(self._fingerprint() != before), *more])
        self.model.stop_training = bool(got[0])
        if got[1]:
            self.runtime.broadcast_model(self.model.plain)
        return got[2:]

    def on_train_begin(self, logs=None):
        self.gather_by_batch, self.agree_by_batch, initial = self._agreeing(
            lambda: super(ProcessCallbacks, self).on_train_begin(logs),
            int(self.gather_by_batch), int(self.agree_by_batch),
            # BackupAndRestore's epoch to start at, which Keras's `fit` reads after this hook
            -1 if getattr(self.model, "_initial_epoch", None) is None
            else self.model._initial_epoch)
        if initial >= 0:
            self.model._initial_epoch = initial

    def on_train_batch_end(self, batch, logs=None):
        if self.gather_by_batch:
            self.runtime.gather_weights()
        super().on_train_batch_end(batch, logs)
        if self.agree_by_batch:
            self.model.stop_training = bool(self.runtime.from_writer(
                [bool(self.model.stop_training)])[0])

    def on_epoch_end(self, epoch, logs=None):
        self.runtime.gather_weights()
        self._agreeing(lambda: super(ProcessCallbacks, self).on_epoch_end(epoch, logs))

    def on_train_end(self, logs=None):
        self.runtime.gather_weights()
        self._agreeing(lambda: super(ProcessCallbacks, self).on_train_end(logs))
