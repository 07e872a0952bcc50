"""Task 3 timing: 2-stage 1F1B, the looped pipeline (pipeline_loop.py) against dapple's runtime
on the same plan (`straight_plan([cut], num_layers, M, rows * M, schedule="1f1b")`), 2 logical
CPU devices. First call (trace + optimization + first run, fresh process per measurement,
implementations alternating per M) and steady step (median of --steps).

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/prototypes/loop_step/pipe_timing.py \
        --model=resnet --micro_batches=2,4,8,16 [--threads=1] [--impls=dapple,loop]

--model=resnet: ResNet50 32x32x3, 10 classes, cut at the single-tensor boundary nearest the
middle of Keras's layer order; --model=mlp: 8 x Dense(1024) on 256 features, cut in the middle.
"""
from __future__ import annotations

import importlib.util
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULT = "RESULT "


def build_model(name):
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    if name == "resnet":
        return tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3),
                                              classes=10), (32, 32, 3)
    x = tf.keras.Input((256,))
    h = x
    for i in range(8):
        h = tf.keras.layers.Dense(1024, activation="relu", name=f"d{i}")(h)
    out = tf.keras.layers.Dense(10, activation="softmax", name="out")(h)
    return tf.keras.Model(x, out), (256,)


def middle_cut(model):
    from graph_rewrite.model_graph import cut_model, layer_order
    n = len(layer_order(model))
    for d in range(n):
        for cut in (n // 2 - d, n // 2 + d):
            if 0 < cut < n and len(cut_model(model, [(0, cut - 1), (cut, n - 1)])[1].input_ids) == 1:
                return cut, n
    raise ValueError("no single-tensor cut")


def build_pipe(model_name, impl, variant, M, rows):
    """(train_step(x, y), input shape) for impl 'dapple' or 'loop' (variant 'unrolled': the
    same executor without the loop)."""
    import tensorflow as tf
    from dapple.devices import local_devices
    from graph_rewrite.model_graph import cut_model
    from benchmarks.prototypes.loop_step.pipeline_loop import LoopPipeline, schedule_lists
    model, shape = build_model(model_name)
    cut, n = middle_cut(model)
    plan, lists = schedule_lists(2, M, n, cut, rows)
    if impl == "dapple":
        from dapple.pipelined_model import PipelinedModel
        pm = PipelinedModel(model, plan)
        pm.compile(tf.keras.optimizers.SGD(0.01),
                   tf.keras.losses.SparseCategoricalCrossentropy())
        return pm.train_step, shape
    stages = cut_model(model, [tuple(s.layers) for s in plan.stages])
    pipe = LoopPipeline(stages, lists, local_devices(2), M, rows, tf.keras.optimizers.SGD(0.01),
                        use_loop="unrolled" not in variant,
                        parallel_iterations=1 if "pi1" in variant else 10,
                        peel=1 if "peel" in variant else 0)
    return pipe.train_step, shape


def measure(model_name, impl, M, rows, steps):
    os.environ["DAPPLE_NUM_CPU_DEVICES"] = "2"
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401
    import numpy as np
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    name, _, variant = impl.partition(":")
    t0 = time.perf_counter()
    step, shape = build_pipe(model_name, name, variant, M, rows)
    built = time.perf_counter()
    cpu0 = time.process_time()
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(rows * M, *shape).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=rows * M).astype("int32"))
    step(x, y).numpy()
    first = time.perf_counter() - built
    cpu_first = time.process_time() - cpu0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(x, y).numpy()
        times.append(time.perf_counter() - t)
    return dict(first_call_s=first, build_s=built - t0, cpu_first_s=cpu_first, steady_ms=1e3 * statistics.median(times),
                min_ms=1e3 * min(times))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet")
    p.add_argument("--micro_batches", default="2,4,8,16")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--impls", default="dapple,loop")
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    Ms = [int(m) for m in args.micro_batches.split(",")]
    impls = args.impls.split(",")
    if args.worker:
        print(RESULT + json.dumps(measure(args.model, impls[0], Ms[0], args.rows, args.steps)))
        return
    print("command:", " ".join(sys.argv), "| threads:", args.threads or "TF default")
    env = dict(os.environ, PYTHONPATH=ROOT)
    if args.threads:
        env["TF_NUM_INTRAOP_THREADS"] = str(args.threads)
    results = {}
    for M in Ms:
        for impl in impls:
            before = open("/proc/loadavg").read().split()[0]
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                   f"--model={args.model}", f"--impls={impl}",
                                   f"--micro_batches={M}", f"--rows={args.rows}",
                                   f"--steps={args.steps}"], cwd=ROOT, env=env, text=True,
                                  capture_output=True)
            r = next((json.loads(l[len(RESULT):]) for l in proc.stdout.splitlines()
                      if l.startswith(RESULT)),
                     dict(error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300]))
            r["load"] = f"{before}->{open('/proc/loadavg').read().split()[0]}"
            results[(impl, M)] = r
            print(f"  {impl} M={M}: {json.dumps(r)}", flush=True)
    print(f"\n{args.model}, 2 stages 1F1B, {args.rows} rows per micro-batch")
    print("| impl | M | first call s | first call CPU s | steady ms | fastest ms | "
          "load 1-min before->after |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for impl in impls:
        for M in Ms:
            r = results[(impl, M)]
            if "error" in r:
                print(f"| {impl} | {M} | error: {r['error']} |")
            else:
                print(f"| {impl} | {M} | {r['first_call_s']:.1f} | {r['cpu_first_s']:.1f} | "
                      f"{r['steady_ms']:.0f} | "
                      f"{r['min_ms']:.0f} | {r['load']} |")
    for impl in impls:
        a, b = results[(impl, Ms[0])], results[(impl, Ms[-1])]
        if "error" not in a and "error" not in b:
            print(f"{impl}: first call M={Ms[-1]} / M={Ms[0]} = "
                  f"{b['first_call_s'] / a['first_call_s']:.2f}")


if __name__ == "__main__":
    main()
