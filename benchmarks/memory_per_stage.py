"""Peak memory of one training step per pipeline stage: one process per stage (horovodrun), so
each stage's allocator is its own (on logical CPU devices all stages share one).

    python benchmarks/memory_per_stage.py [--micro_batches=2,4,8,16]
        [--schedules=A,zb-h1,interleaved]

The model, plans and measurement are `benchmarks/memory_schedule.py`'s (2 stages, or 2 device
groups of 2 chunks for interleaved; micro-batch fixed, M growing); here every (schedule, M)
runs as `horovodrun -np 2 -H localhost:2 --gloo`, each rank measuring its own process's peak
bytes above what was live before the step. Prints each stage's peak and the worst stage, the
figure a device's memory must hold, and zb-h1 / early backward per M (issue #13: <= 1.15 from
M = 4 to 16).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

from absl import app, flags  # noqa: E402

from benchmarks import memory_schedule  # noqa: E402  (defines the model's flags)

FLAGS = flags.FLAGS
flags.DEFINE_boolean("worker", False, "internal: one rank of one measurement")
flags.DEFINE_string("worker_schedule", "", "internal")
flags.DEFINE_integer("worker_m", 0, "internal")
RESULT = "DAPPLE_MEMORY "
MB = 2 ** 20


def worker() -> None:
    import dapple  # noqa: F401
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    peak = memory_schedule.step_peak_bytes(FLAGS.worker_schedule, FLAGS.worker_m)
    import horovod.tensorflow as hvd
    print(RESULT + json.dumps({"rank": hvd.rank(), "peak": peak}), flush=True)


def measure(schedule: str, M: int) -> list:
    """Per rank (= stage, or device group of an interleaved plan): peak bytes."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
           os.path.abspath(__file__), "--worker", f"--worker_schedule={schedule}",
           f"--worker_m={M}", f"--micro_batch={FLAGS.micro_batch}", f"--width={FLAGS.width}",
           f"--layers={FLAGS.layers}"]
    env = dict(os.environ, DAPPLE_NUM_CPU_DEVICES="1", PYTHONPATH=REPO)
    out = subprocess.run(cmd, env=env, cwd=REPO, text=True, capture_output=True, timeout=900)
    peaks = {}
    for line in out.stdout.splitlines():
        if RESULT in line:
            rec = json.loads(line.split(RESULT, 1)[1])
            peaks[rec["rank"]] = rec["peak"]
    if sorted(peaks) != [0, 1]:
        raise RuntimeError(f"{schedule} M={M}: no result from every rank:\n"
                           + (out.stdout + out.stderr)[-3000:])
    return [peaks[0], peaks[1]]


def main(argv):
    del argv
    if FLAGS.worker:
        return worker()
    Ms = [int(m) for m in FLAGS.micro_batches]
    schedules = [s for s in FLAGS.schedules if s != "gpipe"] if FLAGS.schedules else []
    print(f"command: python benchmarks/{os.path.basename(__file__)} "
          f"--micro_batches={','.join(map(str, Ms))} --schedules={','.join(schedules)}")
    print(f"2 ranks (one per stage or device group), micro-batch {FLAGS.micro_batch} x "
          f"{FLAGS.width}, {2 * FLAGS.layers} LayerNorm+tanh pairs; MiB above the live baseline")
    results = {s: {M: measure(s, M) for M in Ms} for s in schedules}
    print(f"{'schedule':<14}{'stage':>6}" + "".join(f"{'M=' + str(M):>9}" for M in Ms))
    for s in schedules:
        for stage in (0, 1):
            print(f"{s:<14}{stage:>6}" + "".join(f"{results[s][M][stage] / MB:>9.1f}"
                                                 for M in Ms))
        print(f"{s:<14}{'worst':>6}" + "".join(f"{max(results[s][M]) / MB:>9.1f}" for M in Ms))
    if "zb-h1" in results and "A" in results:
        ratios = {M: max(results["zb-h1"][M]) / max(results["A"][M]) for M in Ms}
        print("zb-h1 / early backward, worst stage: "
              + ", ".join(f"M={M} {r:.2f}" for M, r in ratios.items()))
        worst = max(r for M, r in ratios.items() if M >= 4)
        print(f"target <= 1.15 for M >= 4: {'met' if worst <= 1.15 else 'NOT met'} "
              f"(worst {worst:.2f})")


if __name__ == "__main__":
    flags.FLAGS.set_default("schedules", ["A", "zb-h1", "interleaved"])
    app.run(main)
