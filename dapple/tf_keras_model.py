"""tf_keras's part of `dapple.pipeline_trainer`: the twin of `dapple.keras3_model`, a Keras 2
`Model` (of the plain model's own Keras 2 module: `tf_keras`, or TensorFlow 2.15's `keras`)
whose steps run a `PipelinedModel`'s pipeline, so that tf_keras's own `Model.fit`, `evaluate`
and `predict` drive it.

tf_keras's BackupAndRestore checkpoints the trainer with `tf.train.Checkpoint` (its layer, the
plain model, and its optimizer), not through `save_weights`: under horovodrun each process
writes its own under `backup_dir/rank{R}`, and `fit` starts at the first process's restored
epoch.
"""
from __future__ import annotations

import functools

from dapple.pipeline_trainer import PipelineSteps, batch_rows, one_or_all
from graph_rewrite.keras_adapter import for_model


@functools.lru_cache(maxsize=None)
def trainer_class(api):
    """`PipelineTrainer` of a Keras 2 module: a subclass of its `Model`."""

    class PipelineTrainer(PipelineSteps, api.Model):
        """The plain model as a Keras 2 `Model` whose train, test and predict steps are
        pipelined."""

        keras_api = api

        def __init__(self, pipelined):
            super().__init__(name=pipelined.model.name)
            self._link(pipelined)
            # Kept out of Keras's tracking: not a weight of the model, nor in its checkpoints.
            self._dapple.loss = api.metrics.Mean(name="loss")
            # What Keras 2 names per-output metrics by (at `compile`).
            self.output_names = for_model(self.plain).output_names(self.plain)
            self.built = True

        @property
        def metrics(self):
            """The loss first, as Keras's own (`evaluate` lists them in this order); the
            compiled loss's own total left out: the pipelined step's loss is the one logged."""
            total = getattr(self.compiled_loss, "_total_loss_mean", None)
            return [self._dapple.loss] + [m for m in super().metrics
                                          if m is not self._dapple.loss and m is not total]

        def _output_losses(self) -> bool:
            """Compiled with the model's loss: for `<output>_loss` logs (several outputs)."""
            cl = self.compiled_loss
            return cl is not None and getattr(cl, "_user_losses", None) is not None

        def _needs_predictions(self) -> bool:
            cm = self.compiled_metrics
            return self._output_losses() or (
                cm is not None and bool(getattr(cm, "_user_metrics", None)
                                        or getattr(cm, "_user_weighted_metrics", None)))

        def _logs(self, x, y, y_pred, sample_weight, loss):
            # As Keras's own steps: the loss weighed by the batch's rows, then the metrics.
            self._dapple.loss.update_state(loss, sample_weight=batch_rows(x))
            if y_pred is None:
                return self.get_metrics_result()
            y_pred = one_or_all(y_pred)
            if self._output_losses():
                # tf_keras's own loss container on the global batch's predictions updates
                # its Mean per output (`<output>_loss`, unweighted), as in its step.
                self.compiled_loss(y, y_pred, sample_weight, regularization_losses=[])
            return self.compute_metrics(x, y, y_pred, sample_weight)

        def _own_backup(self, callback, backup_dir):
            return api.callbacks.BackupAndRestore(
                backup_dir, save_freq=callback.save_freq,
                delete_checkpoint=callback.delete_checkpoint,
                save_before_preemption=callback.save_before_preemption), []

        # tf_keras reads BackupAndRestore's epoch after `on_train_begin`, through this.
        def _maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch):
            epoch, step = super()._maybe_load_initial_counters_from_ckpt(steps_per_epoch,
                                                                          initial_epoch)
            epoch, step = self._runtime.from_writer([int(epoch), int(step)])
            return int(epoch), int(step)

    return PipelineTrainer
