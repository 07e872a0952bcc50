"""A 2-stage pipeline under `horovodrun -np 2 --gloo`, its steady periods as loops or unrolled:
first call and steady step, side by side.

    python benchmarks/pipeline_loop_horovod.py [--micro_batches=8] [--schedule=A] [--steps=30]
                                                [--repeats=2]

The model and plan are benchmarks/horovod_vs_local.py's (4 Dense layers of 256 units and an
output layer, global batch 64, cut after the third layer). Every cell is a fresh horovodrun job,
alternating loop and unrolled `--repeats` times; rank 0 reports the first `train_step` (trace,
optimization, first run) and the median of `--steps` timed steps after 3 warm-up steps. Ranks
get one intra-op thread each and `HOROVOD_CYCLE_TIME=0.1` (as `dapple launch` sets).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from horovod_vs_local import GLOBAL_BATCH, WARMUP, build_model  # noqa: E402


def worker(micro_batches: int, schedule: str, loop: bool, steps: int) -> None:
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import dapple
    import numpy as np
    import tensorflow as tf
    from planner.formats.plan import straight_plan

    model = build_model()
    plan = straight_plan([3], 5, micro_batches, GLOBAL_BATCH, schedule=schedule)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=loop)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.01),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    x = rng.randn(GLOBAL_BATCH, 256).astype("float32")
    y = rng.randint(0, 10, GLOBAL_BATCH).astype("int32")
    start = time.perf_counter()
    float(pm.train_step(x, y))
    first = time.perf_counter() - start
    for _ in range(WARMUP):
        float(pm.train_step(x, y))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(pm.train_step(x, y))
        times.append(time.perf_counter() - start)
    if pm.rank == 0:
        print("BENCH " + json.dumps({"first": first, "step": statistics.median(times),
                                     "loops": pm.pipeline_step.schedule_loops}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro_batches", type=int, default=8)
    parser.add_argument("--schedule", default="A")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.micro_batches, args.schedule, args.loop, args.steps)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="2", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=REPO, DAPPLE_NUM_CPU_DEVICES="1", HOROVOD_CYCLE_TIME="0.1")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    print(f"2-stage MLP, schedule {args.schedule}, M={args.micro_batches}, horovodrun -np 2 "
          f"--gloo; first call (s), median steady step (ms) of {args.steps}")
    print(f"{'run':>4}  {'variant':>9}  {'first, s':>9}  {'step, ms':>9}  {'loops':>5}")
    for repeat in range(args.repeats):
        for loop in (True, False):
            command = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                       os.path.abspath(__file__), "--worker", f"--steps={args.steps}",
                       f"--micro_batches={args.micro_batches}", f"--schedule={args.schedule}"
                       ] + (["--loop"] if loop else [])
            out = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                                 timeout=900)
            found = [json.loads(line.split("BENCH ", 1)[1]) for line in out.stdout.splitlines()
                     if "BENCH " in line]
            if not found:
                raise RuntimeError(f"no result:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
            r = found[0]
            print(f"{repeat:>4}  {'loop' if loop else 'unrolled':>9}  {r['first']:>9.2f}  "
                  f"{1000 * r['step']:>9.2f}  {r['loops']:>5}", flush=True)


if __name__ == "__main__":
    main()
