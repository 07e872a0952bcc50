"""Which runtime a `PipelinedModel` runs on: chosen once, when it is made.

`runtime="local"`, `"horovod"` or `"tensorflow"` decides; by default the TensorFlow cluster
runtime when `dapple launch --runtime=tensorflow` described a cluster (`DAPPLE_TF_CLUSTER`),
Horovod when horovodrun started this process or Horovod is initialized, else local.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import tensorflow as tf

from dapple.runtime.local.runtime import LocalRuntime
from dapple.runtime.base import Runtime
from dapple.runtime.tf_cluster.cluster import in_cluster
from graph_rewrite.model_graph import cut_model
from planner.formats.plan import Plan

RUNTIMES = ("local", "horovod", "tensorflow")


def _use_horovod(runtime: Optional[str]) -> bool:
    """`runtime="horovod"`/"local" decides; by default Horovod when horovodrun started this
    process or the user initialized Horovod (see `dapple.runtime.horovod.runtime`)."""
    if runtime not in (None,) + RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES} (or None to detect), got {runtime!r}")
    if runtime is not None:
        return runtime == "horovod"
    if in_cluster():
        return False
    if any(k in os.environ for k in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return True
    hvd = sys.modules.get("horovod.tensorflow")
    return hvd is not None and hvd.is_initialized()


def chosen(runtime: Optional[str]) -> str:
    """The name (one of RUNTIMES) of the runtime `make_runtime(runtime, ...)` makes."""
    if _use_horovod(runtime):
        return "horovod"
    if runtime == "tensorflow" or (runtime is None and in_cluster()):
        return "tensorflow"
    return "local"


def make_runtime(runtime: Optional[str], model: tf.keras.Model, plan: Plan,
                 devices) -> Runtime:
    """The runtime `runtime` names (None: detected), with the model cut by the plan: the one
    cut every step of the model reads."""
    name = chosen(runtime)
    stages = cut_model(model, [tuple(st.layers) for st in plan.stages])
    if name == "horovod":
        # Imported only when chosen: it needs Horovod, which a local run may not have.
        from dapple.runtime.horovod.runtime import HorovodRuntime
        return HorovodRuntime(model, plan, stages, devices)
    if name == "tensorflow":
        from dapple.runtime.tf_cluster.runtime import TFClusterRuntime
        return TFClusterRuntime(plan, devices, stages)   # `dapple launch --runtime=tensorflow`
    return LocalRuntime(plan, devices, stages)
