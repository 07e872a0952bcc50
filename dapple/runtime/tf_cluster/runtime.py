"""The TensorFlow-cluster runtime: the local runtime's step with plan devices on the tasks.

This process (the chief, task 0) builds and runs every unit, as `dapple.runtime.local.runtime` does;
only the devices differ: unit (s, r) runs on the task of its plan device, so TensorFlow's
distributed runtime partitions the step's graph by task and moves every tensor crossing a
stage boundary with its buffered Send/Recv (a producer never waits for the consumer). Replica
gradients are added on the stage's first device (`graph_rewrite.local_transport`), BN
statistics, loss scaling, clipping, shared weights and every schedule work as locally.

The model's variables stay where the user's script made them, on the chief (task 0), and the
optimizer updates them there. A unit on another task reads working copies on its own device,
refreshed once at the start of every step (`graph_rewrite.working_copies`), instead of every
weight over the network once per micro-batch and again in its backward
(`DAPPLE_TF_WORKING_COPIES=0` turns them off, to measure; docs/runtime.md has the figures).
Relaxed plans (pipedream, 2bw, avgpipe) move weight versions through the model's variables
during the step, so their units read the variables where they live.
"""
from __future__ import annotations

import os
from typing import List, Optional

import tensorflow as tf

from dapple.runtime.local.runtime import LocalRuntime
from dapple.runtime.tf_cluster.cluster import (ClusterError, addresses_from_environment,
                                              task_device, task_device_counts)
from graph_rewrite.losses import PipelineLoss
from graph_rewrite.pipeline import PipelineStep
from planner.formats.plan import Plan

ENV_WORKING_COPIES = "DAPPLE_TF_WORKING_COPIES"


def task_devices(counts: List[int]) -> List[str]:
    """Plan device d's name, task by task (`counts[t]` devices on task t): the task's GPUs when
    it has enough, else its CPU devices."""
    gpus = {d.name for d in tf.config.list_logical_devices("GPU")}
    out = []
    for t, n in enumerate(counts):
        names = [task_device(t, "GPU", i) for i in range(n)]
        out += names if all(g in gpus for g in names) else [task_device(t, "CPU", i)
                                                           for i in range(n)]
    return out


class TFClusterRuntime(LocalRuntime):
    def __init__(self, plan: Plan, devices: Optional[List[str]] = None, stages=None):
        tasks = addresses_from_environment()
        if tasks is None:
            raise ClusterError("runtime='tensorflow' needs a cluster: run the script under "
                               "`dapple launch --runtime=tensorflow --plan=... -- python ...`")
        counts = task_device_counts(len(tasks))
        needed = max(d for s in plan.stages for d in s.devices) + 1
        if needed != sum(counts):
            raise ClusterError(f"the plan uses {needed} devices but the cluster's {len(tasks)} "
                               f"tasks hold {sum(counts)} ({counts}): launch with {needed} "
                               f"slots, e.g. --hosts=localhost:{needed}")
        super().__init__(plan, devices if devices is not None else task_devices(counts),
                         stages)

    def make_step(self, model: tf.keras.Model, plan: Plan, loss: Optional[PipelineLoss],
                  micro_batch_loop: bool = False) -> PipelineStep:
        if os.environ.get(ENV_WORKING_COPIES, "1") == "0":
            return super().make_step(model, plan, loss, micro_batch_loop)
        return CopyingStep(model, plan, loss, self.devices, stages=self.stages,
                           micro_batch_loop=micro_batch_loop)


class CopyingStep(PipelineStep):
    """The local step whose units read working copies of their stage's weights on their own
    device where the weights live elsewhere, refreshed at the start of every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for s, r in self.transport.local_units():
            self.functions[s].copies.make(self.device(s, r))

    @tf.autograph.experimental.do_not_convert
    def run(self, *args, **kwargs):
        for function in self.functions:
            function.copies.refresh()
        return super().run(*args, **kwargs)
