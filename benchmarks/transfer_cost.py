"""dapple's per-transfer cost between two Horovod ranks next to a raw chained `hvd.alltoall` of
the same size, measured side by side in one horovodrun job (issue #12: ratio <= 1.2).

    python benchmarks/transfer_cost.py [--sizes=4096,4194304] [--hops=64] [--repeats=15]

Prints the command line, then one row per payload size S (bytes): raw ms/hop, dapple
ms/transfer, their ratio and whether it meets the target, with the step times they come from.

Method: both sides time a call made of N strictly sequential transfers of S bytes and divide
the median call time by N (N = `--hops` = 2 M). Raw: a tf.function of N ping-pong alltoalls
between ranks 0 and 1, each hop's input being the previous hop's output. dapple: `train_step`
of a 2-stage plan (one stage per rank, M = N / 2 micro-batches of 1 row, schedule A with warmup
[1, 1]: both stages run F0 B0 F1 B1 ..., so every activation and gradient transfer waits for the
previous one). The model barely computes: stage 0 spreads a 1-float input over S bytes, stage 1
averages them back to 1 float. dapple's figure therefore includes its per-step fixed costs (the
loss allreduce, the optimizer, the call) and the few passes over S its transport and layers make.
Ranks run with HOROVOD_CYCLE_TIME=0.1 ms (`--cycle_time_ms`): at Horovod's default, every hop of
either side waits for the background loop's next cycle, which hides the transport's own cost.
Timings are wall-clock on a shared 2-core machine: run it alone; it prints the CPU others took.
The rank program is this script with `--rank_worker`; rank 0 prints a `TRANSFER_COST <json>` line.
"""
from __future__ import annotations

import importlib.util
import importlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TAG = "TRANSFER_COST "
TARGET = 1.2      # issue #12: dapple's per-transfer cost <= 1.2 x the raw alltoall's
WARMUP = 2        # calls before timing: tracing, Grappler, Horovod negotiation caches
RANK_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2", "DAPPLE_NUM_CPU_DEVICES": "1",
            "HOROVOD_DYNAMIC_PROCESS_SETS": "1", "PYTHONUNBUFFERED": "1"}

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["4096", "4194304"], "payload sizes in bytes (multiples of 4)")
flags.DEFINE_integer("hops", 64, "sequential transfers per timed call (even; dapple: M = hops/2)")
flags.DEFINE_integer("repeats", 15, "timed calls per side, raw and dapple alternating (median)")
flags.DEFINE_string("cycle_time_ms", "0.1", "HOROVOD_CYCLE_TIME for the job ('' keeps the "
                    "environment's or Horovod's default, whose cycle hides the transport's cost)")
flags.DEFINE_integer("timeout", 600, "seconds before the horovodrun job is killed")
flags.DEFINE_bool("rank_worker", False, "run as one rank (the launcher passes it)")


# ---- rank program ------------------------------------------------------------------------
def raw_chain(width: int, hops: int):
    """A tf.function of `hops` ping-pong alltoalls of one float32 row of `width` values."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    salt_var = tf.Variable(0.0, trainable=False, name="raw_salt")  # read as a non-constant 0

    @tf.function
    def chain(row):
        salt = salt_var.read_value()
        x, kept = row, tf.constant(0.0)
        for hop in range(1, hops + 1):
            sender = 0 if hop % 2 else 1          # rank 0 sends at odd hops, rank 1 at even
            zero = salt * float(hop)               # distinct per hop: no CSE, no constant folding
            if hvd.rank() == sender:
                data, splits = x + zero, [sender, 1 - sender]   # the one row goes to the peer
            else:                                  # receiver sends 0 rows, count known at run time
                rows = tf.cast(zero + tf.reduce_sum(x) * salt, tf.int32)  # waits for previous hop
                data, splits = tf.zeros(tf.stack([rows, width])), [0, 0]
            x, _ = hvd.alltoall(data, splits=tf.constant(splits, tf.int32),
                                name=f"raw.{hop}", ignore_name_scope=True)
            kept += tf.reduce_sum(x) * salt        # every output feeds the result, or TF drops it
        return kept
    return chain


def dapple_step(width: int, micro_batches: int):
    """`train_step` of a 2-stage plan whose one boundary tensor is 1 row x `width` floats."""
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple
    import numpy as np
    import tensorflow as tf
    from planner.formats.plan import straight_plan

    class Spread(tf.keras.layers.Layer):          # stage 0: (1,) -> (width,), one weight
        def build(self, shape):
            self.w = self.add_weight(name="w", shape=(), initializer="ones")

        def call(self, x):
            return tf.tile(x * self.w, [1, width])

    class Squash(tf.keras.layers.Layer):          # stage 1: (width,) -> (1,), one weight
        def build(self, shape):
            self.w = self.add_weight(name="w", shape=(), initializer="ones")

        def call(self, h):
            return tf.reduce_mean(h, axis=1, keepdims=True) * self.w

    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input((1,))
    model = tf.keras.Model(inputs, Squash()(Spread()(inputs)))
    plan = straight_plan([1], 2, micro_batches, micro_batches, schedule="A")
    plan.warmup = [1, 1]                          # strictly alternating F/B on both stages
    plan.validate(num_layers=2)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=tf.keras.optimizers.SGD(1e-3), loss="mse")
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(micro_batches, 1).astype("float32"))
    y = tf.constant(rng.randn(micro_batches, 1).astype("float32"))
    return (lambda: pm.train_step(x, y)), pm.rank


def timed(fn) -> float:
    start = time.perf_counter()
    float(fn())                                   # fetch the result: the call has finished
    return time.perf_counter() - start


def rank_worker() -> None:
    os.environ.update({k: RANK_ENV[k] for k in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
                                                "TF_NUM_INTEROP_THREADS")})  # before TF loads
    importlib.import_module("dapple")             # first: sets up devices before TF starts
    import tensorflow as tf

    hops = FLAGS.hops
    rows = []
    for size in (int(s) for s in FLAGS.sizes):
        width = size // 4
        step, rank = dapple_step(width, hops // 2)   # initializes Horovod (first time)
        chain = raw_chain(width, hops)
        row = tf.constant(1.0, shape=(1, width))
        sides = {"raw": lambda: chain(row), "dapple": step}
        for fn in sides.values():
            for _ in range(WARMUP):
                fn()
        seconds = {name: [] for name in sides}
        for _ in range(FLAGS.repeats):               # alternate so machine noise hits both
            for name, fn in sides.items():
                seconds[name].append(timed(fn))
        step_ms = {name: 1e3 * statistics.median(s) for name, s in seconds.items()}
        rows.append({"bytes": size, "hops": hops, "raw_step_ms": step_ms["raw"],
                     "dapple_step_ms": step_ms["dapple"], "samples": len(seconds["raw"])})
    if rank == 0:
        print(TAG + json.dumps(rows), flush=True)


# ---- launcher ----------------------------------------------------------------------------
def run_job(command, env) -> list:
    """Run horovodrun with a deadline (killing its whole session) and return rank 0's rows."""
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=FLAGS.timeout)
        failure = f"horovodrun exited with {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)      # horovodrun leads its own session
        out, err = proc.communicate()
        failure = f"horovodrun did not finish within --timeout={FLAGS.timeout} s (killed)"
    for line in out.splitlines():
        if TAG in line and not failure:
            return json.loads(line.split(TAG, 1)[1])
    tail = "\n".join((out + "\n" + err).strip().splitlines()[-40:])
    sys.exit(f"{failure or 'no ' + TAG.strip() + ' line from rank 0'}\n"
             f"command: {' '.join(command)}\n--- output tail ---\n{tail}")


def cpu_seconds():
    """(busy CPU seconds of the whole machine, CPU seconds of our finished children): their
    difference over a run is what other processes took from the 2 cores (Linux only)."""
    if not os.path.exists("/proc/stat"):
        return None
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ((sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"),   # minus idle, iowait
            usage.ru_utime + usage.ru_stime)


def main(argv) -> None:
    del argv
    if FLAGS.hops < 2 or FLAGS.hops % 2:
        sys.exit("--hops must be even and >= 2 (dapple moves 2 transfers per micro-batch)")
    if not all(s.isdigit() and int(s) > 0 and int(s) % 4 == 0 for s in FLAGS.sizes):
        sys.exit(f"--sizes must be positive multiples of 4 bytes (float32 rows), got {FLAGS.sizes}")
    if FLAGS.rank_worker:
        rank_worker()
        return
    print("command: " + " ".join([sys.executable] + sys.argv))
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    forwarded = [f"--sizes={','.join(FLAGS.sizes)}", f"--hops={FLAGS.hops}",
                 f"--repeats={FLAGS.repeats}"]
    command = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
               os.path.abspath(__file__), "--rank_worker"] + forwarded
    print("ranks:   " + " ".join(command))
    env = dict(os.environ, **RANK_ENV)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if FLAGS.cycle_time_ms:
        env["HOROVOD_CYCLE_TIME"] = FLAGS.cycle_time_ms
    cycle = env.get("HOROVOD_CYCLE_TIME")
    cycle = f"{cycle} ms" if cycle else "Horovod's default"
    before, start = cpu_seconds(), time.perf_counter()
    rows = run_job(command, env)
    after, wall = cpu_seconds(), time.perf_counter() - start
    others = "?" if before is None else \
        f"{((after[0] - before[0]) - (after[1] - before[1])) / wall:.2f}"
    print(f"2 ranks, 1 TF thread each; {FLAGS.hops} sequential transfers per call (dapple: "
          f"M = {FLAGS.hops // 2}, schedule A, warmup [1, 1]); median of {rows[0]['samples']} "
          f"calls per side; HOROVOD_CYCLE_TIME {cycle}\nother processes used {others} of the "
          f"{os.cpu_count()} cores on average during the run (disturbs the timings if not ~0)\n")
    print(f"{'size':>9}  {'raw step':>9}  {'dapple step':>11}  {'raw':>7}  {'dapple':>11}  "
          f"{'ratio':>6}  {'target':>9}")
    print(f"{'bytes':>9}  {'ms':>9}  {'ms':>11}  {'ms/hop':>7}  {'ms/transfer':>11}  "
          f"{'':>6}  {f'<= {TARGET}':>9}")
    for r in rows:
        raw, mine = r["raw_step_ms"] / r["hops"], r["dapple_step_ms"] / r["hops"]
        ratio = mine / raw
        verdict = "met" if ratio <= TARGET else "MISSED"
        print(f"{r['bytes']:>9}  {r['raw_step_ms']:>9.2f}  {r['dapple_step_ms']:>11.2f}  "
              f"{raw:>7.3f}  {mine:>11.3f}  {ratio:>6.2f}  {verdict:>9}")


if __name__ == "__main__":
    app.run(main)
