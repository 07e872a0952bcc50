"""Where the looped pipeline's first call goes, by phase (CPU and wall seconds): the split
(tracing fwd+bwd of each stage), tracing the step, the first run (graph optimization + run),
the second run (run only).

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/prototypes/loop_step/pipe_phases.py --micro_batches=4
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["DAPPLE_NUM_CPU_DEVICES"] = "2"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--impl", default="loop")
    args = p.parse_args()
    import dapple  # noqa: F401
    import numpy as np
    import tensorflow as tf
    from benchmarks.prototypes.loop_step.pipe_timing import build_pipe
    M, rows = args.micro_batches, args.rows
    marks = [("start", time.perf_counter(), time.process_time())]

    def mark(name):
        marks.append((name, time.perf_counter(), time.process_time()))

    step, shape = build_pipe("resnet", args.impl, "", M, rows)
    mark("build (split)")
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(rows * M, *shape).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=rows * M).astype("int32"))
    concrete = step.get_concrete_function(x, y)
    mark("trace")
    concrete(x, y).numpy()
    mark("first run")
    concrete(x, y).numpy()
    mark("second run")
    out = [f"{n} wall {w - w0:.2f} cpu {c - c0:.2f}"
           for (_, w0, c0), (n, w, c) in zip(marks, marks[1:])]
    print(f"{args.impl} M={M}: " + "; ".join(out) + f"; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
