"""Local devices for plans: GPUs when there are enough, else logical CPU devices.

TensorFlow fixes its device list the first time it is used, so logical CPU devices must be
configured before that: `import dapple` calls `configure_local_devices()`. The number of logical
CPU devices is `DAPPLE_NUM_CPU_DEVICES` (default 8), enough for every plan in the tests and
examples; they share the process's thread pools (set `TF_NUM_INTRAOP_THREADS` to bound each op).
"""
from __future__ import annotations

import os
from typing import List

import tensorflow as tf

DEFAULT_CPU_DEVICES = 8
ENV_NUM_CPU_DEVICES = "DAPPLE_NUM_CPU_DEVICES"


class DeviceError(RuntimeError):
    pass


def requested_cpu_devices() -> int:
    raw = os.environ.get(ENV_NUM_CPU_DEVICES, str(DEFAULT_CPU_DEVICES))
    try:
        n = int(raw)
    except ValueError:
        raise DeviceError(f"{ENV_NUM_CPU_DEVICES}={raw!r} is not a whole number") from None
    if n < 1:
        raise DeviceError(f"{ENV_NUM_CPU_DEVICES} must be >= 1, got {n}")
    return n


def configure_local_devices() -> None:
    """Split the CPU into logical devices if TensorFlow has not been initialized yet."""
    cpus = tf.config.list_physical_devices("CPU")
    if not cpus:
        return
    n = requested_cpu_devices()
    try:
        if tf.config.get_logical_device_configuration(cpus[0]) is None:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        pass  # TensorFlow already initialized; local_devices() explains if too few


def local_devices(count: int) -> List[str]:
    """Names of `count` devices for plan device ids 0..count-1 in this process."""
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) >= count:
        return [d.name for d in gpus[:count]]
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) >= count:
        return [d.name for d in cpus[:count]]
    raise DeviceError(
        f"the plan needs {count} devices but this process has {len(gpus)} GPU(s) and "
        f"{len(cpus)} logical CPU device(s). Set {ENV_NUM_CPU_DEVICES}={count} (or more) and "
        f"`import dapple` before anything initializes TensorFlow (TensorFlow fixes its device "
        f"list at first use), or use a plan with fewer devices")
