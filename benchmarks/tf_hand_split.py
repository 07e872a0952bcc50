"""The benchmark MLP split in two by hand over TensorFlow's distributed runtime, as issue #27's
hand-written split, against dapple's TF runtime and plain accumulation, side by side in one run:

    python benchmarks/tf_hand_split.py [--repeats=4] [--steps=12] [--width=1024] [--depth=8]
        [--batch=256] [--micro_batches=8]

Jobs (one intra-op thread a process, oneDNN on; each round runs them in turn, medians kept):

* plain, accumulating M: `tf_runtime_step.py`'s one process summing M micro-batches;
* hand split, free: 2 processes (`dapple launch --runtime=tensorflow --hosts=localhost:2`), the
  first half of the layers on task 0 and the rest on task 1, M micro-batches unrolled in one
  `tf.function` with no order beyond the data's (all forwards, then all backwards, as written;
  the executor runs whatever is ready), gradients summed as tensors;
* hand split, bounded: no order but 1f1b's bound on the micro-batches in flight, plus one (the
  memory dapple's lanes alone on a CPU hold, `graph_rewrite.in_flight`): task 0's forward m
  waits for its backward m - 3, task 1's micro-batch m (its forward and backward are one
  action here) for its micro-batch m - 2;
* hand split, 1f1b: the same with each task's forwards and backwards chained by control
  dependencies in 1f1b's order (task 0: F0 F1 B0 F2 B1 ...; task 1: F0 B0 F1 B1 ...);
* dapple, tensorflow 1f1b: `dapple launch --runtime=tensorflow` with the 1f1b plan of
  `schedule_step_time.py` (the same cut);
* horovod 1f1b: the same plan under `horovodrun` (`--nohorovod` leaves it out).

What it separates: what enforcing an order costs on these 2 cores (free, bounded and 1f1b, all
by hand), what dapple costs beyond a hand-written 1f1b, and how far from Horovod's step a
hand-written pipeline gets in each order.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks import tf_runtime_step as trs  # noqa: E402  (its flags and sst's)
from benchmarks import schedule_step_time as sst  # noqa: E402
from benchmarks.step_timing import RESULT, read_step_ms, run_checked  # noqa: E402

FLAGS = flags.FLAGS
ORDERS = ("free", "bounded", "1f1b")
flags.DEFINE_enum("hand_worker", "", ("",) + ORDERS, "internal: time the hand split")


def hand_worker(order: str) -> None:
    import dapple  # noqa: F401  (connects to the cluster, before TensorFlow)
    import numpy as np
    import tensorflow as tf
    from dapple.runtime.tf_cluster.cluster import task_device
    width, depth, classes, M = FLAGS.width, FLAGS.depth, 10, FLAGS.micro_batches
    cut = (depth + 1) // 2            # schedule_step_time's 1f1b cut, in Dense layers
    devices = task_device(0), task_device(1)
    rng = np.random.RandomState(0)

    def dense(n_in, n_out, device):
        with tf.device(device):
            return [tf.Variable(rng.randn(n_in, n_out).astype("float32") * 0.03),
                    tf.Variable(np.zeros(n_out, "float32"))]

    weights = ([v for _ in range(cut) for v in dense(width, width, devices[0])],
               [v for _ in range(cut, depth) for v in dense(width, width, devices[1])]
               + dense(width, classes, devices[1]))

    def first(h):
        for w, b in zip(weights[0][::2], weights[0][1::2]):
            h = tf.nn.relu(h @ w + b)
        return h

    def second(h, y):
        for w, b in zip(weights[1][:-2:2], weights[1][1:-2:2]):
            h = tf.nn.relu(h @ w + b)
        logits = h @ weights[1][-2] + weights[1][-1]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)) / M

    @tf.function
    def step(x, y):
        xs, ys = tf.split(x, M), tf.split(y, M)
        sums, tapes, last = [None, None], {}, [[], []]

        # bounded: (task 0, task 1) micro-batches in flight, 1f1b's warm-up depths plus one
        bound, done = (3, 2), ({}, {})     # done: task -> m -> tensors ending its backward m

        def after(task, m=None):
            if order == "1f1b":     # each task's actions one after another
                return tf.control_dependencies(last[task])
            if order == "bounded" and m is not None:
                return tf.control_dependencies(done[task].get(m - bound[task], []))
            return tf.control_dependencies([])

        def add(task, grads):
            sums[task] = grads if sums[task] is None else [a + g for a, g in
                                                           zip(sums[task], grads)]

        def forward(m):
            with tf.device(devices[0]), after(0, m), tf.GradientTape() as tape:
                h = first(xs[m])
            tapes[m], last[0] = (tape, h), [h]

        def backward(m):
            tape, h = tapes.pop(m)
            with tf.device(devices[1]), after(1, m):
                with tf.GradientTape() as tape1:
                    tape1.watch(h)
                    loss = second(tf.identity(h), ys[m])
                grads = tape1.gradient(loss, [h] + weights[1])
                add(1, grads[1:])
                last[1] = done[1][m] = grads[:1]
            with tf.device(devices[0]), after(0):
                grads0 = tape.gradient(h, weights[0], output_gradients=grads[0])
                add(0, grads0)
                last[0], done[0][m] = grads0[:1], grads0

        if order == "free":
            for m in range(M):
                forward(m)
            for m in range(M):
                backward(m)
        else:
            forward(0)
            forward(1)
            for m in range(M):
                backward(m)
                if m + 2 < M:
                    forward(m + 2)
        updates = []
        for task in (0, 1):
            with tf.device(devices[task]):
                updates += [v.assign_sub(0.01 * g) for v, g in zip(weights[task], sums[task])]
        with tf.control_dependencies(updates):
            return tf.constant(0.0)

    x = rng.randn(FLAGS.batch, width).astype("float32")
    y = rng.randint(0, classes, FLAGS.batch).astype("int32")
    for _ in range(3):
        step(x, y).numpy()
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        step(x, y).numpy()
        times.append(1e3 * (time.perf_counter() - start))
    print(RESULT + json.dumps(statistics.median(times)), flush=True)


def hand_split_ms(order: str) -> float:
    cmd = [sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
           "--hosts=localhost:2", "--", sys.executable, os.path.abspath(__file__),
           f"--hand_worker={order}"] + trs.sizes()
    return read_step_ms(run_checked(cmd, sst.env(), REPO))


def main(argv):
    del argv
    if FLAGS.hand_worker:
        return hand_worker(FLAGS.hand_worker)
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"    # every job inherits it
    print("command: python benchmarks/tf_hand_split.py " + " ".join(
        [f"--repeats={FLAGS.repeats}"] + trs.sizes()))
    jobs = {f"plain, accumulating {FLAGS.micro_batches}": lambda p: trs.measure(
                "plain-accumulating"),
            **{f"hand split, {order}": lambda p, o=order: hand_split_ms(o) for order in ORDERS},
            "dapple, tensorflow 1f1b": lambda p: trs.measure("tensorflow", p)}
    if FLAGS.horovod:
        jobs["horovod 1f1b"] = lambda p: trs.measure("horovod", p)
    figures = {name: [] for name in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "1f1b.json")
        sst.plans(FLAGS.depth + 1)["1f1b"].save(plan_path)
        for r in range(FLAGS.repeats):
            for name, job in jobs.items():
                figures[name].append(job(plan_path))
                print(f"round {r + 1}: {name} {figures[name][-1]:.1f} ms "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    ms = {name: statistics.median(v) for name, v in figures.items()}
    plain = ms[f"plain, accumulating {FLAGS.micro_batches}"]
    print("\nmedian step, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    print("over plain accumulation: " + ", ".join(
        f"{k} {v / plain:.3f}" for k, v in ms.items() if not k.startswith("plain")))
    print(f"hand 1f1b / hand free (what the order costs): "
          f"{ms['hand split, 1f1b'] / ms['hand split, free']:.3f}; dapple / hand 1f1b: "
          f"{ms['dapple, tensorflow 1f1b'] / ms['hand split, 1f1b']:.3f}")
    if FLAGS.horovod:
        print("horovod 1f1b over: " + ", ".join(
            f"{k} {ms['horovod 1f1b'] / v:.3f}" for k, v in ms.items() if k != "horovod 1f1b"))


if __name__ == "__main__":
    flags.FLAGS.set_default("repeats", 4)
    flags.FLAGS.set_default("steps", 12)
    app.run(main)
