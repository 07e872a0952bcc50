"""dapple's data-parallel step under Horovod against plain Horovod's and against plain Keras's
own gradient accumulation, at M = 1, 2, 8 micro-batches (issue #28, items 2 and 3).

    python benchmarks/dp_step_horovod.py [--width=1024] [--blocks=4] [--batch=256]
        [--micro_batches=1,2,8] [--steps=10] [--repeats=3] [--timeline_dir=DIR]
        [--lane_depth=K] [--tensorflow]

The model is a residual MLP (`build`: `blocks` blocks of two Dense(width) layers and a skip
add, then a 10-way classifier), sparse categorical cross-entropy, SGD. For each M:

* dapple: `horovodrun -np 2 -H localhost:2 --gloo`, a data-parallel plan (one stage, 2
  replicas, M micro-batches: the lane's loop for M > 1, two micro-batches in flight on a CPU),
  `PipelinedModel.train_step`;
* horovod: the same 2 ranks, plain Horovod: each rank its half of the batch, M micro-batches'
  gradients summed in a Python loop inside one `tf.function`, then one `hvd.allreduce` per
  gradient (what `hvd.DistributedGradientTape` does; at M = 1 it is that tape), SGD apply;
* keras: one process, one thread, one rank's half of the batch, the same accumulation without
  Horovod: what a step costs with no collective at all;
* keras_pair: two such processes at once, each a rank's half: the same accumulation on the
  same cores as the 2 ranks (alone, the keras process's inter-op pool takes the second core,
  which a rank beside a busy rank does not get);
* dapple_k (with `--lane_depth=K`): dapple with its lanes keeping min(K, M) micro-batches in
  flight (`graph_rewrite.in_flight.CPU_LANE_DEPTH = K`; K = 1: the plan's one, each
  forward after the previous backward);
* tensorflow (with `--tensorflow`): dapple's same plan on the TensorFlow-cluster runtime,
  `dapple launch --runtime=tensorflow`, 2 processes (wall time only).

Every rank has one intra-op thread, `HOROVOD_CYCLE_TIME=0.1` (what `dapple launch` sets); the
median of `--steps` steps after 3 warm-up steps, kinds alternating, `--repeats` rounds, median
kept. Prints, in wall time and in rank 0's CPU time (all its threads; it moves less than wall
time when other jobs share the cores), ms per step, dapple / horovod, plain Keras's
accumulation factor (keras at M / keras at M = 1) and the issue's check: dapple / (horovod at
M = 1 x that factor), bound 1.1, with the factor of keras alone and of keras_pair (the same
cores); with the load average (the machine is shared). `--timeline_dir` also writes a Horovod timeline of the
dapple and horovod runs of the first round (HOROVOD_TIMELINE), one file per kind and M.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks.step_timing import (median_step_times, one_thread_env,  # noqa: E402
                                    read_step_cpu_ms, read_step_ms, report, run_checked,
                                    venv_bin)

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 1024, "units of every Dense layer")
flags.DEFINE_integer("blocks", 4, "residual blocks (two Dense layers and an add each)")
flags.DEFINE_integer("batch", 256, "global batch (each of the 2 ranks gets half)")
flags.DEFINE_list("micro_batches", ["1", "2", "8"], "values of M")
flags.DEFINE_integer("steps", 10, "timed steps per measurement (median kept)")
flags.DEFINE_integer("repeats", 3, "rounds of alternating measurements (median kept)")
flags.DEFINE_string("timeline_dir", "", "write Horovod timelines of the first round here")
flags.DEFINE_bool("tensorflow", False, "also time dapple's data-parallel step on the "
                  "TensorFlow-cluster runtime (`dapple launch --runtime=tensorflow`, 2 "
                  "processes): the measurement behind `dapple launch`'s default runtime")
flags.DEFINE_string("worker", "", "internal: time this kind (dapple, horovod, keras, "
                    "tensorflow)")
flags.DEFINE_integer("worker_m", 1, "internal: the worker's M")
flags.DEFINE_integer("lane_depth", 0, "also time dapple with its lanes keeping this many "
                     "micro-batches in flight on a CPU (`graph_rewrite.in_flight."
                     "CPU_LANE_DEPTH`, 2 by default; 1: the plan's one), the kind `dapple_k`")
KINDS = ("dapple", "horovod", "keras", "keras_pair")


def build(width: int = 1024, blocks: int = 4, classes: int = 10, seed: int = 0):
    import tensorflow as tf
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((width,))
    h = x
    for _ in range(blocks):
        inner = tf.keras.layers.Dense(width, activation="relu")(h)
        inner = tf.keras.layers.Dense(width)(inner)
        h = tf.keras.layers.Activation("relu")(tf.keras.layers.Add()([h, inner]))
    return tf.keras.Model(x, tf.keras.layers.Dense(classes)(h))


# ---- one rank (or the one process) of one measurement --------------------------------------------
def plain_step(model, x, y, M: int, reduce):
    """A `train_step`-like object: M micro-batches' gradients summed, `reduce`d, applied."""
    import tensorflow as tf
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.SGD(0.01)
    V = model.trainable_variables
    rows = x.shape[0] // M

    @tf.function
    def step(x, y):
        sums, loss = None, 0.0
        for m in range(M):
            with tf.GradientTape() as tape:
                part = loss_fn(y[m * rows:(m + 1) * rows],
                               model(x[m * rows:(m + 1) * rows], training=True)) / M
            tape = reduce.tape(tape) if reduce and M == 1 else tape
            grads = tape.gradient(part, V)
            sums = grads if sums is None else [a + g for a, g in zip(sums, grads)]
            loss = loss + part
        if reduce and M > 1:
            sums = [reduce.allreduce(g) for g in sums]
        optimizer.apply_gradients(zip(sums, V))
        return loss

    return types.SimpleNamespace(train_step=step)


def worker() -> None:
    import numpy as np
    kind, M = FLAGS.worker, FLAGS.worker_m
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # before TensorFlow, for every kind
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(FLAGS.batch, FLAGS.width).astype("float32"))
    y = tf.constant(rng.randint(0, 10, FLAGS.batch).astype("int32"))
    model = build(FLAGS.width, FLAGS.blocks)
    if kind in ("dapple", "dapple_k", "tensorflow"):
        if kind == "dapple_k":
            from graph_rewrite import in_flight
            in_flight.CPU_LANE_DEPTH = FLAGS.lane_depth
        pm = dapple.PipelinedModel(model, data_parallel_plan(model, M))
        pm.compile(tf.keras.optimizers.SGD(0.01),
                   tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return report(pm, *median_step_times(pm, x, y, FLAGS.steps))
    half = FLAGS.batch // 2
    if kind == "keras":
        step = plain_step(model, x[:half], y[:half], M, None)
        return report(types.SimpleNamespace(rank=0), *median_step_times(step, x[:half], y[:half],
                                                                        FLAGS.steps))
    import horovod.tensorflow as hvd
    hvd.init()
    hvd.broadcast_variables(model.variables, root_rank=0)
    mine = slice(hvd.rank() * half, (hvd.rank() + 1) * half)
    reduce = types.SimpleNamespace(tape=hvd.DistributedGradientTape, allreduce=hvd.allreduce)
    step = plain_step(model, x[mine], y[mine], M, reduce)
    report(types.SimpleNamespace(rank=hvd.rank()),
           *median_step_times(step, x[mine], y[mine], FLAGS.steps))


def data_parallel_plan(model, M: int):
    """One stage, 2 replicas, M micro-batches (the plan's lanes: one in flight)."""
    from graph_rewrite.model_graph import layer_order
    from planner.formats.plan import straight_plan
    return straight_plan([], len(layer_order(model)), M, FLAGS.batch, replicas=[2])


# ---- the parent ----------------------------------------------------------------------------------
def env(**extra) -> dict:
    return one_thread_env(REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)


def measure(kind: str, M: int, timeline: str = ""):
    """(wall ms, CPU ms) of one step of `kind` at `M` (rank 0's, for the 2-rank kinds)."""
    worker = "keras" if kind == "keras_pair" else kind
    argv = [sys.executable, os.path.abspath(__file__), f"--worker={worker}", f"--worker_m={M}",
            f"--width={FLAGS.width}", f"--blocks={FLAGS.blocks}", f"--batch={FLAGS.batch}",
            f"--steps={FLAGS.steps}", f"--lane_depth={FLAGS.lane_depth}"]
    if kind == "tensorflow":
        argv = [sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
                f"--plan={plan_file(M)}", "--"] + argv
        # The step runs in the 2 servers: the chief's own CPU time says nothing.
        return read_step_ms(run_checked(argv, env(), REPO)), float("nan")
    if kind == "keras_pair":
        pair = [subprocess.Popen(argv, env=env(), cwd=REPO, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE) for _ in range(2)]
        outs = [p.communicate(timeout=1800) for p in pair]
        for p, (out, err) in zip(pair, outs):
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)} failed:\n{(out + err)[-3000:]}")
        return read_step_ms(outs[0][0]), read_step_cpu_ms(outs[0][0])
    if kind != "keras":
        argv = [venv_bin("horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"] + argv
    extra = {"HOROVOD_TIMELINE": timeline} if timeline else {}
    out = run_checked(argv, env(**extra), REPO)
    return read_step_ms(out), read_step_cpu_ms(out)


def plan_file(M: int) -> str:
    """The data-parallel plan at M, written once for `dapple launch --plan`."""
    path = os.path.join(tempfile.gettempdir(), f"dp_step_plan_{os.getpid()}_M{M}.json")
    if not os.path.exists(path):
        if importlib.util.find_spec("tf_keras") is not None:
            os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
        import dapple  # noqa: F401  (before TensorFlow, as the workers)
        data_parallel_plan(build(FLAGS.width, FLAGS.blocks), M).save(path)
    return path


def main(argv):
    del argv
    if FLAGS.worker:
        return worker()
    Ms = [int(m) for m in FLAGS.micro_batches]
    print(f"command: python benchmarks/dp_step_horovod.py --width={FLAGS.width} "
          f"--blocks={FLAGS.blocks} --batch={FLAGS.batch} "
          f"--micro_batches={','.join(map(str, Ms))} --steps={FLAGS.steps} "
          f"--repeats={FLAGS.repeats}" + (f" --timeline_dir={FLAGS.timeline_dir}"
                                           if FLAGS.timeline_dir else "") +
          (f" --lane_depth={FLAGS.lane_depth}" if FLAGS.lane_depth else "") +
          (" --tensorflow" if FLAGS.tensorflow else ""))
    compared = FLAGS.lane_depth > 0
    kinds = KINDS + (("dapple_k",) if compared else ()) + \
        (("tensorflow",) if FLAGS.tensorflow else ())
    measured = {(k, M): [] for k in kinds for M in Ms}
    loads = []
    for round_ in range(FLAGS.repeats):
        for M in Ms:
            for kind in kinds:
                timeline = ""
                if FLAGS.timeline_dir and round_ == 0 and kind in ("dapple", "horovod"):
                    os.makedirs(FLAGS.timeline_dir, exist_ok=True)
                    timeline = os.path.join(os.path.abspath(FLAGS.timeline_dir),
                                            f"{kind}_M{M}.json")
                loads.append(os.getloadavg()[0])
                measured[(kind, M)].append(measure(kind, M, timeline))
    print(f"\nresidual MLP, {FLAGS.blocks} blocks x 2 Dense({FLAGS.width}), global batch "
          f"{FLAGS.batch}; dapple and horovod: 2 ranks (horovodrun --gloo), keras: one process "
          f"on one rank's half, keras_pair: two at once; 1 intra-op thread each; load average "
          f"{min(loads):.1f}..{max(loads):.1f}")
    for i, what in enumerate(("wall", "CPU")):
        med = {key: statistics.median(t[i] for t in v) for key, v in measured.items()}
        print(f"\n{what} ms per step (rank 0's), median of {FLAGS.repeats} rounds; accumulation "
              f"= keras at M / keras at M={Ms[0]}; check = dapple / (horovod at M={Ms[0]} x "
              f"accumulation), the issue's bound 1.1; pair: the same with keras_pair")
        print(f"{'M':>3}{'dapple':>9}{'horovod':>9}{'keras':>9}{'pair':>9}{'dapple/hvd':>12}"
              f"{'accumulation':>14}{'check':>8}{'pair acc.':>11}{'check':>8}" +
              (f"{'K=' + str(FLAGS.lane_depth):>9}{'K/hvd':>10}{'check':>8}" if compared else ""))
        for M in Ms:
            d, h, k, kp = (med[(kind, M)] for kind in KINDS)
            factor = k / med[("keras", Ms[0])]
            pair_factor = kp / med[("keras_pair", Ms[0])]
            bound = med[("horovod", Ms[0])] * factor
            pair_bound = med[("horovod", Ms[0])] * pair_factor
            row = (f"{M:>3}{d:>9.1f}{h:>9.1f}{k:>9.1f}{kp:>9.1f}{d / h:>12.3f}{factor:>14.3f}"
                   f"{d / bound:>8.3f}{pair_factor:>11.3f}{d / pair_bound:>8.3f}")
            if compared:
                e = med[("dapple_k", M)]
                row += f"{e:>9.1f}{e / h:>10.3f}{e / bound:>8.3f}"
            print(row)
        if compared:
            print(f"K={FLAGS.lane_depth}: dapple with min({FLAGS.lane_depth}, M) micro-batches "
                  f"in flight per lane (dapple: the default, 2 on a CPU)")
        if FLAGS.tensorflow and what == "wall":
            print("dapple on the TensorFlow-cluster runtime (2 processes), wall ms; / dapple "
                  "under horovodrun: " + ", ".join(
                      f"M={M} {med[('tensorflow', M)]:.1f} / {med[('dapple', M)]:.1f} = "
                      f"{med[('tensorflow', M)] / med[('dapple', M)]:.3f}" for M in Ms))
    print("\nper round (wall/CPU ms): " + "; ".join(
        f"{kind} M={M} " + ", ".join(f"{w:.0f}/{c:.0f}" for w, c in measured[(kind, M)])
        for M in Ms for kind in kinds))


if __name__ == "__main__":
    app.run(main)
