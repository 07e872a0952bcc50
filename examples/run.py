"""The one driver every example uses: profile -> plan -> train a few steps.

    python -m examples.run --example=bert --size=tiny --devices=4 --steps=3
    python -m examples.vgg19 --size=tiny --devices=2          # the same, from the example file
    python -m examples.resnet50 --size=full --devices=8 --batch_size=128 --topology=1x8   # GPUs

An example module (`examples/<name>.py`) provides only its model, written with `keras` (Keras 3
beside TensorFlow 2.16+, as a TensorFlow user writes today): `build(**kwargs)`,
`TINY` and `FULL` keyword arguments, `GLOBAL_BATCH = {"tiny": ..., "full": ...}`, and,
when its labels are not class ids of one output, `labels(model, batch, rng)`. The driver feeds synthetic data (random inputs of the model's
shapes, integer ids for int inputs; see `dapple.user_model`), measures the profile with
`dapple.profile`, plans with the DAPPLE planner (`planner.search.plan_space.plan_dapple`) for `--devices`
local logical devices (`topology.local_topology`) or for `--topology`, prints the plan, and
trains `--steps` global batches with `dapple.PipelinedModel.fit`.

On a machine without enough GPUs the plan's devices are logical CPU devices: the run shows the
system working end to end, not speed (they share the machine's cores).
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any, Dict, Optional

from absl import app, flags

EXAMPLES = ("vgg19", "resnet50", "bert", "gnmt")

FLAGS = flags.FLAGS
flags.DEFINE_enum("example", None, EXAMPLES, "which example model (python -m examples.run)")
flags.DEFINE_enum("size", "tiny", ["tiny", "full"], "tiny: runs on a laptop CPU in seconds; "
                  "full: the published model size, for machines with GPUs")
flags.DEFINE_string("model_args", None, "JSON object overriding the size's builder arguments, "
                    "e.g. '{\"num_layers\": 4}'")
flags.DEFINE_integer("devices", 2, "number of local devices to plan for (GPUs if there are "
                     "enough, else logical CPU devices)")
flags.DEFINE_string("topology", None, "plan for this topology spec instead of --devices local "
                    "devices (e.g. '1x8' for one host of 8 GPUs)")
flags.DEFINE_integer("batch_size", None, "global batch (default: the example's for the size)")
flags.DEFINE_integer("steps", 3, "training steps (global batches)")
flags.DEFINE_integer("profile_batch", None, "batch to profile at (default: the global batch)")
flags.DEFINE_integer("profile_runs", 3, "measured runs per layer when profiling")
flags.DEFINE_enum("planner", "dapple", ["dapple", "straight"], "dapple: the plan of least "
                  "estimated latency (plan_dapple); straight: one stage a device, cut where the "
                  "profiled time splits evenly (to see a pipeline on a tiny model)")
flags.DEFINE_integer("micro_batches", 2, "micro-batches of a --planner=straight plan")
flags.DEFINE_string("plan", None, "use this plan JSON instead of planning")
flags.DEFINE_string("plan_output", None, "write the plan JSON here")
flags.DEFINE_string("profile_output", None, "write the profile JSON here")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate")


def class_labels(model, batch, rng):
    """Class ids for a classifier's single output (examples without `labels` get these)."""
    return rng.randint(0, model.output_shape[-1], size=batch).astype("int32")


def load_example(name: str):
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; examples are {EXAMPLES}")
    return importlib.import_module(f"examples.{name}")


def run(name: str, size: str = "tiny", devices: int = 2, batch_size: Optional[int] = None,
        steps: int = 3, model_args: Optional[Dict[str, Any]] = None, topology: Optional[str] = None,
        profile_batch: Optional[int] = None, profile_runs: int = 3, planner: str = "dapple",
        micro_batches: int = 2,
        plan_path: Optional[str] = None,
        plan_output: Optional[str] = None, profile_output: Optional[str] = None,
        learning_rate: float = 1e-3, verbose: int = 1) -> Dict[str, Any]:
    """Profile, plan and train one example; returns what happened (for tests and scripts)."""
    if os.environ.get("DAPPLE_NUM_CPU_DEVICES") is None:
        os.environ["DAPPLE_NUM_CPU_DEVICES"] = str(max(devices, 8))
    import dapple  # noqa: F401  (devices before TensorFlow initializes)
    import keras
    import numpy as np
    import tensorflow as tf

    from dapple.pipelined_model import PipelinedModel
    from dapple.profiler import profile
    from dapple.user_model import random_inputs
    from planner.formats.plan import Plan
    from planner.search.plan_finishing import finish_plan
    from planner.search.plan_space import plan_dapple
    from topology.parse import local_topology, parse_topology

    example = load_example(name)
    kwargs = dict(example.TINY if size == "tiny" else example.FULL)
    kwargs.update(model_args or {})
    batch = batch_size or example.GLOBAL_BATCH[size]
    say = print if verbose else (lambda *a, **k: None)

    keras.utils.set_random_seed(0)
    model = example.build(**kwargs)
    say(f"== {name} ({size}): {model.count_params():,} parameters, "
        f"{len(model.layers)} Keras layers")
    rows = batch * steps
    x = random_inputs(model, rows, seed=1)
    y = getattr(example, "labels", class_labels)(model, rows, np.random.RandomState(2))

    first_rows = lambda data, n: tf.nest.map_structure(lambda a: a[:n], data)  # noqa: E731
    pbatch = profile_batch or batch
    start = time.perf_counter()
    prof = profile(model, first_rows(x, pbatch), output=profile_output, name=f"{name}-{size}",
                   warmup=1, runs=profile_runs)
    say(f"profile: {prof.num_layers} layers at batch {pbatch}, forward "
        f"{prof.forward_ms(0, prof.num_layers - 1):.1f} ms, backward "
        f"{prof.backward_ms(0, prof.num_layers - 1):.1f} ms "
        f"({time.perf_counter() - start:.1f} s to measure)")

    topo = parse_topology(topology) if topology else local_topology(devices)
    if plan_path:
        plan = Plan.load(plan_path)
    elif planner == "straight":
        plan = finish_plan(even_straight_plan(prof, topo.num_devices, micro_batches, batch),
                           prof, topo)
    elif planner == "dapple":
        plan = plan_dapple(prof, topo, batch)
    else:
        raise ValueError(f"planner must be 'dapple' or 'straight', got {planner!r}")
    plan.validate(num_layers=prof.num_layers)
    if plan_output:
        plan.save(plan_output)
    stages = ", ".join(f"[{s.first}-{s.last}] on {s.devices}" for s in plan.stages)
    est = f", estimated {plan.estimate.latency_ms:.1f} ms/step" if plan.estimate else ""
    say(f"plan: {plan.shape()} {stages}; M={plan.micro_batches}, schedule {plan.schedule}{est}")

    pm = PipelinedModel(model, plan)
    pm.compile(keras.optimizers.Adam(learning_rate),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    history = pm.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=verbose)
    seconds = time.perf_counter() - start
    say(f"trained {steps} steps in {seconds:.1f} s (first step includes building the graph); "
        f"loss {history.history['loss'][-1]:.4f}")
    return {"model": model, "profile": prof, "plan": plan, "history": history,
            "seconds": seconds}


def even_straight_plan(prof, stages: int, micro_batches: int, batch: int):
    """One stage a device, cut where the profile's forward+backward time splits evenly."""
    from planner.formats.plan import straight_plan
    n = prof.num_layers
    if stages > n:
        raise ValueError(f"{stages} stages need at least {stages} layers; the model has {n}")
    work = [l.forward_ms + l.backward_ms for l in prof.layers]
    total, acc, cuts = sum(work), 0.0, []
    for p, w in enumerate(work[:-1]):
        acc += w
        # cut after p when it passes the next even share, keeping a layer for every later stage
        if len(cuts) < stages - 1 and acc >= total * (len(cuts) + 1) / stages \
                and n - (p + 1) >= stages - 1 - len(cuts):
            cuts.append(p + 1)
    for p in range(n - 1, 0, -1):              # too few cuts (one heavy layer): cut at the end
        if len(cuts) == stages - 1:
            break
        if p not in cuts:
            cuts = sorted(cuts + [p])
    return straight_plan(sorted(cuts), n, micro_batches, batch)


def main_for(name: Optional[str]):
    """absl entry point; `name` fixes the example (an example file's `__main__`)."""
    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments {argv[1:]}")
        example = name or FLAGS.example
        if example is None:
            raise app.UsageError(f"--example is required: one of {EXAMPLES}")
        run(example, size=FLAGS.size, devices=FLAGS.devices, batch_size=FLAGS.batch_size,
            steps=FLAGS.steps, model_args=json.loads(FLAGS.model_args) if FLAGS.model_args
            else None, topology=FLAGS.topology, profile_batch=FLAGS.profile_batch,
            profile_runs=FLAGS.profile_runs, planner=FLAGS.planner, micro_batches=FLAGS.micro_batches,
            plan_path=FLAGS.plan, plan_output=FLAGS.plan_output,
            profile_output=FLAGS.profile_output, learning_rate=FLAGS.learning_rate)
    app.run(main)


if __name__ == "__main__":
    main_for(None)
