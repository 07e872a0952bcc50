"""Steady step time A/B in ONE process, implementations alternating step by step (the machine is
shared and its load swings by 2x within a minute: separate processes are not comparable).

    PYTHONPATH=. TF_NUM_INTRAOP_THREADS=1 nice -n 19 .venv/bin/python \
        benchmarks/prototypes/loop_step/steady_ab.py --case=dp --replicas=4 --micro_batches=8 \
        --impls=dapple,loop,loop:noinline --rounds=15
    ... --case=pipe --micro_batches=8 --impls=dapple,loop,loop:unrolled

dp: ResNet50 32x32 data-parallel (dp_loop.py); pipe: 2-stage 1F1B (pipeline_loop.py) on
the model --pipe_model (resnet or mlp). Each implementation gets its own identically built
model; prints per implementation the median and fastest step (ms) and the median over rounds
of the ratio to the first implementation, with the load average.
"""
import importlib.util
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="dp")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--micro_batches", type=int, default=8)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--impls", default="dapple,loop")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--pipe_model", default="resnet")
    p.add_argument("--grappler_off", default="", help="comma list of tf.config.optimizer "
                   "experimental options to switch off (e.g. remapping)")
    args = p.parse_args()
    devices = args.replicas if args.case == "dp" else 2
    os.environ["DAPPLE_NUM_CPU_DEVICES"] = str(devices)
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401
    import numpy as np
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    if args.grappler_off:
        tf.config.optimizer.set_experimental_options(
            {k: False for k in args.grappler_off.split(",")})
    from dapple.devices import local_devices
    M, rows = args.micro_batches, args.rows
    impls = args.impls.split(",")
    if args.case == "dp":
        from benchmarks.prototypes.loop_step.dp_loop import LoopDataParallel, dapple_step, resnet
        batch = rows * args.replicas * M
        shape = (32, 32, 3)
    else:
        from benchmarks.prototypes.loop_step.pipe_timing import build_pipe
        batch = rows * M
    steps = {}
    for impl in impls:
        name, _, variant = impl.partition(":")
        t0 = time.perf_counter()
        if args.case == "dp":
            model = resnet()
            if name == "dapple":
                steps[impl] = dapple_step(model, M, args.replicas, rows).train_step
            else:
                steps[impl] = LoopDataParallel(model, local_devices(args.replicas), M, rows,
                                               tf.keras.optimizers.SGD(0.01),
                                               variant=variant).train_step
        else:
            steps[impl], shape = build_pipe(args.pipe_model, name, variant, M, rows)
        rng = np.random.RandomState(0)
        x = tf.constant(rng.rand(batch, *shape).astype("float32"))
        y = tf.constant(rng.randint(0, 10, size=batch).astype("int32"))
        steps[impl](x, y).numpy()
        steps[impl](x, y).numpy()
        print(f"built {impl} in {time.perf_counter() - t0:.1f} s", flush=True)
    times = {i: [] for i in impls}
    loads = []
    for _ in range(args.rounds):
        loads.append(float(open("/proc/loadavg").read().split()[0]))
        for impl in impls:
            t = time.perf_counter()
            steps[impl](x, y).numpy()
            times[impl].append(1e3 * (time.perf_counter() - t))
    base = impls[0]
    print(f"\n{args.case} M={M} rows={rows} R={args.replicas if args.case == 'dp' else 1} "
          f"rounds={args.rounds} threads={os.environ.get('TF_NUM_INTRAOP_THREADS', 'default')}"
          f" grappler off: {args.grappler_off or '-'} load 1-min {min(loads):.2f}..{max(loads):.2f}")
    print("| impl | median ms | fastest ms | median ratio to " + base + " |")
    print("|---|---:|---:|---:|")
    for impl in impls:
        ratio = statistics.median(a / b for a, b in zip(times[impl], times[base]))
        print(f"| {impl} | {statistics.median(times[impl]):.0f} | {min(times[impl]):.0f} | "
              f"{ratio:.3f} |")


if __name__ == "__main__":
    main()
