"""A pipeline over TensorFlow's distributed runtime against one plain Keras process and against
the Horovod runtime, measured side by side in one run (issue #27).

    python benchmarks/tf_runtime_step.py [--width=1024] [--depth=8] [--batch=256]
        [--micro_batches=8] [--steps=10] [--repeats=3] [--schedules=1f1b,interleaved,zb-h1]
        [--loop_schedules=1f1b] [--out_of_line_schedules=1f1b] [--onednn=true]

The model and plans are `benchmarks/schedule_step_time.py`'s (an MLP of `depth` Dense(width),
2 stages cut in the middle; interleaved: v = 2). Every measurement is its own job, one intra-op
thread per process, median of `--steps` steps after 3 warm-up steps; the jobs alternate in each
of `--repeats` rounds and the median over rounds is kept:

* plain: `model.train_on_batch` in one process (which keeps both cores busy through inter-op
  parallelism: the fair reference for 2 processes on 2 cores);
* plain, accumulating M: the same process summing M micro-batches' gradients (one tape each)
  before one update: what micro-batching alone costs, with no pipeline;
* tensorflow/<schedule>: `dapple launch --runtime=tensorflow` on 2 processes;
* tensorflow/<schedule>, looped (`--loop_schedules`): the same with `pipeline_loop=True`, its
  steady periods one `tf.while_loop` spanning both tasks (a schedule also in `--schedules`);
* tensorflow/<schedule>, out of line (`--out_of_line_schedules`): the same with
  `inline_stage_calls=False`, the stage calls kept out of line instead of inlined into the step
  as both runtimes do by default (horovod/1f1b too, with 1f1b);
* tensorflow/<schedule>-grouped (`--grouped_schedules`, default 1f1b): the same with
  `--group_devices`: one process holding this host's 2 devices (so no Send/Recv at all on one
  host), with 2 intra-op threads (the per-slot processes' threads together);
* tensorflow/1f1b, weights on the chief (copies|reads): the same with the model's weights
  trained on the chief instead of on each stage's device (`DAPPLE_TF_WEIGHTS`): `copies`, a
  remote stage reads working copies refreshed every step; `chief`, every unit reads the
  weights on the chief, once per micro-batch and again in its backward;
* horovod/1f1b: `horovodrun -np 2` (HOROVOD_CYCLE_TIME=0.1, as schedule_step_time.py); with
  1f1b in `--loop_schedules`, also looped. Across processes `PipelinedModel` runs a pipeline
  unrolled by default: the unrolled figures are what a user gets.

Prints every figure, then the ratios: tensorflow 1f1b / plain, horovod / tensorflow (1f1b),
and each schedule's step over 1f1b's, measured and simulated with this runtime's transfer
model (`transfers: "tensorflow"`; the model profiled at the micro-batch size, the link
measured in the run unless `--tf_link` gives it). The machine may be shared: read the load
average printed.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks import schedule_step_time as sst  # noqa: E402  (its flags: width, depth, ...)
from benchmarks.step_timing import RESULT, read_step_ms, run_checked  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("schedules", ["1f1b", "interleaved", "zb-h1"], "schedules on the TF runtime")
flags.DEFINE_bool("plain_worker", False, "internal: time plain Keras in this process")
flags.DEFINE_bool("accumulate", False, "internal: the plain worker accumulates gradients over "
                  "--micro_batches micro-batches (one GradientTape each) before one update")
flags.DEFINE_bool("horovod", True, "also time 1f1b under horovodrun")
flags.DEFINE_string("tf_link", "measured",
                    "the link between the 2 processes for the simulator's prediction: "
                    "'measured' (`dapple topology --measure` on 2 local tasks, in this run: "
                    "latency, bandwidth and what a transfer's ends take of the tasks' CPU), or "
                    "a topology spec's keys, e.g. 'nvlink=2.8GB/s,nvlink_latency=0.1ms' (issue "
                    "#27's Send/Recv: 0.11 ms for 16 KiB, 1.6 ms for 4 MiB, idle)")
flags.DEFINE_bool("onednn", True, "TF_ENABLE_ONEDNN_OPTS=1 for every job, plain and dapple alike "
                  "(TensorFlow 2.18 leaves oneDNN off on AVX2-only CPUs such as this machine's, "
                  "and Eigen's products at micro-batch rows are slow: docs/cluster.md)")
flags.DEFINE_bool("grouped", True, "also time --grouped_schedules with --group_devices: this "
                  "host's 2 devices in one process (transfers are device copies)")
flags.DEFINE_list("grouped_schedules", ["1f1b"], "the schedules --grouped times: what each "
                  "costs without Send/Recv")
flags.DEFINE_list("loop_schedules", [], "also time these schedules on the TF runtime with "
                  "pipeline_loop=True (steady periods as a tf.while_loop), e.g. 1f1b")
flags.DEFINE_list("out_of_line_schedules", [], "also time these schedules on the TF runtime with "
                  "inline_stage_calls=False (with 1f1b, Horovod's 1f1b too), e.g. 1f1b")
flags.DEFINE_list("chief_weights", ["copies", "chief"], "also time tensorflow 1f1b with the "
                  "weights trained on the chief (DAPPLE_TF_WEIGHTS=copies: working copies "
                  "refreshed every step; =chief: every unit reads them there)")


def plain_worker() -> None:
    import json
    import time

    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401  (before TensorFlow)
    import numpy as np
    import tensorflow as tf
    from benchmarks.predicted_vs_measured import build
    model = build(**sst.model_args())
    model.compile(tf.keras.optimizers.SGD(0.01),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    x = rng.randn(FLAGS.batch, FLAGS.width).astype("float32")
    y = rng.randint(0, 10, FLAGS.batch).astype("int32")
    step = (accumulating_step(model, FLAGS.micro_batches) if FLAGS.accumulate
            else model.train_on_batch)
    for _ in range(3):
        step(x, y)
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        step(x, y)
        times.append(1e3 * (time.perf_counter() - start))
    print(RESULT + json.dumps(statistics.median(times)), flush=True)


def accumulating_step(model, micro_batches: int):
    """Plain Keras with gradient accumulation, as a user would write it: the cost of
    micro-batching alone, without any pipeline."""
    import tensorflow as tf
    rows = FLAGS.batch // micro_batches

    @tf.function
    def step(x, y):
        total = None
        for m in range(micro_batches):
            with tf.GradientTape() as tape:
                logits = model(x[m * rows:(m + 1) * rows], training=True)
                loss = model.loss(y[m * rows:(m + 1) * rows], logits) / micro_batches
            grads = tape.gradient(loss, model.trainable_variables)
            total = grads if total is None else [a + g for a, g in zip(total, grads)]
        model.optimizer.apply_gradients(zip(total, model.trainable_variables))
    return lambda x, y: step(tf.constant(x), tf.constant(y))


def grouped() -> list:
    return FLAGS.grouped_schedules if FLAGS.grouped else []


def sizes() -> list:
    return [f"--width={FLAGS.width}", f"--depth={FLAGS.depth}", f"--batch={FLAGS.batch}",
            f"--micro_batches={FLAGS.micro_batches}", f"--steps={FLAGS.steps}"]


def job_command(kind: str, plan_path: str = "", loop: bool = False,
                out_of_line: bool = False) -> list:
    """The command of one job: `kind` plain | plain-accumulating | tensorflow |
    tensorflow-grouped | horovod (a plan's kinds run `plan_path`; `loop`, `out_of_line`: with
    `pipeline_loop=True`, `inline_stage_calls=False`)."""
    if kind.startswith("plain"):
        return [sys.executable, os.path.abspath(__file__), "--plain_worker"] + sizes() + (
            ["--accumulate"] if kind == "plain-accumulating" else [])
    worker = [sys.executable, os.path.join(HERE, "schedule_step_time.py"),
              f"--worker_plan={plan_path}"] + sizes() + (["--worker_loop"] if loop else []) + (
                  ["--worker_out_of_line"] if out_of_line else [])
    if kind == "horovod":
        return sst.horovodrun(worker)
    return [sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
            f"--plan={plan_path}"] + (["--group_devices"] if kind == "tensorflow-grouped"
                                      else []) + ["--"] + worker


def measure(kind: str, plan_path: str = "", extra_env=None, loop: bool = False,
            out_of_line: bool = False) -> float:
    env = dict(sst.env(), **(extra_env or {}))
    if kind == "tensorflow-grouped":
        # One process holds both devices: give it the threads the two per-slot processes
        # have between them, else its two stages share a single intra-op thread.
        env["TF_NUM_INTRAOP_THREADS"] = "2"
    return read_step_ms(run_checked(job_command(kind, plan_path, loop, out_of_line), env, REPO))


def predicted_ms(plans: dict) -> dict:
    """Each plan's simulated step with this runtime's transfer model ("tensorflow": buffered,
    full duplex) over `--tf_link`, from a profile of the model at the micro-batch size."""
    import dataclasses
    import json

    from planner.estimate.cost_model import pipeline_costs
    from planner.formats.profile_readers import load_profile
    from planner.estimate.simulator import simulate_plan
    from topology.parse import parse_topology
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mlp.json")
        run_checked([sys.executable, "-m", "dapple.cli", "profile",
                     "--model=benchmarks.predicted_vs_measured:build",
                     f"--model_args={json.dumps(sst.model_args())}",
                     f"--batch_size={FLAGS.batch // FLAGS.micro_batches}", f"--output={path}",
                     "--runs=20", "--warmup=3"], sst.env(), REPO)
        profile = load_profile(path)
        topology = parse_topology(f"1x2,{FLAGS.tf_link}") if FLAGS.tf_link != "measured" \
            else measured_link(os.path.join(tmp, "topology.json"))
    print(f"simulated on: {topology.describe()}")
    return {name: simulate_plan(dataclasses.replace(plan, transfers="tensorflow"),
                                pipeline_costs(plan, profile, topology)).iteration_ms
            for name, plan in plans.items()}


def measured_link(path: str):
    """The link between 2 local tasks of one intra-op thread each, measured now."""
    from topology.parse import parse_topology
    run_checked([sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
                 "--hosts=localhost:2", "--", sys.executable, "-m", "dapple.cli", "topology",
                 "--measure", "--format=json", f"--output={path}", "--message_size=2MiB"],
                sst.env(), REPO)
    return parse_topology(path)


def main(argv):
    del argv
    if FLAGS.plain_worker:
        return plain_worker()
    if set(grouped()) - set(FLAGS.schedules):
        raise app.UsageError(f"--grouped_schedules={','.join(grouped())}: each needs its "
                             f"per-slot step too; add it to --schedules")
    if set(FLAGS.out_of_line_schedules) - set(FLAGS.schedules):
        raise app.UsageError(f"--out_of_line_schedules={','.join(FLAGS.out_of_line_schedules)}: "
                             f"each needs its default (inlined) step too; add it to --schedules")
    if set(FLAGS.loop_schedules) - set(FLAGS.schedules):
        raise app.UsageError(f"--loop_schedules={','.join(FLAGS.loop_schedules)}: each needs its "
                             f"unrolled step too; add it to --schedules")
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if FLAGS.onednn else "0"   # every job inherits it
    print("command: python benchmarks/tf_runtime_step.py " + " ".join(
        sizes() + [f"--repeats={FLAGS.repeats}", f"--schedules={','.join(FLAGS.schedules)}",
                   f"--loop_schedules={','.join(FLAGS.loop_schedules)}",
                   f"--out_of_line_schedules={','.join(FLAGS.out_of_line_schedules)}",
                   f"--chief_weights={','.join(FLAGS.chief_weights)}",
                   f"--horovod={FLAGS.horovod}",
                   f"--grouped_schedules={','.join(grouped())}",
                   f"--onednn={FLAGS.onednn}"]))
    every = sst.plans(FLAGS.depth + 1)
    jobs = [("plain", "plain", None),
            (f"plain, accumulating {FLAGS.micro_batches}", "plain-accumulating", None)] + [(f"tensorflow/{s}", "tensorflow", s)
                                         for s in FLAGS.schedules]
    jobs += [(f"tensorflow/{s}, looped", "tensorflow", s) for s in FLAGS.loop_schedules]
    jobs += [(f"tensorflow/{s}, out of line", "tensorflow", s)
             for s in FLAGS.out_of_line_schedules]
    for mode in FLAGS.chief_weights:
        jobs.append((f"tensorflow/1f1b, weights on the chief ({mode})", "tensorflow", "1f1b"))
    jobs += [(f"tensorflow/{s}-grouped", "tensorflow-grouped", s) for s in grouped()]
    if FLAGS.horovod:
        jobs.append(("horovod/1f1b", "horovod", "1f1b"))
        if "1f1b" in FLAGS.loop_schedules:   # both runtimes looped
            jobs.append(("horovod/1f1b, looped", "horovod", "1f1b"))
        if "1f1b" in FLAGS.out_of_line_schedules:
            jobs.append(("horovod/1f1b, out of line", "horovod", "1f1b"))
    figures = {name: [] for name, _, _ in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for s in {s for _, _, s in jobs if s}:
            paths[s] = os.path.join(tmp, f"{s}.json")
            every[s].save(paths[s])
        for r in range(FLAGS.repeats):
            for name, kind, schedule in jobs:
                extra = ({"DAPPLE_TF_WEIGHTS": name.split("(")[1].rstrip(")")}
                         if "on the chief" in name else None)
                figures[name].append(measure(kind, paths.get(schedule, ""), extra,
                                             loop=name.endswith(", looped"),
                                             out_of_line=name.endswith(", out of line")))
                print(f"round {r + 1}: {name} {figures[name][-1]:.1f} ms "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    ms = {name: statistics.median(v) for name, v in figures.items()}
    predicted = predicted_ms({s: every[s] for s in FLAGS.schedules})
    print("\nmedian step, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    if "tensorflow/1f1b" in ms:
        accumulating = ms[f"plain, accumulating {FLAGS.micro_batches}"]
        print(f"tensorflow 1f1b / plain: {ms['tensorflow/1f1b'] / ms['plain']:.3f} "
              f"(target <= 1.25); / plain accumulating {FLAGS.micro_batches} micro-batches "
              f"(the cost of micro-batching alone): {ms['tensorflow/1f1b'] / accumulating:.3f}")
        if "horovod/1f1b" in ms:
            print(f"horovod 1f1b / tensorflow 1f1b: "
                  f"{ms['horovod/1f1b'] / ms['tensorflow/1f1b']:.3f} (target >= 1.6)")
        for s in grouped():
            one = ms[f"tensorflow/{s}-grouped"]
            print(f"tensorflow {s}, one process per host (--group_devices) / one per slot: "
                  f"{one / ms[f'tensorflow/{s}']:.3f}" + (
                      f"; / 1f1b grouped: {one / ms['tensorflow/1f1b-grouped']:.3f}"
                      if s != "1f1b" and "1f1b" in grouped() else ""))
        for mode in FLAGS.chief_weights:
            name = f"tensorflow/1f1b, weights on the chief ({mode})"
            print(f"{name} / weights on each stage's device: "
                  f"{ms[name] / ms['tensorflow/1f1b']:.3f}")
        for s in FLAGS.loop_schedules:
            looped = ms[f"tensorflow/{s}, looped"]
            print(f"tensorflow {s} looped / plain: {looped / ms['plain']:.3f} (target <= 1.25); "
                  f"/ unrolled: {looped / ms[f'tensorflow/{s}']:.3f}" + (
                      f"; horovod 1f1b / looped: {ms['horovod/1f1b'] / looped:.3f} "
                      f"(target >= 1.6)" if s == "1f1b" and "horovod/1f1b" in ms else "") + (
                      f"; horovod 1f1b looped / tensorflow looped: "
                      f"{ms['horovod/1f1b, looped'] / looped:.3f} (target >= 1.6)"
                      if s == "1f1b" and "horovod/1f1b, looped" in ms else ""))
        for s in FLAGS.out_of_line_schedules:
            called = ms[f"tensorflow/{s}, out of line"]
            print(f"tensorflow {s} out of line / inlined (the default): "
                  f"{called / ms[f'tensorflow/{s}']:.3f}; / plain: {called / ms['plain']:.3f}" + (
                      f"; horovod 1f1b out of line / inlined: "
                      f"{ms['horovod/1f1b, out of line'] / ms['horovod/1f1b']:.3f}; both out "
                      f"of line, horovod / tensorflow: "
                      f"{ms['horovod/1f1b, out of line'] / called:.3f} (target >= 1.6)"
                      if s == "1f1b" and "horovod/1f1b, out of line" in ms else ""))
        for s in FLAGS.schedules:
            if s != "1f1b":
                m = ms[f'tensorflow/{s}'] / ms['tensorflow/1f1b']
                p = predicted[s] / predicted["1f1b"]
                print(f"tensorflow {s} / 1f1b: measured {m:.3f}, simulated {p:.3f} "
                      f"({predicted[s]:.1f} / {predicted['1f1b']:.1f} ms), gap {m / p - 1:+.1%} "
                      f"(target within 15%)")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    app.run(main)
