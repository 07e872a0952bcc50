"""Task 2: data parallelism with one tf.while_loop per device over its micro-batches.

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/prototypes/loop_step/dp_loop.py \
        --micro_batches=1,8 [--replicas=4] [--steps=5] [--threads=1] [--impls=dapple,loop]
    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/prototypes/loop_step/dp_loop.py --check

Per device r: `tf.while_loop` over j < M whose body runs the stage's fwd (loss term and its
residuals) and bwd (weight gradients, dy = 1) from `split.split_stage`, and adds the gradients
to loop-carried accumulators; after the loops the replicas' sums are added on device 0 and
applied with SGD. Call sites in the step graph: 2 per device, whatever M.

Each measurement runs in a fresh subprocess (`--worker`), implementations alternating per M;
"first call" counts everything from an untraced model to the first step's loss (for the loop:
the split's traces too, also reported alone); "steady" is the median of `--steps` later steps.
The same case as benchmarks/startup.py (ResNet50 32x32x3, 10 classes, 2 rows per unit).
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


def resnet():
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    return tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)


def small_bn_net():
    import tensorflow as tf
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((8, 8, 3))
    h = tf.keras.layers.Conv2D(8, 3, padding="same")(x)
    h = tf.keras.layers.BatchNormalization()(h)
    h = tf.keras.layers.ReLU()(h)
    h = tf.keras.layers.Conv2D(8, 3, padding="same")(h)
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(10, activation="softmax")(h))


class LoopDataParallel:
    """The loop step for `model` on `devices`, M micro-batches of `rows` rows per device."""

    def __init__(self, model, devices, M, rows, optimizer=None, variant=""):
        import tensorflow as tf
        from benchmarks.prototypes.loop_step.split import split_stage
        self.model, self.devices, self.M, self.rows = model, list(devices), M, rows
        R = len(devices)
        self.global_rows = rows * R * M
        self.variables = model.trainable_variables
        in_shape = (rows,) + tuple(model.input_shape[1:])
        global_rows = float(self.global_rows)

        def stage(x, y):                      # the micro-batch's share of the global loss
            p = model(x, training=True)
            return tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(y, p)) \
                / global_rows

        start = time.perf_counter()
        self.split = split_stage(stage, tf.TensorSpec(in_shape, tf.float32),
                                 [tf.TensorSpec((rows,), tf.int32)], self.variables,
                                 differentiate_x=False, y_spec=tf.TensorSpec((), tf.float32),
                                 keep_updates="noupdates" not in variant)
        self.variant = variant
        self.fwd, self.bwd = self.split.fwd, self.split.bwd
        if "noinline" in variant:   # one out-of-line call each (dapple's _noinline)
            attrs = {"_noinline": True}
            fwd, bwd = self.split.fwd, self.split.bwd
            self.fwd = tf.function(lambda *a: fwd(*a), experimental_attributes=attrs)
            self.bwd = tf.function(lambda *a: bwd(*a), experimental_attributes=attrs)
        self.split_s = time.perf_counter() - start
        self.optimizer = optimizer
        if optimizer is not None:
            optimizer.build(self.variables)
        self.train_step = tf.function(self._step)
        self.gradients = tf.function(self._gradients)

    def _gradients(self, x, y):
        import tensorflow as tf
        R, M, b = len(self.devices), self.M, self.rows
        x = tf.reshape(x, [M, R, b] + x.shape[1:].as_list())
        y = tf.reshape(y, [M, R, b])
        fwd, bwd, split = self.fwd, self.bwd, self.split
        per_device, losses = [], []
        for r, device in enumerate(self.devices):
            with tf.device(device):
                xr, yr = x[:, r], y[:, r]
                one = tf.ones([])

                def body(j, loss, *acc, xr=xr, yr=yr, one=one, device=device):
                    with tf.device(device):
                        out = fwd(xr[j], yr[j])[0]
                        term, residuals = out[0], out[1:]
                        grads = split.unpack(bwd(*residuals, one))
                        grads = [tf.convert_to_tensor(g) for g in grads]
                        for g, v in zip(grads, self.variables):
                            g.set_shape(v.shape)   # a backward fed shapes loses static ones
                        return (j + 1, loss + term) + tuple(a + g for a, g in zip(acc, grads))

                if "zeros" in self.variant:     # accumulators start at zero (a full
                    init = (tf.constant(0), tf.zeros([])) + tuple(   # pass over the weights'
                        tf.zeros_like(v) for v in self.variables)    # size per device)
                else:   # peel micro-batch 0: its gradients start the accumulators
                    with tf.device(device):
                        out0 = fwd(xr[0], yr[0])[0]
                        g0 = [tf.convert_to_tensor(g)
                              for g in split.unpack(bwd(*out0[1:], one))]
                        for g, v in zip(g0, self.variables):
                            g.set_shape(v.shape)
                    init = (tf.constant(1), out0[0]) + tuple(g0)
                if "unrolled" in self.variant:      # no loop: the body M times
                    out = init
                    for _ in range(M - int(init[0] is not None and "zeros" not in self.variant)):
                        out = body(*out)
                else:
                    out = tf.while_loop(lambda j, *_: j < M, body, init)
                losses.append(out[1])
                per_device.append(out[2:])
        if "dummyloop" in self.variant:   # control flow in the graph, doing nothing
            losses.append(tf.cast(tf.while_loop(lambda i: i < 2, lambda i: i + 1, [0])[0],
                                  tf.float32) * 0.0)
        with tf.device(self.devices[0]):
            grads = [tf.add_n(list(gs)) if R > 1 else gs[0] for gs in zip(*per_device)]
            return tf.add_n(losses), grads

    def _step(self, x, y):
        loss, grads = self._gradients(x, y)
        self.optimizer.apply_gradients(zip(grads, self.variables))
        return loss


def dapple_step(model, M, R, rows):
    import tensorflow as tf
    from dapple.pipelined_model import PipelinedModel
    from graph_rewrite.model_graph import layer_order
    from planner.formats.plan import straight_plan
    batch = rows * R * M
    plan = straight_plan([], len(layer_order(model)), M, batch, replicas=[R])
    pm = PipelinedModel(model, plan)
    pm.compile(tf.keras.optimizers.SGD(0.01), tf.keras.losses.SparseCategoricalCrossentropy())
    return pm


def measure(impl, M, R, rows, steps):
    impl, _, variant = impl.partition(":")
    os.environ["DAPPLE_NUM_CPU_DEVICES"] = str(R)
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401
    import numpy as np
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    from dapple.devices import local_devices
    batch = rows * R * M
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(batch, 32, 32, 3).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=batch).astype("int32"))
    model = resnet()
    extra = {}
    start = time.perf_counter()
    cpu0 = time.process_time()
    if impl == "dapple":
        pm = dapple_step(model, M, R, rows)
        built = time.perf_counter()
        step = pm.train_step
    else:
        loop = LoopDataParallel(model, local_devices(R), M, rows, tf.keras.optimizers.SGD(0.01),
                                variant=variant)
        extra["split_s"] = loop.split_s
        t0 = time.perf_counter()
        step = loop.train_step.get_concrete_function(x, y)
        extra["trace_s"] = time.perf_counter() - t0
        built = time.perf_counter() - extra["trace_s"]
    step(x, y).numpy()
    first = time.perf_counter() - built
    extra["cpu_first_s"] = time.process_time() - cpu0   # incl. the split's traces for loop
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(x, y).numpy()
        times.append(time.perf_counter() - t)
    return dict(first_call_s=first, with_build_s=time.perf_counter() - start - sum(times),
                steady_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times), **extra)


def check(R=2, M=3, rows=2):
    """Loop gradients against the plain model's tape, slice by slice (ghost batches: each
    slice normalizes with its own statistics, as in dapple)."""
    os.environ["DAPPLE_NUM_CPU_DEVICES"] = str(R)
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # noqa: F401
    import numpy as np
    import tensorflow as tf
    from dapple.devices import local_devices
    ok = True
    for name, build in [("small conv+BN", small_bn_net), ("ResNet50", resnet)]:
        model, reference = build(), build()
        shape = model.input_shape[1:]
        batch = rows * R * M
        rng = np.random.RandomState(1)
        x = tf.constant(rng.rand(batch, *shape).astype("float32"))
        y = tf.constant(rng.randint(0, 10, size=batch).astype("int32"))
        loop = LoopDataParallel(model, local_devices(R), M, rows)
        loss, grads = loop.gradients(x, y)
        ref = [tf.zeros_like(v) for v in reference.trainable_variables]
        ref_loss = 0.0
        for lo in range(0, batch, rows):
            with tf.GradientTape() as tape:
                p = reference(x[lo:lo + rows], training=True)
                term = tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(
                    y[lo:lo + rows], p)) / batch
            ref = [a + g for a, g in zip(ref, tape.gradient(term, reference.trainable_variables))]
            ref_loss += float(term)
        diff = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grads, ref))
        scale = max(float(tf.reduce_max(tf.abs(b))) for b in ref)
        # ResNet-50's BN over 2-row slices at 1x1 spatial makes gradients up to ~1e9: there the
        # bound is relative to the largest gradient (float32 sums in another order).
        good = (diff < 1e-5 or diff / scale < 1e-6) and abs(float(loss) - ref_loss) < 1e-5
        ok &= good
        print(f"{name}: R={R} M={M} rows={rows}: max|loop grad - plain tape grad| = {diff:.2e} "
              f"(largest gradient {scale:.2e}, relative {diff / scale:.1e}), loss {float(loss):.6f} vs {ref_loss:.6f}: "
              f"{'PASS' if good else 'FAIL'}")
    print("ALL PASS" if ok else "SOME FAILED")


def run_worker(impl, M, args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if args.threads:
        env["TF_NUM_INTRAOP_THREADS"] = str(args.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--impls={impl}",
           f"--micro_batches={M}", f"--replicas={args.replicas}", f"--rows={args.rows}",
           f"--steps={args.steps}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return dict(error=(proc.stderr.strip().splitlines() or ["?"])[-1][:300])


def load():
    return open("/proc/loadavg").read().split()[:3]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--micro_batches", default="1,8")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--impls", default="dapple,loop")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        return check()
    Ms = [int(m) for m in args.micro_batches.split(",")]
    impls = args.impls.split(",")
    if args.worker:
        print(RESULT + json.dumps(measure(impls[0], Ms[0], args.replicas, args.rows,
                                          args.steps)), flush=True)
        return
    print("command:", " ".join(sys.argv), "| threads:", args.threads or "TF default")
    results = {}
    for M in Ms:
        for impl in impls:
            before = load()
            r = run_worker(impl, M, args)
            r["load"] = f"{before[0]}->{load()[0]}"
            results[(impl, M)] = r
            print(f"  {impl} {args.replicas}x{M}: {json.dumps(r)}", flush=True)
    print("\n| impl | R x M | first call s | (incl. model build) | steady ms (median) | "
          "fastest ms | load 1-min before->after |")
    print("|---|---|---:|---:|---:|---:|---|")
    for impl in impls:
        for M in Ms:
            r = results[(impl, M)]
            if "error" in r:
                print(f"| {impl} | {args.replicas}x{M} | error: {r['error']} |")
                continue
            print(f"| {impl} | {args.replicas}x{M} | {r['first_call_s']:.1f} | "
                  f"{r['with_build_s']:.1f} | {r['steady_ms']:.0f} | {r['min_ms']:.0f} | "
                  f"{r['load']} |")
    for impl in impls:
        a, b = results[(impl, Ms[0])], results[(impl, Ms[-1])]
        if "error" not in a and "error" not in b:
            print(f"{impl}: first call growth {args.replicas}x{Ms[-1]} / {args.replicas}x{Ms[0]}"
                  f" = {b['first_call_s'] / a['first_call_s']:.2f}")
    for M in Ms:
        a, b = results.get(("dapple", M)), results.get(("loop", M))
        if a and b and "error" not in a and "error" not in b:
            print(f"steady loop / dapple at {args.replicas}x{M}: "
                  f"{b['steady_ms'] / a['steady_ms']:.3f} (fastest {b['min_ms'] / a['min_ms']:.3f})")


if __name__ == "__main__":
    main()
