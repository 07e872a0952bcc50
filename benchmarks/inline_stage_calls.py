"""What `PipelinedModel(inline_stage_calls=True)` costs and gains in one process: the first call
and the steady step of an unrolled pipeline, its stage calls out of line (the default) against
inlined, side by side in one run.

    python benchmarks/inline_stage_calls.py [--models=mobilenetv2,mlp] [--schedules=1f1b]
        [--micro_batches=8] [--rows_per_unit=2] [--steps=6] [--repeats=1]

Each model is `benchmarks/startup.py --pipeline`'s (Keras MobileNetV2 or ResNet50 at 32x32x3,
or an MLP of 16 Dense(64), cut in two near the middle, one stage per logical CPU device), its
step unrolled (`micro_batch_loop=False`). Every measurement is a fresh process with one intra-op
thread (no tracing cache carries over); the two ways alternate, `--repeats` times, medians
kept. Prints each way's first call (wall seconds: tracing, graph optimization, first run) and
steady step (median of `--steps` steps, ms), and inlined over out of line. Across processes
`python benchmarks/tf_runtime_step.py --inline_schedules=1f1b` measures the same choice on
the TensorFlow cluster and Horovod runtimes. The machine may be shared: read the load printed.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks import startup  # noqa: E402  (its flags: schedules, micro_batches, rows_per_unit, ...)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mobilenetv2", "mlp"], "startup.py --model values")
flags.DEFINE_string("inline_worker", "", "internal: measure model:way:schedule:M in this process")

RESULT = "INLINE_RESULT "


def worker() -> None:
    model, way, schedule, M = FLAGS.inline_worker.split(":")
    FLAGS.model = model
    print(RESULT + json.dumps(startup.measure_pipeline(
        schedule, int(M), True, inline_stage_calls=way == "inlined")), flush=True)


def measure(model: str, way: str, schedule: str, M: int) -> dict:
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, os.path.abspath(__file__),
                          f"--inline_worker={model}:{way}:{schedule}:{M}",
                          f"--rows_per_unit={FLAGS.rows_per_unit}", f"--steps={FLAGS.steps}"],
                         env=env, cwd=REPO, text=True, capture_output=True,
                         timeout=FLAGS.timeout)
    for line in out.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    lines = (out.stdout + out.stderr).splitlines()
    kept = [l for i, l in enumerate(lines) if l not in lines[max(i - 4, 0):i]]   # no repeats
    raise RuntimeError(f"{model} {way} failed:\n" + "\n".join(kept)[-4000:])


def main(argv):
    del argv
    if FLAGS.inline_worker:
        return worker()
    print("command: python benchmarks/inline_stage_calls.py " + " ".join([
        f"--models={','.join(FLAGS.models)}", f"--schedules={','.join(FLAGS.schedules)}",
        f"--micro_batches={','.join(FLAGS.micro_batches)}",
        f"--rows_per_unit={FLAGS.rows_per_unit}", f"--steps={FLAGS.steps}",
        f"--repeats={FLAGS.repeats}"]))
    print(f"{'model':<13}{'schedule':<10}{'M':>3}  {'way':<9}{'first call s':>13}"
          f"{'steady ms':>11}")
    for model in FLAGS.models:
        for schedule in FLAGS.schedules:
            for M in map(int, FLAGS.micro_batches):
                runs = {"called": [], "inlined": []}
                for _ in range(FLAGS.repeats):
                    for way in runs:
                        runs[way].append(measure(model, way, schedule, M))
                        r = runs[way][-1]
                        print(f"{model:<13}{schedule:<10}{M:>3}  {way:<9}"
                              f"{r['first_call_s']:>13.1f}{r['steady_ms']:>11.1f}"
                              f"   (load {os.getloadavg()[0]:.1f})", flush=True)
                med = {way: {k: statistics.median(r[k] for r in rs)
                             for k in ("first_call_s", "steady_ms")} for way, rs in runs.items()}
                print(f"{model} {schedule} M = {M}, inlined / out of line: first call "
                      f"{med['inlined']['first_call_s'] / med['called']['first_call_s']:.2f}, "
                      f"steady step {med['inlined']['steady_ms'] / med['called']['steady_ms']:.3f}",
                      flush=True)


if __name__ == "__main__":
    FLAGS.set_default("micro_batches", ["8"])
    FLAGS.set_default("steps", 6)
    app.run(main)
