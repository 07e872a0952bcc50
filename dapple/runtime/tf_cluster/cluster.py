"""Which cluster this process belongs to, and connecting to it.

The launcher describes the cluster to the chief in `DAPPLE_TF_CLUSTER`: a JSON list of the
tasks' `host:port` addresses, task 0 being the chief (this process), and in
`DAPPLE_TF_TASK_DEVICES` how many devices each task holds (a JSON list; absent: one each).
Plan devices are numbered task by task: with `[2, 1]`, plan devices 0 and 1 are task 0's
devices 0 and 1, plan device 2 is task 1's device 0.
`import dapple` calls `connect_from_environment()` before anything builds a model: variables
made before the connection live on `/job:localhost` and are unusable afterwards (the first
step fails: "/job:localhost/replica:0/task:0/device:CPU:0 unknown device").
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

ENV_CLUSTER = "DAPPLE_TF_CLUSTER"
ENV_TASK_DEVICES = "DAPPLE_TF_TASK_DEVICES"
JOB = "worker"


class ClusterError(RuntimeError):
    """The cluster description is unusable; the message says what and how to fix it."""


def addresses_from_environment() -> Optional[List[str]]:
    """The tasks' addresses from `DAPPLE_TF_CLUSTER`, or None when it is not set."""
    raw = os.environ.get(ENV_CLUSTER)
    if not raw:
        return None
    return parse_addresses(raw)


def parse_addresses(raw: str) -> List[str]:
    try:
        tasks = json.loads(raw)
    except ValueError:
        tasks = None
    if (not isinstance(tasks, list) or not tasks
            or not all(isinstance(t, str) and t.rpartition(":")[2].isdigit() for t in tasks)):
        raise ClusterError(f"{ENV_CLUSTER}={raw!r}: expected a JSON list of host:port addresses, "
                           f"task 0 first, as in [\"localhost:2222\", \"localhost:2223\"] "
                           f"(`dapple launch --runtime=tensorflow` sets it)")
    return tasks


def task_device_counts(tasks: int) -> List[int]:
    """Devices per task from `DAPPLE_TF_TASK_DEVICES` (one each when it is not set)."""
    raw = os.environ.get(ENV_TASK_DEVICES)
    if not raw:
        return [1] * tasks
    return parse_device_counts(raw, tasks)


def parse_device_counts(raw: str, tasks: int) -> List[int]:
    try:
        counts = json.loads(raw)
    except ValueError:
        counts = None
    if (not isinstance(counts, list) or len(counts) != tasks
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                       for c in counts)):
        raise ClusterError(f"{ENV_TASK_DEVICES}={raw!r}: expected a JSON list of {tasks} whole "
                           f"numbers >= 1, the devices of each task in {ENV_CLUSTER}'s order "
                           f"(`dapple launch --runtime=tensorflow --group_devices` sets it)")
    return counts


def task_device(task: int, kind: str = "CPU", index: int = 0) -> str:
    return f"/job:{JOB}/replica:0/task:{task}/device:{kind}:{index}"


def in_cluster() -> bool:
    return bool(os.environ.get(ENV_CLUSTER))


def connect_from_environment() -> bool:
    """Connect this process to the cluster as task 0 if `DAPPLE_TF_CLUSTER` says so (it starts
    this process's own server: none must be started by hand), and watch the other tasks
    (`watchdog`). True when connected."""
    tasks = addresses_from_environment()
    if tasks is None:
        return False
    task_device_counts(len(tasks))      # a bad description fails before anything starts
    from dapple.runtime.tf_cluster.watchdog import watch_tasks
    watch_tasks(tasks)                  # a task that hangs ends this process, named
    import tensorflow as tf

    from dapple.devices import configure_local_devices
    configure_local_devices()           # this task's devices (DAPPLE_NUM_CPU_DEVICES)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({JOB: tasks}),
                                              job_name=JOB, task_index=0)
    return True
