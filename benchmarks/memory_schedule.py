"""Peak memory of one training step, GPipe against early backward (the DAPPLE paper's Table VI).

    python benchmarks/memory_schedule.py [--micro_batch=64] [--width=4096] [--layers=6]

A 2-stage straight pipeline on two logical CPU devices; a model whose activations dominate its
weights (wide LayerNormalization/tanh layers, a small classifier); the micro-batch size fixed and
M = 2, 4, 8, 16 micro-batches (so the global batch grows with M, as in Table VI). For each
schedule and M: one warm-up step (tracing, first allocations), then the process's peak bytes
during one more step above what was live before it (`tf.config.experimental.
get_memory_info`; TensorFlow's CPU allocator is process-wide, so CPU:0 reports the memory of
both logical devices, i.e. both stages together).

Expected: GPipe holds all M micro-batches' activations before the first backward, so its peak
grows with M; early backward (policy A) holds at most K_0 = 2 on stage 0 and 1 on stage 1, so
its peak stays flat. Interleaved (v = 2: the same layers in 4 chunks, chunk c on device c % 2)
warms up with 2(S - 1) + (v - 1) g chunk forwards (g: micro-batches per group, 2 or 3 here),
each of half a stage: also flat, a little above early backward. zb-h1 holds full activations
as early backward does, plus what W still needs (the weight-using ops' inputs and output
gradients) for up to s + 1 micro-batches on stage s. Prints the table and ratios.
"""
from __future__ import annotations

import importlib.util
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("DAPPLE_NUM_CPU_DEVICES", "2")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("micro_batch", 64, "rows per micro-batch (fixed while M grows)")
flags.DEFINE_integer("width", 4096, "features of every activation")
flags.DEFINE_integer("layers", 6, "LayerNormalization+tanh pairs per stage")
flags.DEFINE_list("micro_batches", ["2", "4", "8", "16"], "values of M")
flags.DEFINE_list("schedules", ["gpipe", "A", "zb-h1", "interleaved"],
                  "schedules to compare (interleaved: v = 2 chunks per device)")

MB = 2 ** 20


def build_model(width: int, layers: int):
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((width,), name="x")
    h = x
    for i in range(2 * layers):
        h = tf.keras.layers.LayerNormalization(name=f"norm{i}")(h)
        h = tf.keras.layers.Activation("tanh", name=f"tanh{i}")(h)
    out = tf.keras.layers.Dense(10, name="classifier")(h)
    return tf.keras.Model(x, out, name="activation_heavy")


def step_peak_bytes(schedule: str, M: int) -> float:
    """Peak bytes above the live baseline during one training step (after a warm-up step)."""
    import numpy as np
    import tensorflow as tf

    from dapple.pipelined_model import PipelinedModel
    from planner.search.chunking import interleaved_plan
    from planner.formats.plan import straight_plan

    model = build_model(FLAGS.width, FLAGS.layers)
    n = len(model.layers) - 1                       # layers without the InputLayer
    batch = FLAGS.micro_batch * M
    if schedule == "interleaved":     # 2 device groups x 2 chunks, cut at the quarters
        q = FLAGS.layers
        plan = interleaved_plan([q, 2 * q, 3 * q], n, M, 2, batch)
    else:
        plan = straight_plan([2 * FLAGS.layers], n, M, batch, schedule=schedule)
    pm = PipelinedModel(model, plan)
    pm.compile(tf.keras.optimizers.SGD(0.01),
               tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(batch, FLAGS.width).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=batch).astype("int32"))
    pm.train_step(x, y).numpy()                     # trace + first allocations
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    pm.train_step(x, y).numpy()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return float(peak - before)


def main(argv):
    del argv
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401  (logical devices before TensorFlow initializes)
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")     # one new model per row: retracing is expected
    Ms = [int(m) for m in FLAGS.micro_batches]
    act = FLAGS.micro_batch * FLAGS.width * 4 / MB
    print(f"2-stage pipeline, {2 * FLAGS.layers} LayerNorm+tanh pairs of width {FLAGS.width}, "
          f"micro-batch {FLAGS.micro_batch} rows ({act:.1f} MiB per activation tensor)")
    results = {s: {} for s in FLAGS.schedules}
    for M in Ms:
        for s in FLAGS.schedules:
            results[s][M] = step_peak_bytes(s, M)
    names = {"gpipe": "GPipe", "A": "early backward (A)", "B": "early backward (B)",
             "interleaved": "interleaved (v=2)", "zb-h1": "zb-h1"}
    header = f"{'schedule':<20}" + "".join(f"{'M=' + str(M):>12}" for M in Ms)
    print("\npeak memory of one training step above the live baseline (MiB)")
    print(header)
    for s in FLAGS.schedules:
        print(f"{names.get(s, s):<20}" + "".join(f"{results[s][M] / MB:>12.1f}" for M in Ms))
    if "gpipe" in results and "A" in results:
        print(f"{'GPipe / early':<20}" + "".join(
            f"{results['gpipe'][M] / results['A'][M]:>12.2f}" for M in Ms))
    for s in FLAGS.schedules:
        if 4 in results[s] and 16 in results[s]:
            print(f"{names.get(s, s)}: peak at M=16 / M=4 = "
                  f"{results[s][16] / results[s][4]:.2f}")
    if "zb-h1" in results and "A" in results:
        worst = max(results["zb-h1"][M] / results["A"][M] for M in Ms if M >= 4)
        print(f"zb-h1 / early backward, worst for M >= 4: {worst:.2f} (target <= 1.15: "
              f"{'met' if worst <= 1.15 else 'NOT met'})")
    if "A" in results and 4 in results["A"] and 16 in results["A"]:
        growth = results["A"][16] / results["A"][4] - 1
        print(f"early backward flat within 10% from M=4 to 16: "
              f"{'yes' if abs(growth) <= 0.10 else 'NO'} ({growth:+.1%})")


if __name__ == "__main__":
    app.run(main)
