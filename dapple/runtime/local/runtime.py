"""The local runtime: every unit of the plan runs in this process, each on its own device.

Boundaries are moved by `graph_rewrite.local_transport`; there is one copy of every variable,
so the gradients, predictions and weights this process holds are already the whole model's.
"""
from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from dapple.checkpoint import save_weights_atomically
from dapple.devices import local_devices
from dapple.runtime.base import Runtime, apply_present, unscaled
from dapple.runtime.local.copying_step import CopyingStep
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.model_graph import StageGraph
from graph_rewrite.pipeline import PipelineStep, StepResult
from graph_rewrite.relaxed_step import relaxed
from planner.formats.plan import Plan


class LocalRuntime(Runtime):
    rank = 0
    stage = replica = None
    shuffle_seed = None             # fit shuffles with a fresh seed, as Keras does

    def __init__(self, plan: Plan, devices=None, stages: Optional[List[StageGraph]] = None):
        self.stages = stages
        self.devices = list(devices) if devices is not None else local_devices(
            max(d for s in plan.stages for d in s.devices) + 1)

    def make_step(self, model: tf.keras.Model, plan: Plan, loss: Optional[PipelineLoss],
                  micro_batch_loop: bool = False, pipeline_loop: bool = False,
                  inline_stage_calls: Optional[bool] = None) -> PipelineStep:
        # A looped pipeline reads its weights every iteration: beside each unit, as copies.
        step_class = CopyingStep if pipeline_loop and len(plan.stages) > 1 else PipelineStep
        return self._step(step_class, model, plan, loss, micro_batch_loop, pipeline_loop,
                          inline_stage_calls)

    def _step(self, step_class, model: tf.keras.Model, plan: Plan,
              loss: Optional[PipelineLoss], micro_batch_loop: bool,
              pipeline_loop: bool, inline_stage_calls: Optional[bool] = None) -> PipelineStep:
        """A `step_class` (`PipelineStep` or a subclass) on this runtime's devices."""
        return step_class(model, plan, loss, self.devices, stages=self.stages,
                          micro_batch_loop=micro_batch_loop, pipeline_loop=pipeline_loop,
                          inline_stage_calls=self.inlined(inline_stage_calls))

    def make_relaxed_step(self, model: tf.keras.Model, plan: Plan, loss: PipelineLoss,
                          max_batches: int, pipeline_loop: bool = False) -> PipelineStep:
        # The model's own variables, no working copies: a relaxed run updates them as it goes.
        return relaxed(PipelineStep)(model, plan, loss, self.devices, stages=self.stages,
                                     max_batches=max_batches, pipeline_loop=pipeline_loop)

    def compiled(self, what: str, fn):
        return fn

    def apply_gradients(self, step: PipelineStep, optimizer, result: StepResult) -> None:
        apply_present(optimizer, unscaled(optimizer, result.gradients),
                      step.model.trainable_variables)

    def predictions(self, step: PipelineStep, result: StepResult) -> List[tf.Tensor]:
        return [tf.concat(p, axis=0) for p in result.predictions]

    def gather_weights(self) -> None:
        """Nothing to gather: the model's variables are the ones trained."""

    def save_weights(self, model: tf.keras.Model, path: str) -> None:
        save_weights_atomically(model, path)

    def load_weights(self, model: tf.keras.Model, path: str):
        return model.load_weights(path)
