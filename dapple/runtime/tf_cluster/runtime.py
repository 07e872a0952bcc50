"""The TensorFlow-cluster runtime: the local runtime's step with plan devices on the tasks.

This process (the chief, task 0) builds and runs every unit, as `dapple.runtime.local.runtime` does;
only the devices differ: unit (s, r) runs on the task of its plan device, so TensorFlow's
distributed runtime partitions the step's graph by task and moves every tensor crossing a
stage boundary with its buffered Send/Recv (a producer never waits for the consumer). Replica
gradients are added on the stage's first device (`graph_rewrite.local_transport`), BN
statistics, loss scaling, clipping, shared weights and every schedule work as locally.

Each stage's weights are kept and trained on the stage's first device, and the model's
variables on the chief are made current when read (`dapple.runtime.tf_cluster.stage_weights`).

An unrolled step's stage calls are inlined into it by default (`inline_stage_calls=None`):
across tasks, steps whose calls stayed out of line took 0.99-1.27x as long as inlined ones
over an MLP, a convolutional model, MobileNetV2 and ResNet-50 (docs/runtime.md, "Inlined stage
calls"). The price, a longer first call (1.2-1.5x at M = 8), is nothing at M = 1, where each
stage is called once. `inline_stage_calls=False` keeps them out of line.
"""
from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from dapple.runtime.tf_cluster.cluster import (ClusterError, addresses_from_environment,
                                              task_device, task_device_counts)
from dapple.runtime.tf_cluster.stage_weights import StageWeightsRuntime
from planner.formats.plan import Plan


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


class TFClusterRuntime(StageWeightsRuntime):
    inlines_stage_calls = True      # the module doc

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
        # A loop spanning tasks waits each iteration on the leader's predicate and control.
        self.loops_pipelines = len(tasks) == 1
