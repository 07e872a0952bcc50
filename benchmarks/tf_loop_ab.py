"""A pipeline's step looped (`pipeline_loop=True`) against unrolled on TensorFlow's distributed
runtime, as an A/B in one job (issue #28 on the #27 runtime).

    python benchmarks/tf_loop_ab.py [--width=1024] [--depth=8] [--batch=256]
        [--micro_batches=8] [--steps=10] [--repeats=3] [--schedule=1f1b]

One `dapple launch --runtime=tensorflow` on 2 processes (one intra-op thread each); the chief
builds the same model twice (`benchmarks/schedule_step_time.py`'s MLP and 2-stage plans), one
`PipelinedModel` looped and one unrolled, warms both, then times `--steps` steps of each in
turn, `--repeats` rounds, the first alternating: both see the same load. Prints each one's
median step, the ratio (#28's target: loop / unrolled <= 1.05) and the load average.
"""
from __future__ import annotations

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

from benchmarks import schedule_step_time as sst  # noqa: E402  (its flags: width, depth, ...)
from benchmarks.step_timing import run_checked  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("schedule", "1f1b", "the plan's schedule: 1f1b, zb-h1 or interleaved")
flags.DEFINE_bool("ab_worker", False, "internal: run the A/B on the cluster (the chief)")
RESULT = "DAPPLE_LOOP_AB "


def worker() -> None:
    import json

    import dapple  # before TensorFlow: connects to the cluster
    import numpy as np
    import tensorflow as tf
    from benchmarks.predicted_vs_measured import build
    tf.get_logger().setLevel("ERROR")
    plan = sst.plans(FLAGS.depth + 1)[FLAGS.schedule]
    models = {}
    for name, loop in (("looped", True), ("unrolled", False)):
        pm = dapple.PipelinedModel(build(**sst.model_args()), plan, pipeline_loop=loop)
        pm.compile(tf.keras.optimizers.SGD(0.01),
                   tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        models[name] = pm
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(FLAGS.batch, FLAGS.width).astype("float32"))
    y = tf.constant(rng.randint(0, 10, FLAGS.batch).astype("int32"))
    for pm in models.values():
        for _ in range(3):
            pm.train_step(x, y).numpy()
    loops = models["looped"].pipeline_step.schedule_loops
    if not loops:
        raise SystemExit(f"the looped step ran unrolled ({FLAGS.schedule}, M = "
                         f"{FLAGS.micro_batches}): no A/B")
    times = {name: [] for name in models}
    for r in range(FLAGS.repeats):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            for _ in range(FLAGS.steps):
                start = time.perf_counter()
                models[name].train_step(x, y).numpy()
                times[name].append((time.perf_counter() - start) * 1e3)
    print(RESULT + json.dumps({name: statistics.median(t) for name, t in times.items()}),
          flush=True)


def main(argv):
    del argv
    if FLAGS.ab_worker:
        return worker()
    import json
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"     # as tf_runtime_step.py's jobs
    args = [f"--width={FLAGS.width}", f"--depth={FLAGS.depth}", f"--batch={FLAGS.batch}",
            f"--micro_batches={FLAGS.micro_batches}", f"--steps={FLAGS.steps}",
            f"--repeats={FLAGS.repeats}", f"--schedule={FLAGS.schedule}"]
    print("command: python benchmarks/tf_loop_ab.py " + " ".join(args), flush=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        sst.plans(FLAGS.depth + 1)[FLAGS.schedule].save(path)
        out = run_checked([sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
                           f"--plan={path}", "--", sys.executable, os.path.abspath(__file__),
                           "--ab_worker"] + args, sst.env(), REPO)
    line = next(ln for ln in out.splitlines() if RESULT in ln)
    ms = json.loads(line.split(RESULT, 1)[1])
    print(f"median step, ms: looped {ms['looped']:.1f}, unrolled {ms['unrolled']:.1f}; "
          f"looped / unrolled {ms['looped'] / ms['unrolled']:.3f} (#28's target <= 1.05)")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    app.run(main)
