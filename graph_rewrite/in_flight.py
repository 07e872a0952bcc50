"""How many of a lane's actions run at once.

A lane (a device's actions, in its schedule's order) runs one action after the other: each waits
for the previous one. On a CPU whose process runs no other lane (a Horovod rank's, a TensorFlow
cluster task's, a one-replica data-parallel plan in one process) that leaves the process's
other threads idle while an action's small ops run one by one. There a lane keeps
`CPU_LANE_DEPTH` actions in flight: an action waits for every action of its lane up to that
many before it, so a forward runs beside the previous backward, as TensorFlow overlaps a plain
unrolled accumulation. What each action computes, and the order its gradients are added in (the
sums are a resource its adds update in program order), are the same; one more micro-batch's
activations is held.

Measured (docs/cluster.md): a data-parallel lane alone in one process 0.74-0.78 of its step at
one in flight; a 2-stage 1f1b on 2 TensorFlow-cluster processes 0.94-0.96 (interleaved 0.94,
zb-h1 1.00), 3 no better than 2. Where one process runs several lanes they already fill its
threads (two lanes on 2 cores: 1.05-1.09 at 2), and a GPU's one compute stream gains nothing:
there the plan's order holds. Relaxed schedules keep it too: their weight versions are moved
between actions in the list's order.
"""
from __future__ import annotations

from typing import List

import tensorflow as tf

CPU_LANE_DEPTH = 2      # 1: every lane in its plan's order


def alone_on_cpu(step, unit) -> bool:
    """Whether `unit` runs on a CPU whose process runs no other lane of `step`."""
    def process(device: str):
        spec = tf.DeviceSpec.from_string(device)
        return spec.job, spec.replica, spec.task

    device = step.device(*unit)
    return tf.DeviceSpec.from_string(device).device_type == "CPU" and not any(
        step.lane(*other) != step.lane(*unit) and process(step.device(*other)) == process(device)
        for other in step.transport.local_units())


def order_depth(step, unit) -> int:
    """The actions `unit`'s lane keeps in flight in an unrolled step."""
    if step.plan.schedule.relaxed or not alone_on_cpu(step, unit):
        return 1
    return max(CPU_LANE_DEPTH, 1)


def waits(history: List[list], depth: int) -> list:
    """What the lane's next action waits for, from its actions' tensors so far (`history`, last
    last): the actions `depth` to 2 * depth - 1 back. Each of those waited likewise, so every
    action up to `depth` back is done first (depth 1: the previous action)."""
    end = max(len(history) - depth + 1, 0)
    return [t for done in history[max(end - depth, 0):end] for t in done]
