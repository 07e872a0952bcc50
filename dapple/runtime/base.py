"""What a `PipelinedModel` delegates to where its step runs: the `Runtime` interface.

`PipelinedModel` is the same Keras-facing object everywhere and runs the same actions (build the
step, trace it, apply the gradients, gather predictions, write checkpoints); a runtime holds
only what differs between running every unit in this process (`dapple.runtime.local`), one
unit per Horovod rank (`dapple.runtime.horovod`) or every unit on a TensorFlow cluster's tasks
(`dapple.runtime.tf_cluster`). `PipelinedModel` picks one when it is made (`choice`).
Runtimes never import `dapple.pipelined_model`: dependencies point one way.
"""
from __future__ import annotations

import abc
from typing import Callable, List, Optional

import tensorflow as tf

from dapple.eager_build import build_optimizer
from graph_rewrite import keras_adapter
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.model_graph import StageGraph
from graph_rewrite.pipeline import PipelineStep, StepResult
from planner.formats.plan import Plan


class Runtime(abc.ABC):
    rank: int                       # this process's Horovod rank; 0 locally
    stage: Optional[int]            # the unit this process runs; None locally (it runs all)
    replica: Optional[int]
    devices: List[str]              # by plan device id
    shuffle_seed: Optional[int]     # fit's shuffle seed (one for all ranks under Horovod)
    stages: Optional[List[StageGraph]]  # the model cut by the plan, once (`choice`)
    # Whether a pipeline's steady periods loop by default (`PipelinedModel(pipeline_loop=None)`).
    # In one process a loop costs nothing per step; across processes each iteration coordinates
    # the processes (docs/runtime.md, "Which steps loop by default").
    loops_pipelines: bool = True
    # Whether an unrolled step's stage calls are inlined into it by default
    # (`inline_stage_calls=None`): in one process they stay calls, so the first call stays
    # short; across processes the inlined steady step measured faster (docs/runtime.md,
    # "Inlined stage calls").
    inlines_stage_calls: bool = False

    def inlined(self, inline_stage_calls: Optional[bool]) -> bool:
        """Whether a step's stage calls are inlined: as asked, else this runtime's default."""
        return self.inlines_stage_calls if inline_stage_calls is None else inline_stage_calls

    @abc.abstractmethod
    def make_step(self, model: tf.keras.Model, plan: Plan, loss: Optional[PipelineLoss],
                  micro_batch_loop: bool = False, pipeline_loop: bool = False,
                  inline_stage_calls: Optional[bool] = None) -> PipelineStep:
        """The pipelined step of the units this process runs (`loss=None`: forward only);
        `micro_batch_loop`: a data-parallel plan's lanes as loops; `pipeline_loop`: a
        pipeline's steady periods as loops (locally and under Horovod); `inline_stage_calls`:
        the stage calls of an unrolled step inlined into it (None: the runtime's default)."""

    @abc.abstractmethod
    def make_relaxed_step(self, model: tf.keras.Model, plan: Plan, loss: PipelineLoss,
                          max_batches: int, pipeline_loop: bool = False) -> PipelineStep:
        """The step of a relaxed plan's runs (`graph_rewrite.relaxed_step`), with weight copies
        for runs of up to `max_batches` steps; `pipeline_loop`: their periodic parts as loops
        (`graph_rewrite.schedule_loop`)."""

    @abc.abstractmethod
    def compiled(self, what: str, fn: Callable) -> Callable:
        """The compiled step function `fn` as it is to be called (`what` names it)."""

    @abc.abstractmethod
    def apply_gradients(self, step: PipelineStep, optimizer, result: StepResult) -> None:
        """Give the step's gradients (`result.gradients`, aligned with the model's trainable
        variables) to the optimizer as it would get them for the plain model on one process."""

    def prepare_optimizer(self, step: PipelineStep, optimizer) -> None:
        """Create the optimizer's variables before the step is traced: a `tf.function` that
        creates variables on its first call is traced twice (the whole pipeline twice)."""
        build_optimizer(optimizer, step.trained_variables())

    @abc.abstractmethod
    def predictions(self, step: PipelineStep, result: StepResult) -> List[tf.Tensor]:
        """Every output's predictions for the whole global batch, in row order."""

    @abc.abstractmethod
    def gather_weights(self) -> None:
        """Make this process's copy of every model variable current."""

    @property
    def processes(self) -> int:
        """How many processes run the step (1 locally)."""
        return 1

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the files (checkpoints, logs): the first one."""
        return self.rank == 0

    def from_writer(self, values: List[int]) -> List[int]:
        """The writing process's `values` (small integers), on every process."""
        return [int(v) for v in values]

    def broadcast_model(self, model: tf.keras.Model) -> None:
        """Every process's copy of `model`'s variables becomes the writing process's."""

    def model_may_have_changed(self) -> None:
        """The user's code ran since the last step and may have changed the model's variables
        (`PipelinedModel` says so at the start of every call that runs a step)."""

    @abc.abstractmethod
    def save_weights(self, model: tf.keras.Model, path: str) -> None:
        """The plain model's checkpoint with every stage's variables, written once."""

    @abc.abstractmethod
    def load_weights(self, model: tf.keras.Model, path: str):
        """Keras's `load_weights` into the plain model, on every process."""


def loss_scale(optimizer) -> Optional[tf.Tensor]:
    """The optimizer's current loss scale under mixed precision (what its Keras's trainer
    multiplies the loss by), else None."""
    return keras_adapter.for_model(optimizer).loss_scale(optimizer)


def unscaled(optimizer, gradients: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
    """The accumulated gradients as the optimizer's Keras gives them to `apply_gradients`:
    unscaled once (Keras 2), or still scaled (Keras 3's optimizer unscales them itself)."""
    return keras_adapter.for_model(optimizer).unscaled(optimizer, gradients)


def scale_left_in(optimizer) -> Optional[tf.Tensor]:
    """The loss scale `unscaled`'s gradients still carry (Keras 3's), else None."""
    if keras_adapter.for_model(optimizer).unscales_in_apply:
        return loss_scale(optimizer)
    return None


def apply_present(optimizer, gradients: List[Optional[tf.Tensor]], variables) -> None:
    """One `apply_gradients` of the gradients that are not None, with their variables."""
    optimizer.apply_gradients([(g, v) for g, v in zip(gradients, variables) if g is not None])


def global_clipnorm(optimizer) -> Optional[float]:
    """The optimizer's `global_clipnorm` (the inner optimizer's under mixed precision)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    clip = getattr(inner, "global_clipnorm", None)
    return float(clip) if clip else None
