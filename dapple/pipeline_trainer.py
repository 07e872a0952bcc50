"""A Keras `Model` whose train, test and predict steps run a `PipelinedModel`'s pipeline, so that
the Keras's own `Model.fit`, `evaluate` and `predict` drive it: every callback, `initial_epoch`,
`validation_split`, `validation_freq`, `steps_per_epoch`, `class_weight`, History and the
progress bar are Keras's. This module holds what the two Keras versions share; the small
per-version part: `dapple.keras3_model` (Keras 3) and `dapple.tf_keras_model` (tf_keras).

* Its one layer is the plain model, so its weights are the plain model's, in the same order
  (`get_weights`/`set_weights`: EarlyStopping's best weights).
* `save_weights` and `save` write the plain model's files, atomically, on the first process
  only (callbacks write after `ProcessCallbacks` gathered every stage's weights);
  `load_weights` is the runtime's.
* Across processes (horovodrun) its callbacks run in a `ProcessCallbacks`: the file-writing
  callbacks and the progress bar on the first process only; every stage's weights gathered
  before the hooks where callbacks read weights; the first process's stop flag, initial epoch
  and (when a callback changed them) weights hold on every process; BackupAndRestore keeps each
  process's own state (its stage's optimizer variables) under `backup_dir/rank{R}`.

The steps are the `PipelinedModel`'s (`pipelined_train`, `pipelined_evaluate`,
`pipelined_predict`): this module only adapts them to Keras's step conventions.
"""
from __future__ import annotations

import functools
import os
from typing import List, Sequence

import tensorflow as tf

from dapple.checkpoint import save_model_atomically, save_weights_atomically
from dapple.eager_build import build_metrics


class Link:
    """What a trainer holds where Keras's attribute tracking does not look."""
    def __init__(self, pipelined):
        self.pipelined = pipelined


def batch_rows(x) -> tf.Tensor:
    return tf.shape(tf.nest.flatten(x)[0])[0]


def one_or_all(outputs: List[tf.Tensor]):
    return outputs[0] if len(outputs) == 1 else outputs


class PipelineSteps:
    """The shared part of a trainer, listed before its Keras's `Model` among the bases.

    A version's trainer sets `keras_api` (its Keras module) and defines `_needs_predictions`
    (compiled metrics or per-output losses read them), `_logs` (the step's logs from its loss and
    predictions) and `_own_backup` (a process's own BackupAndRestore: the callback, and the
    weights files it writes through `save_weights`);
    `_restored_epoch`/`_agreed_epoch` when its Keras reads a restored epoch in
    `on_train_begin`."""

    keras_api = None

    def _link(self, pipelined) -> None:
        self.plain = pipelined.model
        self._dapple = Link(pipelined)
        self._dapple.own_files = ()          # BackupAndRestore's files of this process

    def call(self, x, training=None):
        return self.plain(x, training=training)

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
        x, y, sample_weight = self.keras_api.utils.unpack_x_y_sample_weight(data)
        loss, y_pred, y, sample_weight = self._dapple.pipelined.pipelined_train(
            x, y, sample_weight, predictions=self._needs_predictions())
        return self._logs(x, y, y_pred, sample_weight, loss)

    def test_step(self, data):
        x, y, sample_weight = self.keras_api.utils.unpack_x_y_sample_weight(data)
        loss, y_pred = self._dapple.pipelined.pipelined_evaluate(
            x, y, sample_weight, predictions=self._needs_predictions())
        return self._logs(x, y, y_pred, sample_weight, loss)

    def predict_step(self, data):
        x, _, _ = self.keras_api.utils.unpack_x_y_sample_weight(data)
        return one_or_all(self._dapple.pipelined.pipelined_predict(x))

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

    # ---- files: the plain model's, written once --------------------------------------------
    @property
    def _runtime(self):
        return self._dapple.pipelined.runtime

    # Callbacks write between `ProcessCallbacks`' gathering and agreeing, so a write needs no
    # collective of its own: callbacks given on rank 0 only (Horovod's habit) work too.
    def save_weights(self, filepath, *args, **kwargs):
        filepath = os.fspath(filepath)
        # This process's own BackupAndRestore state: every process writes its own.
        if self._runtime.is_writer or os.path.abspath(filepath) in self._dapple.own_files:
            save_weights_atomically(self.plain, filepath)

    def load_weights(self, filepath, *args, **kwargs):
        filepath = os.fspath(filepath)
        self._dapple.pipelined.weights_loaded()
        if os.path.abspath(filepath) in self._dapple.own_files:
            return self.plain.load_weights(filepath)
        return self._runtime.load_weights(self.plain, filepath)

    def save(self, filepath, *args, save_format=None, **kwargs):
        if self._runtime.is_writer:
            save_model_atomically(self.plain, os.fspath(filepath), save_format=save_format)

    # ---- callbacks -------------------------------------------------------------------------
    def callback_list(self, callbacks: Sequence, verbose: int, epochs: int, steps):
        """Keras's callback list for `fit` on this process (see the module's docstring)."""
        api, runtime = self.keras_api, self._runtime
        mine, own_files = [], []
        for c in callbacks:
            if not runtime.is_writer and isinstance(c, writer_only(api)):
                continue
            if isinstance(c, api.callbacks.BackupAndRestore) and runtime.processes > 1:
                c, files = self._own_backup(c, os.path.join(c.backup_dir,
                                                            f"rank{runtime.rank}"))
                own_files += files
            mine.append(c)
        self._dapple.own_files = tuple(own_files)
        verbose = verbose if runtime.is_writer else 0
        return process_callbacks_class(api)(runtime, mine, add_history=True,
                                            add_progbar=verbose != 0, model=self,
                                            verbose=verbose, epochs=epochs, steps=steps)

    def _restored_epoch(self) -> int:
        """The epoch a callback restored in `on_train_begin` (BackupAndRestore's), else -1."""
        return -1

    def _agreed_epoch(self, epoch: int) -> None:
        """Take the first process's restored epoch (`epoch` >= 0)."""


def writer_only(api) -> tuple:
    """Keras callbacks that write files of their own: one process runs them."""
    return (api.callbacks.TensorBoard, api.callbacks.CSVLogger, api.callbacks.ProgbarLogger)


def never_stop_mid_epoch(api) -> tuple:
    """Keras callbacks whose batch hooks never stop training."""
    c = api.callbacks
    return (c.ModelCheckpoint, c.BackupAndRestore, c.TensorBoard, c.CSVLogger, c.ProgbarLogger,
            c.History, c.EarlyStopping, c.ReduceLROnPlateau, c.LearningRateScheduler)


def saves_by_batch(api, callback) -> bool:
    return (isinstance(callback, (api.callbacks.ModelCheckpoint, api.callbacks.BackupAndRestore))
            and isinstance(callback.save_freq, int))


def overrides(api, callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(api.callbacks.Callback, hook)


def fingerprint(model) -> List[float]:
    """Two sums per variable: changes when a callback sets the weights (as far as checks go)."""
    if not model.variables:
        return []
    sums = tf.stack([s for v in model.variables
                     for s in (tf.reduce_sum(tf.cast(v, tf.float64)),
                               tf.reduce_sum(tf.abs(tf.cast(v, tf.float64))))])
    return sums.numpy().tolist()     # one read back to the host, not one per variable


@functools.lru_cache(maxsize=None)
def process_callbacks_class(api):
    """`ProcessCallbacks` of a Keras module: a subclass of its `CallbackList`."""

    class ProcessCallbacks(api.callbacks.CallbackList):
        """Keras's `CallbackList`, with every process's weights gathered before callbacks read
        them and the first process's decisions (stop, initial epoch, weights) taken by all.
        With one process, gathering and agreeing cost nothing."""

        def __init__(self, runtime, callbacks, **kwargs):
            super().__init__(callbacks, **kwargs)
            self.runtime = runtime
            self.gather_by_batch = any(saves_by_batch(api, c) for c in self.callbacks)
            self.agree_by_batch = any(overrides(api, c, "on_train_batch_end")
                                      and not isinstance(c, never_stop_mid_epoch(api))
                                      for c in self.callbacks)

        def _fingerprint(self) -> List[float]:
            # Only the first process's changes are carried to the others; one needs none.
            if self.runtime.processes > 1 and self.runtime.is_writer:
                return fingerprint(self.model.plain)
            return []

        def _agreeing(self, hook, *more: int) -> List[int]:
            """Runs `hook`; then rank 0's stop flag, its weights if the hook changed them, and
            its values of `more` hold everywhere (returned)."""
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
                self.model._restored_epoch())
            if initial >= 0:
                self.model._agreed_epoch(initial)

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

    return ProcessCallbacks
