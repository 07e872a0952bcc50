"""Steps per second of the same 2-stage plan: horovodrun with 2 processes vs one process with
2 logical CPU devices, side by side.

    python benchmarks/horovod_vs_local.py [--steps=30] [--micro_batches=1,4,8]

The model is a small MLP (4 Dense layers of 256 units, global batch 64), cut in the middle; the
plan is straight 2 stages, policy A. For each micro-batch count M the script times `train_step`
(after 3 warm-up steps, which also compile) in a fresh process for each runtime:

* local:   one process, `DAPPLE_NUM_CPU_DEVICES=2`, the single-machine runtime;
* horovod: `horovodrun -np 2 -H localhost:2 --gloo`, one rank per stage (rank 0 reports),
  with Horovod's default cycle time and with `HOROVOD_CYCLE_TIME=0.1` (ms; what `dapple
  launch` sets), since every transfer waits for Horovod's background loop.

Both use one intra-op thread per device/rank, so each stage gets one core either way. The ratio
local/horovod grows with M when the per-transfer cost of a Horovod collective (negotiation
through Horovod's background thread, a Gloo round trip) dominates: every micro-batch moves a
boundary forward and its gradient back, 2 M collectives per step, versus a tensor handed over
inside one process.
"""
from __future__ import annotations

import importlib.util
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GLOBAL_BATCH = 64
WARMUP = 3


def build_model():
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((256,))
    h = x
    for i in range(4):
        h = tf.keras.layers.Dense(256, activation="relu", name=f"d{i}")(h)
    out = tf.keras.layers.Dense(10, name="out")(h)
    return tf.keras.Model(x, out)


def worker(micro_batches: int, steps: int) -> None:
    """Time train_step in this process (under horovodrun when launched by it)."""
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple
    import numpy as np
    import tensorflow as tf
    from planner.formats.plan import straight_plan

    model = build_model()
    plan = straight_plan([3], 5, micro_batches, GLOBAL_BATCH)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.01),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    x = rng.randn(GLOBAL_BATCH, 256).astype("float32")
    y = rng.randint(0, 10, GLOBAL_BATCH).astype("int32")
    for _ in range(WARMUP):
        pm.train_step(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        float(pm.train_step(x, y))          # wait for the step's result
    seconds = time.perf_counter() - start
    if getattr(pm, "rank", 0) == 0:
        print("BENCH " + json.dumps({"steps_per_second": steps / seconds}), flush=True)


def run_and_read(command, env) -> float:
    out = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    for line in out.stdout.splitlines():
        if "BENCH " in line:
            return json.loads(line.split("BENCH ", 1)[1])["steps_per_second"]
    raise RuntimeError(f"no result from {' '.join(command)}:\n{out.stdout[-2000:]}\n"
                       f"{out.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro_batches", default="1,4,8")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker_m", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker_m, args.steps)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=REPO)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    me = [sys.executable, os.path.abspath(__file__), "--worker", f"--steps={args.steps}"]
    print(f"2-stage MLP (4 x Dense 256, global batch {GLOBAL_BATCH}), {args.steps} timed "
          f"train steps after {WARMUP} warm-up steps\n")
    print(f"{'M':>3}  {'local':>9}  {'horovod, default cycle':>23}  {'horovod, 0.1 ms cycle':>22}"
          f"  {'local/horovod':>14}")
    print(f"{'':>3}  {'steps/s':>9}  {'steps/s':>23}  {'steps/s':>22}  {'(0.1 ms cycle)':>14}")
    hvd_env = dict(env, DAPPLE_NUM_CPU_DEVICES="1")
    hvd_env.pop("HOROVOD_CYCLE_TIME", None)
    for m in (int(v) for v in args.micro_batches.split(",")):
        worker_args = [f"--worker_m={m}"]
        local = run_and_read(me + worker_args, dict(env, DAPPLE_NUM_CPU_DEVICES="2"))
        command = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo"] + me + worker_args
        default = run_and_read(command, hvd_env)
        tuned = run_and_read(command, dict(hvd_env, HOROVOD_CYCLE_TIME="0.1"))
        print(f"{m:>3}  {local:>9.1f}  {default:>23.1f}  {tuned:>22.1f}  {local / tuned:>14.2f}",
              flush=True)


if __name__ == "__main__":
    main()
