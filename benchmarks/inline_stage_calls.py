"""What `PipelinedModel(inline_stage_calls=True)` costs and gains in one process: the first call
and the steady step of an unrolled pipeline, its stage calls out of line (the default) against
inlined, side by side in one run.

    python benchmarks/inline_stage_calls.py [--models=mobilenetv2,mlp] [--schedules=1f1b]
        [--micro_batches=8] [--rows_per_unit=2] [--steps=6] [--repeats=1] [--threads=1]

Each model is `benchmarks/startup.py --pipeline`'s (Keras MobileNetV2 or ResNet50 at 32x32x3,
or an MLP of 16 Dense(64), cut in two near the middle, one stage per logical CPU device), its
step unrolled (`micro_batch_loop=False`). Every measurement is a fresh process of startup.py's
worker (one intra-op thread unless `--threads`; no tracing cache carries over); the two ways
alternate, `--repeats` times, medians kept. Prints each way's first call (wall seconds: tracing,
graph optimization, first run) and steady step (median of `--steps` steps, ms), and inlined over
out of line. Across processes `python benchmarks/tf_runtime_step.py --out_of_line_schedules=1f1b`
measures the same choice on the TensorFlow cluster and Horovod runtimes, which inline by
default. The machine may be shared: read the load printed.
"""
from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks import startup  # noqa: E402  (its flags: schedules, micro_batches, steps, ...)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mobilenetv2", "mlp"], "startup.py --model values")


def measure(model: str, way: str, schedule: str, M: int) -> dict:
    """startup.py's pipeline worker, unrolled, in a fresh process."""
    result = startup.run_worker(REPO, M, unrolled=True, extra=[
        "--pipeline", f"--schedules={schedule}", f"--model={model}"] + (
            ["--inline_stage_calls"] if way == "inlined" else []))
    if "error" in result:
        raise RuntimeError(f"{model} {schedule} M = {M} {way}: {result['error']}")
    return result


def main(argv):
    del argv
    print("command: python benchmarks/inline_stage_calls.py " + " ".join([
        f"--models={','.join(FLAGS.models)}", f"--schedules={','.join(FLAGS.schedules)}",
        f"--micro_batches={','.join(FLAGS.micro_batches)}",
        f"--rows_per_unit={FLAGS.rows_per_unit}", f"--steps={FLAGS.steps}",
        f"--repeats={FLAGS.repeats}", f"--threads={FLAGS.threads}"]))
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
    FLAGS.set_default("threads", 1)
    app.run(main)
