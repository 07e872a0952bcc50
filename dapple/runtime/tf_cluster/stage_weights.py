"""Every stage's weights kept and trained on the stage's own device; the model's variables made
current only when something reads them.

On the TensorFlow-cluster runtime the model's variables live where the user's script made
them, on the chief, and most units run on other processes. Working copies refreshed from the
variables every step (`graph_rewrite.working_copies`) still move each remote stage's weights
out and its gradients back, once a step each, on the slowest links. Here the copies on a
stage's first device (its first replica's) *are* the stage's weights: the optimizer updates
them there (Keras makes its slots beside the variable they belong to). A replicated stage's
other replicas train their own copies alike: each gets the sum of the replicas' gradients on
its own device and the same update (`graph_rewrite.replica_sums`: nothing comes back after the
update). Only boundaries and replica gradients cross the network, as in the DAPPLE paper's
runtime and in our Horovod runtime. Under `global_clipnorm` the replicas refresh from the
first instead (the optimizer would take every replica's gradients for the model's norm).

The model's variables are made current when something reads them (`gather_weights`: `fit`'s
callbacks, `save_weights`, the user), and the home copies take the model's values again before
the next step when the model may have changed since: after a gather (callbacks may change it),
`load_weights`, and the user's code between calls (`model_may_have_changed`). The model never
overwrites training it has not gathered. A stage stays with the model's variables (copies
refreshed every step) when it shares a variable with another stage, when its copies are not
possible (`WorkingCopies.possible`), and for relaxed plans, whose runs update the variables.

`DAPPLE_TF_WEIGHTS` chooses, to measure: `stage` (the default, above), `copies` (the model's
variables trained on the chief, working copies refreshed every step) or `chief` (no copies:
every unit reads the variables on the chief).
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Dict, List, Optional, Set, Tuple

import tensorflow as tf

from dapple.checkpoint import save_weights_atomically
from dapple.eager_build import build_optimizer
from dapple.runtime.base import global_clipnorm, unscaled
from dapple.runtime.local.copying_step import CopyingStep
from dapple.runtime.local.runtime import LocalRuntime
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.pipeline import PipelineStep, StepResult
from graph_rewrite.working_copies import WorkingCopies
from planner.formats.plan import Plan

ENV_WEIGHTS = "DAPPLE_TF_WEIGHTS"
WEIGHT_MODES = ("stage", "copies", "chief")


def weight_mode() -> str:
    mode = os.environ.get(ENV_WEIGHTS, "stage")
    if mode not in WEIGHT_MODES:
        raise ValueError(f"{ENV_WEIGHTS}={mode!r}: expected one of {', '.join(WEIGHT_MODES)} "
                         f"(stage: each stage's weights on its device, the default)")
    return mode


def apply_beside_weights(optimizer, pairs, devices: List[str]) -> None:
    """One `apply_gradients` of the (gradient, variable) pairs whose gradient is not None, each
    update computed on its variable's device (of `devices`)."""
    with tf.compat.v1.device(beside_inputs(devices)):
        optimizer.apply_gradients([(g, v) for g, v in pairs if g is not None],
                                  **_already_summed(optimizer))


def beside_inputs(devices: List[str]) -> Callable:
    """A device function (`tf.compat.v1.device`, in a tf.function): an op given no device runs on
    the device of its first input that lives on one of `devices`.

    Keras's optimizer, under the default distribution strategy, places the math of an update
    wherever the step runs (the chief), not beside the variable: a remote stage's gradients,
    slots and new values would each cross the network every step. Placed beside its inputs,
    the update of a stage's weights runs on the stage's device. A variable and its reads have
    no device of their own inside the function: the capture's outer tensor says where it lives.
    """
    wanted = [tf.DeviceSpec.from_string(d) for d in devices]
    graph = tf.compat.v1.get_default_graph()
    captured: Dict[str, str] = {}

    def device_of(tensor) -> str:
        if tensor.device:
            return _canonical(tensor.device)
        if tensor.dtype == tf.resource:         # a captured variable's handle
            if tensor.name not in captured:     # by name: wrappers are made afresh
                captured.update({inner.name: _canonical(outer.device)
                                 for outer, inner in getattr(graph, "captures", ())
                                 if getattr(outer, "device", "")})
            return captured.get(tensor.name, "")
        # a variable's read, which TensorFlow places with the variable when it runs
        handles = [t for t in tensor.op.inputs if t.dtype == tf.resource]
        return device_of(handles[0]) if handles else ""

    def place(op) -> str:
        if op.device:
            return op.device
        for tensor in op.inputs:
            device = device_of(tensor)
            for w in wanted if device else ():
                if _same_device(w, device):
                    return w.make_merged_spec(tf.DeviceSpec.from_string(device)).to_string()
        return ""
    return place


def _already_summed(optimizer) -> dict:
    """`apply_gradients`' argument that skips Keras's aggregation of the gradients over a
    strategy's replicas: under the default strategy it adds nothing but one IdentityN of every
    gradient, one op on one device, which would carry every other device's gradients there and
    back."""
    parameters = inspect.signature(optimizer.apply_gradients).parameters
    if "skip_gradients_aggregation" in parameters:
        return {"skip_gradients_aggregation": True}
    if "experimental_aggregate_gradients" in parameters:     # legacy optimizers
        return {"experimental_aggregate_gradients": False}
    return {}


def _canonical(device: str) -> str:
    return tf.DeviceSpec.from_string(device).to_string()


def _same_device(spec: tf.DeviceSpec, device: str) -> bool:
    """Whether `device` (fully or partly named, as `/device:CPU:1`) can name `spec`'s device."""
    other = tf.DeviceSpec.from_string(device)
    return all(a is None or b is None or a == b for a, b in (
        (spec.job, other.job), (spec.replica, other.replica), (spec.task, other.task),
        (spec.device_type, other.device_type), (spec.device_index, other.device_index)))


def _shared_ids(step: PipelineStep) -> Set[int]:
    """The trainable variables more than one stage reads."""
    seen: Set[int] = set()
    shared: Set[int] = set()
    for graph in step.stages:
        for v in graph.trainable_variables:
            (shared if id(v) in seen else seen).add(id(v))
    return shared


class StageWeightsRuntime(LocalRuntime):
    """The local runtime's step on any devices, with each stage's weights on its devices
    (`DAPPLE_TF_WEIGHTS` chooses otherwise)."""

    def __init__(self, plan: Plan, devices=None, stages=None):
        super().__init__(plan, devices, stages)
        self._kept: List[WorkingCopies] = []        # the current step's stages with trained copies
        self._home_of: Dict[int, tf.Variable] = {}  # id(model variable) -> its home copy
        # (stage, replica >= 1) -> the copies that replica trains in place
        self._replica_weights: Dict[Tuple[int, int], List[tf.Variable]] = {}
        self._load: Optional[Callable] = None
        self._store: Optional[Callable] = None
        self._ahead = False              # the copies hold training the model has not gathered
        self._model_may_differ = True    # the model may hold values the copies have not taken
        self._updating: Set[str] = set()  # the compiled functions that train the copies
        self._running: Optional[str] = None

    # ---- where the weights are ---------------------------------------------------------------
    def make_step(self, model: tf.keras.Model, plan: Plan, loss: Optional[PipelineLoss],
                  micro_batch_loop: bool = False, pipeline_loop: bool = False,
                  inline_stage_calls: Optional[bool] = None) -> PipelineStep:
        mode = weight_mode()
        if mode == "chief":         # no copies, even for loops
            return self._step(PipelineStep, model, plan, loss, micro_batch_loop, pipeline_loop,
                              inline_stage_calls)
        self._leave()                   # a new step (compile again): keep what was trained
        step = self._step(CopyingStep, model, plan, loss, micro_batch_loop, pipeline_loop,
                          inline_stage_calls)
        if mode == "stage":
            self._keep(step, replicas_in_place=not global_clipnorm(model.optimizer))
        return step

    def make_relaxed_step(self, model, plan, loss, max_batches, pipeline_loop=False):
        self._leave()                   # a relaxed run updates the model's variables
        return super().make_relaxed_step(model, plan, loss, max_batches, pipeline_loop)

    def _keep(self, step: CopyingStep, replicas_in_place: bool) -> None:
        shared = _shared_ids(step)
        for s, function in enumerate(step.functions):
            copies = function.copies
            if not copies.possible or any(id(v) in shared for v in copies.variables):
                continue
            if copies.keep_on(step.device(s, 0)):
                self._home_of.update({id(v): c for v, c in zip(copies.variables,
                                                               copies.home_copies())})
            others = [step.device(s, r) for r in range(1, step.replicas[s])]
            if replicas_in_place and others and all(copies.on(d) for d in others):
                for r, device in enumerate(others, 1):
                    copies.train_on(device)
                    self._replica_weights[(s, r)] = copies.on(device)
                step.sum_on_every_replica.add(s)
            if copies.trained:
                self._kept.append(copies)
        kept = list(self._kept)

        # tf.functions: one call whatever the number of variables
        @tf.function(autograph=False)
        def load():
            for copies in kept:
                copies.load_trained()

        @tf.function(autograph=False)
        def store():
            for copies in kept:
                copies.store_home()
        self._load, self._store = (load, store) if kept else (None, None)
        self._model_may_differ = True

    def _leave(self) -> None:
        self.gather_weights()
        for copies in self._kept:
            copies.leave()
        self._kept, self._home_of, self._replica_weights = [], {}, {}
        self._load = self._store = None

    def _trained(self, variables) -> List[tf.Variable]:
        """What the optimizer updates for `variables`: their home copies, where kept."""
        return [self._home_of.get(id(v), v) for v in variables]

    # ---- steps --------------------------------------------------------------------------------
    def compiled(self, what: str, fn):
        def call(*args):
            if self._model_may_differ and not self._ahead and self._load is not None:
                self._load()
            self._model_may_differ = False
            self._running = what
            try:
                return fn(*args)
            finally:
                self._running = None
                if what in self._updating:
                    self._ahead = True
        return call

    def prepare_optimizer(self, step: PipelineStep, optimizer) -> None:
        replicas = [c for copies in self._replica_weights.values() for c in copies]
        build_optimizer(optimizer, self._trained(step.trained_variables()) + replicas)

    def apply_gradients(self, step: PipelineStep, optimizer, result: StepResult) -> None:
        pairs = list(zip(unscaled(optimizer, result.gradients),
                         self._trained(step.model.trainable_variables)))
        for unit, copies in self._replica_weights.items():
            pairs += zip(unscaled(optimizer, result.replica_gradients[unit]), copies)
        apply_beside_weights(optimizer, pairs, self.devices)
        if (self._home_of or self._replica_weights) and self._running is not None:
            self._updating.add(self._running)       # traced now: this function trains copies

    def model_may_have_changed(self) -> None:
        self._model_may_differ = True

    # ---- the model's variables -----------------------------------------------------------------
    def gather_weights(self) -> None:
        """The model's variables := the stages' weights."""
        if self._ahead and self._store is not None:
            self._store()
        self._ahead = False
        self._model_may_differ = True   # whoever asked may change them

    def broadcast_model(self, model: tf.keras.Model) -> None:
        self._ahead, self._model_may_differ = False, True

    def save_weights(self, model: tf.keras.Model, path: str) -> None:
        self.gather_weights()
        save_weights_atomically(model, path)

    def load_weights(self, model: tf.keras.Model, path: str):
        status = model.load_weights(path)
        self._ahead, self._model_may_differ = False, True
        return status
