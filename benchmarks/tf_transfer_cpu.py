"""What one TensorFlow Send/Recv between two processes costs in CPU, beside its wall time.

    python benchmarks/tf_transfer_cpu.py [--sizes_kib=128,512,2048] [--hops=32] [--calls=20]

`dapple launch --runtime=tensorflow --hosts=localhost:2` runs this script as the chief, one
intra-op thread a process. For each size, one traced `tf.function` bounces a float vector
`--hops` times between the two tasks (an add on each side, as a stage consumes its input), and
another runs the same ops on the chief alone; each is called `--calls` times after 3 warm-up
calls. CPU is the machine's busy time from /proc/stat (both processes and whatever else runs:
run it alone). A hop's own CPU is the difference per hop. The simulator's links carry a
transfer apart from compute (`planner/estimate/simulator.py`), as a GPU's copy engines do; on
CPU devices this is what each transfer takes from the two processes' compute (docs/cluster.md).
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks.step_timing import run_checked  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes_kib", ["128", "512", "2048"], "message sizes, KiB")
flags.DEFINE_integer("hops", 32, "transfers per call, each depending on the one before")
flags.DEFINE_integer("calls", 20, "timed calls per size and kind")
flags.DEFINE_bool("worker", False, "internal: the chief's part, under dapple launch")


def busy_seconds() -> float:
    """CPU seconds the machine has spent busy since boot (every core, every process)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def worker() -> None:
    import dapple  # noqa: F401  (connects this process to the cluster)
    import tensorflow as tf
    from dapple.runtime.tf_cluster.cluster import task_device

    # Grappler would remove the identities, and with them the hops (`dapple.tf_link_measure`).
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    hops, calls = FLAGS.hops, FLAGS.calls

    def timed(fn):
        for _ in range(3):
            fn().numpy()
        cpu, wall = busy_seconds(), time.perf_counter()
        for _ in range(calls):
            fn().numpy()
        return (busy_seconds() - cpu) / calls / hops * 1e3, \
            (time.perf_counter() - wall) / calls / hops * 1e3

    print(f"{'KiB':>6}{'hop wall ms':>13}{'hop cpu ms':>12}{'alone cpu ms':>14}"
          f"{'own cpu ms':>12}")
    for kib in [int(k) for k in FLAGS.sizes_kib]:
        with tf.device(task_device(0, "CPU", 0)):
            message = tf.Variable(tf.ones([kib * 256], tf.float32))

        def bounce(tasks):
            @tf.function
            def fn():
                x = message.read_value()
                for h in range(hops):
                    with tf.device(task_device(tasks[h % len(tasks)], "CPU", 0)):
                        x = tf.identity(x) + 0.0
                return x[0]
            return fn
        hop_cpu, hop_wall = timed(bounce([1, 0]))
        alone_cpu, _ = timed(bounce([0]))
        print(f"{kib:>6}{hop_wall:>13.3f}{hop_cpu:>12.3f}{alone_cpu:>14.3f}"
              f"{hop_cpu - alone_cpu:>12.3f}", flush=True)


def main(argv):
    del argv
    if FLAGS.worker:
        return worker()
    args = [f"--sizes_kib={','.join(FLAGS.sizes_kib)}", f"--hops={FLAGS.hops}",
            f"--calls={FLAGS.calls}"]
    print(f"command: python benchmarks/tf_transfer_cpu.py {' '.join(args)}; load average "
          f"{os.getloadavg()[0]:.1f}")
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", DAPPLE_NUM_CPU_DEVICES="1",
               PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    out = run_checked([sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
                       "--hosts=localhost:2", "--", sys.executable, os.path.abspath(__file__),
                       "--worker"] + args, env, REPO)
    print("\n".join(line.split(":", 1)[1] for line in out.splitlines()
                    if line.startswith("[0]<stdout>:")))      # the chief's
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    app.run(main)
