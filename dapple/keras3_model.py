"""Keras 3's part of `dapple.pipeline_trainer`: `PipelineTrainer`, a `keras.Model` whose steps
run a `PipelinedModel`'s pipeline, so that Keras 3's own `Model.fit`, `evaluate` and `predict`
drive it. A Keras 3 `.weights.h5` holds the optimizer's variables too, so BackupAndRestore
(which saves through `save_weights`) resumes the optimizer; under horovodrun each process's
own backup file is written and read by that process.
"""
from __future__ import annotations

import os

import keras

from dapple.pipeline_trainer import PipelineSteps, batch_rows, one_or_all
from graph_rewrite.keras_adapter import for_model


class PipelineTrainer(PipelineSteps, keras.Model):
    """The plain model as a `keras.Model` whose train, test and predict steps are pipelined."""

    keras_api = keras

    def __init__(self, pipelined):
        super().__init__(name=pipelined.model.name)
        self._link(pipelined)
        self.built = True

    @property
    def output_names(self):
        """The plain model's (what Keras names per-output metrics by)."""
        return for_model(self.plain).output_names(self.plain)

    def _needs_predictions(self) -> bool:
        return self._compile_metrics is not None or self._compile_loss is not None

    def _logs(self, x, y, y_pred, sample_weight, loss):
        # As Keras's own steps: the loss weighed by the batch's rows, then the compiled metrics.
        self._loss_tracker.update_state(loss, sample_weight=batch_rows(x))
        if y_pred is None:
            return self.get_metrics_result()
        y_pred = one_or_all(y_pred)
        if self._compile_loss is not None:
            # Keras's own CompileLoss on the global batch's predictions updates its Mean per
            # output (`<output>_loss`, unweighted), as in Keras's step; its total is the
            # pipelined step's loss, already counted above.
            self._compile_loss(y, y_pred, sample_weight)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _own_backup(self, callback, backup_dir):
        own = keras.callbacks.BackupAndRestore(
            backup_dir, save_freq=callback.save_freq,
            double_checkpoint=callback.double_checkpoint,
            delete_checkpoint=callback.delete_checkpoint)
        weights = os.path.abspath(os.path.join(backup_dir, "latest.weights.h5"))
        return own, [weights, weights + ".bkp"]

    # Keras 3's BackupAndRestore sets the epoch `fit` starts at in `on_train_begin`.
    def _restored_epoch(self) -> int:
        return -1 if getattr(self, "_initial_epoch", None) is None else self._initial_epoch

    def _agreed_epoch(self, epoch: int) -> None:
        self._initial_epoch = epoch
