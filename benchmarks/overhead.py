"""What the pipelined runtime costs, and what a 2-stage pipeline gains, measured side by side.

    python benchmarks/overhead.py [--width=1024] [--depth=8] [--batch=256] [--steps=30]

(a) Overhead: `PipelinedModel.fit` with a 1-stage, 1-micro-batch plan against plain Keras
    `model.fit` on the same data and model (same initial weights), steps per second, the two
    alternating `--repeats` times (median kept) so machine noise hits both alike. Target: a
    ratio of at least 0.95.
(b) Pipeline: a 2-stage straight plan (M = `--micro_batches`, early backward) on two logical
    CPU devices against the same model on one device (a 1-stage plan), with one intra-op thread
    per op (`TF_NUM_INTRAOP_THREADS=1`) so each device computes on one core at a time. Printed
    next to the speedup the planner predicts (`planner.estimate.cost_model.evaluate` on a profile
    measured here with `dapple.profile` and `topology.local_topology(2)`).

Timings are wall-clock on a shared machine: read the ratios, not the absolute numbers.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("DAPPLE_NUM_CPU_DEVICES", "2")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "4")

from absl import app, flags  # noqa: E402

from predicted_vs_measured import build  # noqa: E402  (this folder is on sys.path)

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 1024, "units of every Dense layer")
flags.DEFINE_integer("depth", 8, "Dense layers")
flags.DEFINE_integer("batch", 256, "global batch")
flags.DEFINE_integer("steps", 30, "steps per timed epoch")
flags.DEFINE_integer("repeats", 3, "timed epochs per configuration (median kept)")
flags.DEFINE_integer("micro_batches", 4, "micro-batches of the 2-stage plan")


def build_model():
    return build(FLAGS.width, FLAGS.depth)   # the same MLP predicted_vs_measured.py times


def data():
    import numpy as np
    rng = np.random.RandomState(0)
    n = FLAGS.batch * FLAGS.steps
    return (rng.randn(n, FLAGS.width).astype("float32"),
            rng.randint(0, 10, size=n).astype("int32"))


def compile_args():
    import tensorflow as tf
    return dict(optimizer=tf.keras.optimizers.SGD(0.001),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def timed_fit(fit) -> float:
    """Steps per second of one epoch of `fit` (called once before to trace and warm up)."""
    start = time.perf_counter()
    fit()
    return FLAGS.steps / (time.perf_counter() - start)


def alternate(fits: dict) -> dict:
    for fit in fits.values():
        fit()                                      # warm-up: tracing, allocations
    samples = {name: [] for name in fits}
    for _ in range(FLAGS.repeats):
        for name, fit in fits.items():
            samples[name].append(timed_fit(fit))
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv):
    del argv
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401  (logical devices before TensorFlow initializes)
    import tensorflow as tf

    from dapple.pipelined_model import PipelinedModel
    from dapple.profiler import profile
    from planner.estimate.cost_model import evaluate
    from planner.formats.plan import straight_plan
    from topology.parse import local_topology

    tf.get_logger().setLevel("ERROR")
    x, y = data()
    n_layers = FLAGS.depth + 1
    fit_args = dict(batch_size=FLAGS.batch, epochs=1, shuffle=False, verbose=0)
    print(f"MLP {FLAGS.depth} x Dense({FLAGS.width}), global batch {FLAGS.batch}, "
          f"{FLAGS.steps} steps an epoch, median of {FLAGS.repeats}; intra-op threads "
          f"{os.environ['TF_NUM_INTRAOP_THREADS']}, inter-op {os.environ['TF_NUM_INTEROP_THREADS']}")

    # (a) overhead of the runtime itself
    plain = build_model()
    plain.compile(**compile_args())
    single = PipelinedModel(build_model(), straight_plan([], n_layers, 1, FLAGS.batch))
    single.compile(**compile_args())
    rates = alternate({"plain": lambda: plain.fit(x, y, **fit_args),
                       "dapple": lambda: single.fit(x, y, **fit_args)})
    ratio = rates["dapple"] / rates["plain"]
    print("\n(a) 1-stage, 1-micro-batch plan against plain Keras model.fit")
    print(f"{'':<34}{'steps/s':>10}")
    print(f"{'plain model.fit':<34}{rates['plain']:>10.2f}")
    print(f"{'PipelinedModel.fit':<34}{rates['dapple']:>10.2f}")
    print(f"ratio dapple / plain: {ratio:.3f} (target >= 0.95: {'met' if ratio >= 0.95 else 'MISSED'})")

    # (b) a 2-stage pipeline on two logical devices against one device
    cut = (n_layers + 1) // 2
    one_device = PipelinedModel(build_model(), straight_plan([], n_layers, 1, FLAGS.batch))
    one_device.compile(**compile_args())
    two_stage_plan = straight_plan([cut], n_layers, FLAGS.micro_batches, FLAGS.batch)
    two_stage = PipelinedModel(build_model(), two_stage_plan)
    two_stage.compile(**compile_args())
    rates = alternate({"one": lambda: one_device.fit(x, y, **fit_args),
                       "two": lambda: two_stage.fit(x, y, **fit_args)})
    measured = rates["two"] / rates["one"]

    prof = profile(build_model(), x[:FLAGS.batch], warmup=1, runs=3)
    topo = local_topology(2)
    one_plan = straight_plan([], n_layers, 1, FLAGS.batch)
    predicted = (evaluate(one_plan, prof, topo).latency_ms
                 / evaluate(two_stage_plan, prof, topo).latency_ms)
    print(f"\n(b) 2-stage straight plan (cut before layer {cut}, M={FLAGS.micro_batches}, "
          f"early backward) on 2 logical CPU devices against 1 device")
    print(f"{'':<34}{'steps/s':>10}")
    print(f"{'1 device (1-stage plan)':<34}{rates['one']:>10.2f}")
    print(f"{'2 stages on 2 devices':<34}{rates['two']:>10.2f}")
    print(f"measured speedup {measured:.2f}x; planner's predicted speedup {predicted:.2f}x "
          f"(bubble-free bound 2x; M/(M+S-1) = {FLAGS.micro_batches / (FLAGS.micro_batches + 1):.2f}"
          f" of it with S=2)")


if __name__ == "__main__":
    app.run(main)
