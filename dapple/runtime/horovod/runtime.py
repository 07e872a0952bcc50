"""The Horovod runtime: one process (rank) per plan device, same API, same results.

`dapple.PipelinedModel(model, plan)` runs on it when the process was started by horovodrun or
Horovod is initialized (or with `runtime="horovod"`). Every rank runs the same user script and
`PipelinedModel`'s same actions; rank r runs plan device r (`dapple.runtime.horovod.ranks`):

* Horovod is initialized with the plan's process sets (or they are added, if the user called
  `hvd.init()` first, which needs `HOROVOD_DYNAMIC_PROCESS_SETS=1`; `dapple launch` sets it).
* All ranks start from rank 0's weights (a broadcast), so every stage and replica starts where
  the plain model on rank 0 starts.
* Each rank builds only its own (stage, replica) unit and runs its stage's task list; Horovod
  moves boundaries and sums replica gradients (`dapple.runtime.horovod.transport`). The optimizer
  updates only this rank's stage; the other stages' variables on this rank are left stale until
  `save_weights` gathers them.
* `fit` shuffles with a seed shared by all ranks, so every rank sees the same global batches.
* The optimizer sees what it would see on one process: a variable shared by several stages
  gets the sum of their gradients on every rank that holds it; under mixed precision a
  non-finite gradient on any rank makes every rank skip the step and lower its loss scale
  (one allreduce of a flag); `global_clipnorm` clips by the norm of the whole model's gradient
  (one allreduce of squared norms, each variable counted once); a rank whose stage has no
  trainable variables still steps its optimizer (iterations, loss scale) on a placeholder.
* Loss, compiled metrics, `evaluate` and `predict` give every rank the global batch's values:
  the loss is summed over ranks, and the last stage's predictions are allgathered (one
  collective per output per step, only when metrics are compiled for training).
* `save_weights`: every stage's first rank broadcasts its stage's variables, rank 0 writes the
  plain model's Keras checkpoint once and atomically, and all ranks wait for it. It restores into
  the plain model or any plan (`load_weights`: rank 0 reads, then broadcasts).
* Failures: an exception prints `dapple: rank R (stage s, replica k) failed: ...` and exits
  non-zero, and horovodrun ends the other ranks; a step that stalls beyond the watchdog's
  deadline ends the rank (`dapple.runtime.horovod.watchdog`).
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import List, Optional

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from dapple.checkpoint import save_weights_atomically
from dapple.eager_build import build_optimizer
from dapple.runtime.base import (Runtime, apply_present, global_clipnorm, loss_scale,
                                 scale_left_in, unscaled)
from dapple.runtime.horovod.ranks import RankLayout, WorldSizeError
from dapple.runtime.horovod.transport import (HorovodPipelineStep, init_horovod,
                                             pin_gpu_to_local_rank, rank_device,
                                             shared_stage_groups)
from dapple.runtime.horovod.watchdog import StepWatchdog
from graph_rewrite.keras_adapter import tf_variables
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.model_graph import StageGraph
from graph_rewrite.pipeline import StepResult
from graph_rewrite.relaxed_step import relaxed
from planner.formats.plan import Plan


LOG_RANKS = "DAPPLE_LOG_RANKS"     # "all": every rank logs warnings, not only rank 0


def _world_size_from_env() -> Optional[int]:
    for name in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def _install_failure_report(who: str) -> None:
    """Name the rank in the report of an uncaught exception (horovodrun then ends the job)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        sys.stderr.write(f"dapple: {who} failed: {kind.__name__}: {value}\n")
        sys.stderr.flush()
        previous(kind, value, tb)

    sys.excepthook = hook


class HorovodRuntime(Runtime):
    loops_pipelines = False     # a loop's iterations run one at a time, each its transfers
    # Out of line the same step measured 1.06-1.44x as long (docs/runtime.md, "Inlined stage
    # calls"), and inlined, a data-parallel rank at M = 1 starts its gradients' groups during
    # the backward.
    inlines_stage_calls = True

    def __init__(self, model: tf.keras.Model, plan: Plan, stages: List[StageGraph],
                 devices=None):
        size = hvd.size() if hvd.is_initialized() else _world_size_from_env()
        self.layout = RankLayout(plan, size if size is not None else plan.num_devices)
        if not hvd.is_initialized():
            pin_gpu_to_local_rank()
        self.stages = stages
        self.process_sets = init_horovod(
            self.layout.process_sets(shared_stage_groups(self.stages)))
        if hvd.size() != self.layout.size:
            raise WorldSizeError(f"the plan uses {self.layout.size} devices but Horovod runs "
                                 f"{hvd.size()} processes")
        self.rank = hvd.rank()
        self.stage, self.replica = self.layout.unit(self.rank)
        self.who = f"rank {self.rank} (stage {self.stage}, replica {self.replica})"
        _install_failure_report(self.who)
        if self.rank != 0 and os.environ.get(LOG_RANKS) != "all":
            # One rank speaks: the others' warnings repeat rank 0's (errors still show).
            logging.getLogger().setLevel(logging.ERROR)
            tf.get_logger().setLevel(logging.ERROR)
        self.device = devices[0] if devices else rank_device(hvd.local_rank())
        # Every plan device id of this process's step names this rank's one device.
        self.devices = [self.device] * plan.num_devices
        self.watchdog = StepWatchdog(self.who)
        self._placeholder = None
        self._traced = set()
        with self.watchdog.step("broadcasting rank 0's initial weights", first=True):
            hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)
        # One shuffle seed for all ranks: every rank must see the same global batches.
        seed = hvd.broadcast(tf.constant(np.random.randint(0, 2**31 - 1), tf.int64), 0,
                             name="dapple.shuffle_seed")
        self.shuffle_seed = int(seed)

    def make_step(self, model: tf.keras.Model, plan: Plan, loss: Optional[PipelineLoss],
                  micro_batch_loop: bool = False, pipeline_loop: bool = False,
                  inline_stage_calls: Optional[bool] = None) -> HorovodPipelineStep:
        return HorovodPipelineStep(model, plan, loss, self.device, self.process_sets,
                                   self.layout, stages=self.stages,
                                   micro_batch_loop=micro_batch_loop,
                                   pipeline_loop=pipeline_loop,
                                   inline_stage_calls=self.inlined(inline_stage_calls))

    def make_relaxed_step(self, model: tf.keras.Model, plan: Plan, loss: PipelineLoss,
                          max_batches: int, pipeline_loop: bool = False) -> HorovodPipelineStep:
        # A relaxed run calls the stage once per batch: not inlined, or each call is a copy.
        return relaxed(HorovodPipelineStep)(model, plan, loss, self.device, self.process_sets,
                                            self.layout, stages=self.stages,
                                            max_batches=max_batches, inline_stage_calls=False,
                                            pipeline_loop=pipeline_loop)

    def compiled(self, what: str, fn):
        """Run the compiled `fn` under the watchdog (the first call also traces)."""
        def call(*args):
            first = what not in self._traced
            self._traced.add(what)
            with self.watchdog.step(what, first=first):
                return fn(*args)
        return call

    # ---- the optimizer sees the whole model's gradient -------------------------------------------
    def apply_gradients(self, step: HorovodPipelineStep, optimizer, result: StepResult) -> None:
        gradients = unscaled(optimizer, result.gradients)
        poison = 0.0
        if loss_scale(optimizer) is not None:
            local = tf.constant(0.0)
            for g in gradients:
                if g is not None:
                    local = local + tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(g))),
                                            tf.float32)
            nonfinite = step.sum_over_ranks(local, "nonfinite")
            # NaN in every rank's gradients when any rank had a non-finite one: every
            # LossScaleOptimizer then skips the step and lowers its scale alike.
            poison = tf.where(nonfinite > 0, float("nan"), 0.0)
            gradients = [None if g is None else g + tf.cast(poison, g.dtype) for g in gradients]
        clip = global_clipnorm(optimizer)
        if clip:
            squares = tf.constant(0.0)
            for g, v in zip(gradients, step.model.trainable_variables):
                if g is not None and step.owns_norm_of(v):
                    squares = squares + tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
            norm = tf.sqrt(step.sum_over_ranks(squares, "gradnorm"))
            left = scale_left_in(optimizer)
            if left is not None:            # Keras 3 clips after unscaling, inside apply
                norm = norm / tf.cast(left, norm.dtype)
            # tf.clip_by_global_norm's factor; the optimizer's own clip, on this rank's share
            # only, then changes nothing (that share's norm is at most the clipped norm).
            scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
            gradients = [None if g is None else g * tf.cast(scale, g.dtype) for g in gradients]
        if any(g is not None for g in gradients):
            apply_present(optimizer, gradients, step.model.trainable_variables)
            return
        # No trainable variables here: step the optimizer anyway, so its iteration count and
        # loss scale stay those of every other rank.
        zero = tf.zeros_like(self._placeholder) + poison
        optimizer.apply_gradients([(zero, self._placeholder)])

    def prepare_optimizer(self, step: HorovodPipelineStep, optimizer) -> None:
        variables = step.trained_variables()
        if not variables and self._placeholder is None:
            self._placeholder = tf.Variable(0.0, name="dapple_no_weights")
        build_optimizer(optimizer, variables or [self._placeholder])

    def predictions(self, step: HorovodPipelineStep, result: StepResult) -> List[tf.Tensor]:
        return step.all_predictions(result)

    # ---- checkpoints -----------------------------------------------------------------------------
    def gather_weights(self) -> None:
        """Make every rank's copy of the model current: each stage's first rank broadcasts the
        stage's variables (the replicas of a stage hold equal values)."""
        with self.watchdog.step("gathering stage weights"):
            for s, graph in enumerate(self.stages):
                variables = graph.variables
                if variables:
                    hvd.broadcast_variables(tf_variables(variables),
                                           root_rank=self.layout.rank(s, 0))

    @property
    def processes(self) -> int:
        return hvd.size()

    def from_writer(self, values: List[int]) -> List[int]:
        with self.watchdog.step("agreeing with rank 0 on the callbacks' decisions"):
            got = hvd.broadcast(tf.constant([int(v) for v in values], tf.int64), 0,
                                name="dapple.from_writer")
        return [int(v) for v in got.numpy()]

    def broadcast_model(self, model: tf.keras.Model) -> None:
        with self.watchdog.step("broadcasting rank 0's weights"):
            hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)

    def save_weights(self, model: tf.keras.Model, path: str) -> None:
        """The plain model's Keras checkpoint, with every stage's variables, written once by
        rank 0 (atomically); every rank returns after it is complete."""
        self.gather_weights()
        error = ""
        if self.rank == 0:
            try:
                save_weights_atomically(model, path)
            except Exception as e:   # tell the other ranks instead of leaving them waiting
                error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        with self.watchdog.step("waiting for rank 0 to write the checkpoint"):
            failed = hvd.broadcast(tf.constant(1 if error else 0), 0, name="dapple.saved")
        if int(failed):
            raise RuntimeError(f"rank 0 could not write the checkpoint {path!r}"
                               + (f": {error}" if error else " (see rank 0's output)"))

    def load_weights(self, model: tf.keras.Model, path: str):
        """Rank 0 reads the checkpoint; all ranks then hold its weights."""
        status = model.load_weights(path) if self.rank == 0 else None
        with self.watchdog.step("broadcasting loaded weights"):
            hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)
        return status
