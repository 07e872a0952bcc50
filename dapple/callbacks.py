"""What the callbacks of `fit` on a relaxed schedule (dapple's own loop, Keras 2 models) see,
on every runtime: the whole model, and one writer. (Every other `fit` is its Keras's own, with
the same rules: `dapple.pipeline_trainer`.)

Under horovodrun each rank trains only its stage, so the plain model a rank holds is stale
elsewhere; and every rank runs the same script, so every rank would write the same files.
Here, whatever the runtime:

* Callbacks get a `CallbackModel`: a Keras model over the plain model's own layers (its
  variables are the plain model's), whose `save_weights` and `save` write the plain model's
  file, atomically, from the first process only (`Runtime.is_writer`).
* Before the hooks where callbacks read weights (epoch end, train end, and batch end when a
  callback saves by batch), every stage's weights are gathered to every process.
* After the hooks where callbacks may restore weights or stop (train begin: BackupAndRestore;
  epoch end and train end: EarlyStopping; batch end when a callback may stop mid-epoch), the
  first process's decisions hold everywhere: its stop flag, its initial epoch and, when it
  changed them, its weights. So callbacks given on rank 0 only (Horovod's habit) work as
  callbacks given on every rank.
* Callbacks that write their own files (TensorBoard, CSVLogger) and the progress bar run on the
  first process only; BackupAndRestore keeps each process's own training state (its stage's
  optimizer slots) under `backup_dir/rank{R}`.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Sequence

import tensorflow as tf

from dapple.checkpoint import save_model_atomically, save_weights_atomically
from dapple.pipeline_trainer import (fingerprint, never_stop_mid_epoch, overrides,
                                     saves_by_batch, writer_only)
from graph_rewrite.keras_adapter import keras2_module_of

# The Keras 2 callbacks are those of the model's own Keras 2 module (`tf_keras`, or TensorFlow
# 2.15's `keras`), whatever `tf.keras` is: `api` below is that module.


class _Link:
    """The plain model and the runtime, held where Keras's attribute tracking does not look."""
    def __init__(self, model, runtime):
        self.model, self.runtime = model, runtime


@functools.lru_cache(maxsize=None)
def callback_model_class(api):
    """`CallbackModel` of a Keras 2 module: a subclass of its `Model`."""

    class CallbackModel(api.Model):
        """The plain model's layers as callbacks' `self.model`; writes go through dapple."""

        def __init__(self, model, runtime):
            super().__init__(model.input, model.output, name=model.name)
            self._dapple = _Link(model, runtime)
            self.optimizer = model.optimizer        # LearningRateScheduler, BackupAndRestore

        def save_weights(self, filepath, overwrite=True, save_format=None, options=None):
            if self._dapple.runtime.is_writer:
                save_weights_atomically(self._dapple.model, filepath)

        def save(self, filepath, overwrite=True, save_format=None, **kwargs):
            if self._dapple.runtime.is_writer:
                save_model_atomically(self._dapple.model, filepath, save_format=save_format)

    return CallbackModel


class FitCallbacks:
    """`fit`'s callback hooks with the gathering and agreeing above around them."""

    def __init__(self, model: tf.keras.Model, runtime, callbacks: Sequence,
                 verbose: int, epochs: int, steps: Optional[int],
                 stateful_metrics: Sequence[str]):
        self.runtime = runtime
        api = keras2_module_of(model)
        callbacks_api = api.callbacks
        self.view = callback_model_class(api)(model, runtime)
        mine = [c for c in callbacks if runtime.is_writer or not isinstance(c, writer_only(api))]
        for c in mine:
            if isinstance(c, callbacks_api.BackupAndRestore) and runtime.processes > 1:
                c.backup_dir = os.path.join(c.backup_dir, f"rank{runtime.rank}")
        verbose = verbose if runtime.is_writer else 0
        if verbose and not any(isinstance(c, callbacks_api.ProgbarLogger) for c in mine):
            # Our "loss" and metrics are running means already: the bar must not average them.
            mine.insert(0, callbacks_api.ProgbarLogger(
                count_mode="steps", stateful_metrics=list(stateful_metrics)))
        self.list = callbacks_api.CallbackList(mine, add_history=True, add_progbar=False,
                                               model=self.view, verbose=verbose,
                                               epochs=epochs, steps=steps)
        self.view.stop_training = False
        self.gather_by_batch = any(saves_by_batch(api, c) for c in mine)
        self.agree_by_batch = any(overrides(api, c, "on_train_batch_end")
                                  and not isinstance(c, never_stop_mid_epoch(api)) for c in mine)

    @property
    def history(self):
        return self.view.history

    @property
    def stop_training(self) -> bool:
        return bool(self.view.stop_training)

    def train_begin(self, initial_epoch: int, steps: Optional[int]) -> int:
        """Runs on_train_begin; returns the epoch to start at (BackupAndRestore's, if any)."""
        before = self._fingerprint()
        self.list.on_train_begin()
        state = getattr(self.view, "_training_state", None)    # BackupAndRestore's
        if state is not None:
            initial_epoch, _ = state.maybe_load_initial_counters_from_ckpt(
                steps, initial_epoch, "train")
        first = self.runtime.from_writer([initial_epoch, int(self.gather_by_batch),
                                          int(self.agree_by_batch),
                                          int(self._fingerprint() != before)])
        initial_epoch, self.gather_by_batch, self.agree_by_batch = first[0], first[1], first[2]
        if first[3]:
            self.runtime.broadcast_model(self.view)
        return initial_epoch

    def epoch_begin(self, epoch: int) -> None:
        self.list.on_epoch_begin(epoch)

    def batch_begin(self, step: int) -> None:
        self.list.on_train_batch_begin(step)

    def batch_end(self, step: int, logs: dict) -> None:
        if self.gather_by_batch:
            self.runtime.gather_weights()
        self.list.on_train_batch_end(step, logs)
        if self.agree_by_batch:
            self.view.stop_training = bool(self.runtime.from_writer([self.stop_training])[0])

    def epoch_end(self, epoch: int, logs: dict) -> None:
        self._reading_and_agreeing(lambda: self.list.on_epoch_end(epoch, logs))

    def train_end(self, logs: dict) -> None:
        self._reading_and_agreeing(lambda: self.list.on_train_end(logs))

    def _reading_and_agreeing(self, hook) -> None:
        self.runtime.gather_weights()
        before = self._fingerprint()
        hook()
        stop, changed = self.runtime.from_writer([self.stop_training,
                                                  int(self._fingerprint() != before)])
        self.view.stop_training = bool(stop)
        if changed:
            self.runtime.broadcast_model(self.view)

    def _fingerprint(self) -> List[float]:
        # Only the first process's changes are carried to the others; one process needs none.
        if self.runtime.processes > 1 and self.runtime.is_writer:
            return fingerprint(self.view)
        return []
