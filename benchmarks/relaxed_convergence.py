"""Convergence of the relaxed schedules against synchronous 1F1B, on a real data set that ships
inside a package (scikit-learn's digits: 1797 8x8 images, no download).

    .venv/bin/pip install scikit-learn          # not part of the default environment
    .venv/bin/python benchmarks/relaxed_convergence.py [--target=0.95] [--lr=0.1]
        [--seeds=0,1,2,3,4] [--epochs=20] [--output=docs/images/relaxed_convergence.png] [--markdown]

The same small MLP (64-64-64-32-10, tanh/relu, same initial weights) trains with plain SGD on
the same shuffled global batches (B = 32, M = 4, two stages cut after the second layer) under:

* 1f1b: synchronous (the plain model's SGD), a step per global batch;
* pipedream: an update per micro-batch on its mean loss, weight stashing;
* pipedream lr/M: the same with the learning rate divided by M (about synchronous training's
  step per global batch, spread over M updates);
* 2bw: an update per global batch from the weights one update old;
* avgpipe: 2 pipelines (stages replicated 2:2), each its own global batch, elastic averaging;
  a step consumes 2 global batches.

Each trains `--epochs` epochs in runs of `--steps_per_execution` global batches (AvgPipe:
that many steps) and evaluates the model's weights (AvgPipe: the reference z) on the held-out
test set after every run. Per seed (initial weights, data split and order), the first run
whose test accuracy reaches `--target` counts. Prints, per schedule, the global batches (and
optimizer updates) consumed to reach the target, the median over the seeds and each seed's,
and the simulated time that takes: the batches times the simulator's time per global batch of the same plan on the
paper's Table V configuration A (`--topology`), with this model's profile measured here
(`dapple.profile`; a tiny model, so link latencies weigh much). Writes the test accuracy and
training-loss curves of the first seed against global batches consumed as a PNG.
"""
from __future__ import annotations

import importlib.util
import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
for key, value in (("TF_CPP_MIN_LOG_LEVEL", "2"), ("TF_NUM_INTRAOP_THREADS", "1"),
                   ("TF_NUM_INTEROP_THREADS", "4"), ("OMP_NUM_THREADS", "1"),
                   ("CUDA_VISIBLE_DEVICES", "")):
    os.environ.setdefault(key, value)

if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
import dapple  # noqa: E402  (configures logical devices before TensorFlow initializes)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.tables import print_table  # noqa: E402
from planner.estimate.cost_model import pipeline_costs  # noqa: E402
from planner.formats.plan import straight_plan  # noqa: E402
from planner.estimate.simulator import simulate_plan  # noqa: E402
from topology.parse import parse_topology  # noqa: E402

B, M, TEST_ROWS, TRAIN_BATCHES = 32, 4, 512, 40    # 1792 of the 1797 images


def digits(seed: int):
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("this benchmark needs scikit-learn's bundled digits: "
                 ".venv/bin/pip install scikit-learn")
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    train = TRAIN_BATCHES * B          # whole runs of 4 steps, and of AvgPipe's 2 x 4 batches
    return (x[TEST_ROWS:TEST_ROWS + train], y[TEST_ROWS:TEST_ROWS + train]), \
        (x[:TEST_ROWS], y[:TEST_ROWS])


def mlp(seed: int = 0) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((64,), name="pixels")
    h = tf.keras.layers.Dense(64, activation="tanh", name="d1")(x)
    h = tf.keras.layers.Dense(64, activation="tanh", name="d2")(h)
    h = tf.keras.layers.Dense(32, activation="relu", name="d3")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(10, name="logits")(h), name="digits_mlp")


RUNS = [
    # (label, schedule, replicas, learning-rate divisor)
    ("1f1b", "1f1b", [1, 1], 1),
    ("pipedream", "pipedream", [1, 1], 1),
    ("pipedream lr/M", "pipedream", [1, 1], M),
    ("2bw", "2bw", [1, 1], 1),
    ("avgpipe (N = 2)", "avgpipe", [2, 2], 1),
]


def plan_for(schedule, replicas):
    return straight_plan([2], 4, M, B, replicas=replicas, schedule=schedule)


def train(label, schedule, replicas, divisor, data, args, seed):
    (xt, yt), (xv, yv) = data
    N = replicas[0] if schedule == "avgpipe" else 1
    relaxed = schedule != "1f1b"
    k = args.steps_per_execution
    pm = dapple.PipelinedModel(mlp(seed), plan_for(schedule, replicas))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pm.compile(tf.keras.optimizers.SGD(args.lr / divisor), loss, metrics=["accuracy"],
               **({"steps_per_execution": k} if relaxed else {}))
    per_batch_updates = M if schedule == "pipedream" else 1
    curve, reached = [], None
    batches_seen, rng = 0, np.random.RandomState(seed + 1)
    start = time.time()
    for epoch in range(args.epochs):
        order = rng.permutation(len(xt))          # the same order for every schedule
        x, y = xt[order], yt[order]
        run_rows = k * N * B
        for lo in range(0, len(x) - run_rows + 1, run_rows):
            xr, yr = x[lo:lo + run_rows], y[lo:lo + run_rows]
            if relaxed:
                run_loss = float(pm.train_step(xr, yr))
            else:
                run_loss = float(np.mean([pm.train_step(xr[i:i + B], yr[i:i + B])
                                          for i in range(0, run_rows, B)]))
            batches_seen += k * N
            accuracy = pm.evaluate(xv, yv, return_dict=True)["accuracy"]
            curve.append((batches_seen, run_loss, accuracy))
            if reached is None and accuracy >= args.target:
                reached = batches_seen
    print(f"  seed {seed} {label}: {len(curve)} runs in {time.time() - start:.0f} s, target "
          f"at {reached} global batches, final test accuracy {curve[-1][2]:.3f}", flush=True)
    return dict(label=label, schedule=schedule, replicas=replicas, curve=curve, reached=reached,
                updates=None if reached is None else reached * per_batch_updates // N)


def simulated_ms_per_batch(schedule, replicas, profile, topology, k) -> float:
    plan = plan_for(schedule, replicas)
    if schedule != "1f1b":
        plan = dataclasses.replace(plan, batches=k)
    return simulate_plan(plan, pipeline_costs(plan, profile, topology)).batch_ms


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--steps_per_execution", type=int, default=4)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--topology", default="A")
    p.add_argument("--output", default=os.path.join(HERE, "..", "docs", "images",
                                                    "relaxed_convergence.png"))
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()

    seeds = [int(s) for s in args.seeds.split(",")]
    train_rows = len(digits(seeds[0])[0][0])
    print(f"digits: {train_rows} training rows ({train_rows // B} global batches of {B}), "
          f"{TEST_ROWS} test rows; SGD lr {args.lr}, M = {M}, runs of "
          f"{args.steps_per_execution} steps, {args.epochs} epochs, target test accuracy "
          f"{args.target}, seeds {seeds}", flush=True)
    profile = dapple.profile(mlp(seeds[0]), digits(seeds[0])[0][0][:B])
    topology = parse_topology(args.topology)
    by_seed = {seed: [train(*run, digits(seed), args, seed) for run in RUNS] for seed in seeds}
    results = []
    for i, (label, schedule, replicas, _) in enumerate(RUNS):
        runs = [by_seed[seed][i] for seed in seeds]
        r = dict(runs[0], per_seed=[x["reached"] for x in runs],
                 per_seed_updates=[x["updates"] for x in runs],
                 final=[x["curve"][-1][2] for x in runs])
        r["batch_ms"] = simulated_ms_per_batch(schedule, replicas, profile, topology,
                                               args.steps_per_execution)
        results.append(r)

    header = ["schedule", "devices", "global batches to target: median (per seed)",
              "updates to target (median)", f"simulated ms per global batch ({args.topology})",
              "simulated ms to target (median)", "test accuracy after all epochs (median)"]
    rows = []
    for r in results:
        reached, updates = median(r["per_seed"]), median(r["per_seed_updates"])
        rows.append([r["label"], str(sum(r["replicas"])),
                     f"{fmt(reached)} ({', '.join(fmt(v) for v in r['per_seed'])})",
                     fmt(updates), f"{r['batch_ms']:.3f}",
                     "-" if reached is None else f"{reached * r['batch_ms']:.0f}",
                     f"{float(np.median(r['final'])):.3f}"])
    print_table(header, rows, args.markdown)
    plot(results, args)


def median(values):
    """The median, counting a seed that never reached the target as infinitely late; None
    when that is the median."""
    m = float(np.median([float("inf") if v is None else v for v in values]))
    return None if m == float("inf") else m


def fmt(value) -> str:
    return "never" if value is None else f"{value:g}"


def plot(results, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs = [c[0] for c in r["curve"]]
        ax_loss.plot(xs, [c[1] for c in r["curve"]], label=r["label"])
        ax_acc.plot(xs, [c[2] for c in r["curve"]], label=r["label"])
    ax_loss.set(xlabel="global batches consumed", ylabel="training loss (mean over a run)",
                yscale="log", title="digits MLP, SGD lr %g, M = %d (first seed)" % (args.lr, M))
    ax_acc.set(xlabel="global batches consumed", ylabel="test accuracy", ylim=(0.5, 1.0),
               title="test accuracy after each run")
    ax_acc.axhline(args.target, color="grey", linestyle=":", linewidth=1)
    ax_acc.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {os.path.relpath(args.output)}")


if __name__ == "__main__":
    main()
