"""The TensorFlow-cluster runtime: the local runtime's step with plan device d on task d.

This process (the chief, task 0) builds and runs every unit, as `dapple.local_runtime` does;
only the devices differ: unit (s, r) runs on the task of its plan device, so TensorFlow's
distributed runtime partitions the step's graph by task and moves every tensor crossing a
stage boundary with its buffered Send/Recv (a producer never waits for the consumer). Replica
gradients are added on the stage's first device (`graph_rewrite.local_transport`), BN
statistics, loss scaling, clipping, shared weights and every schedule work as locally.

The model's variables stay where the user's script made them, on the chief (task 0); a unit
on another task reads them there (see docs/runtime.md, "The TensorFlow cluster runtime", for
what that costs and what is left to do about it).
"""
from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from dapple.local_runtime import LocalRuntime
from dapple.tf_cluster.cluster import ClusterError, addresses_from_environment, task_device
from planner.plan import Plan


def task_devices(tasks: int) -> List[str]:
    """Task t's device: its first GPU when it has one, else its CPU."""
    gpus = {d.name for d in tf.config.list_logical_devices("GPU")}
    out = []
    for t in range(tasks):
        gpu = task_device(t, "GPU")
        out.append(gpu if gpu in gpus else task_device(t, "CPU"))
    return out


class TFClusterRuntime(LocalRuntime):
    def __init__(self, plan: Plan, devices: Optional[List[str]] = None):
        tasks = addresses_from_environment()
        if tasks is None:
            raise ClusterError("runtime='tensorflow' needs a cluster: run the script under "
                               "`dapple launch --runtime=tensorflow --plan=... -- python ...`")
        needed = max(d for s in plan.stages for d in s.devices) + 1
        if needed != len(tasks):
            raise ClusterError(f"the plan uses {needed} devices but the cluster has {len(tasks)} "
                               f"tasks (one per device): launch with {needed} slots, e.g. "
                               f"--hosts=localhost:{needed}")
        super().__init__(plan, devices if devices is not None else task_devices(len(tasks)))
