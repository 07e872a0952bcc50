"""Where the CPU of a pipeline's step goes, on 2 processes against plain accumulation in one
(issue #27), sampled side by side in one run:

    python benchmarks/tf_runtime_cpu.py [--jobs=plain-accumulating,tensorflow,horovod]
        [--settle=30] [--window=10] [--steps=250] [--width=1024] [--depth=8] [--batch=256]
        [--micro_batches=8]

Each job is `benchmarks/tf_runtime_step.py`'s (the MLP and 1f1b plan of
`schedule_step_time.py`, one intra-op thread a process, oneDNN on): plain Keras summing M
micro-batches' gradients in one process; `dapple launch --runtime=tensorflow` on 2 processes;
`horovodrun -np 2`. Each runs `--steps` steps; `--settle` seconds after its start (past start-up
and tracing) `perf record -a -g` samples the whole machine for `--window` seconds. Every sample
of the job's processes is put in one class, by its function and callers:

* matmul: oneDNN's or Eigen's matrix products (the model's own work);
* transfer: gRPC, TensorFlow's rendezvous, Send/Recv; Horovod and Gloo;
* an op kernel (AssignAdd, Add, Mul, ...): the other TensorFlow kernels, named;
* python, the OS kernel (scheduling, system calls), and the runtime (executor, thread pools,
  allocator: the rest);
* idle: no process on the CPU.

Prints, per job, each class in core-milliseconds a step (the samples over the window's steps,
from the step time the job reports), and the busiest op kernels. Needs Linux `perf` and a
machine left alone while it runs.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks import schedule_step_time as sst  # noqa: E402  (its flags: width, depth, ...)
from benchmarks import tf_runtime_step as trs  # noqa: E402  (its jobs' commands)
from benchmarks.perf_samples import classify, descendants, samples  # noqa: E402
from benchmarks.step_timing import read_step_ms  # noqa: E402

FLAGS = flags.FLAGS
JOBS = ("plain-accumulating", "tensorflow", "horovod")    # tf_runtime_step.py's kinds
flags.DEFINE_list("jobs", list(JOBS), "what to sample")
flags.DEFINE_float("settle", 30.0, "seconds from a job's start to the window (start-up, tracing)")
flags.DEFINE_float("window", 10.0, "seconds sampled")
flags.DEFINE_integer("frequency", 999, "samples a second a CPU")


def sample_job(job: str, plan_path: str, tmp: str) -> dict:
    env = dict(sst.env(), TF_ENABLE_ONEDNN_OPTS="1")
    log = open(os.path.join(tmp, f"{job}.log"), "w+")
    process = subprocess.Popen(trs.job_command(job, plan_path), env=env, cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    data = os.path.join(tmp, f"{job}.data")
    try:
        time.sleep(FLAGS.settle)
        if process.poll() is not None:
            raise RuntimeError(f"{job} ended before its window: raise --steps")
        pids = descendants(process.pid)
        subprocess.run(["perf", "record", "-F", str(FLAGS.frequency), "-a", "-g", "-q",
                        "-o", data, "--", "sleep", str(FLAGS.window)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if process.poll() is not None:
            raise RuntimeError(f"{job} ended inside its window: raise --steps")
        pids |= descendants(process.pid)
        process.wait(timeout=1800)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    with log:
        log.seek(0)
        step_ms = read_step_ms(log.read())
    counts = collections.Counter()
    for pid, frames, dso in samples(data):
        counts["idle" if pid == 0 else classify(frames, dso) if pid in pids else
               "other processes"] += 1
    steps = FLAGS.window * 1e3 / step_ms
    per_step = {k: v * 1e3 / FLAGS.frequency / steps for k, v in counts.items()}
    return {"step_ms": step_ms, "core_ms": per_step}


def main(argv):
    del argv
    if subprocess.run(["perf", "--version"], capture_output=True).returncode != 0:
        raise app.UsageError("needs Linux `perf` (linux-tools) on the PATH")
    if set(FLAGS.jobs) - set(JOBS):
        raise app.UsageError(f"--jobs={','.join(FLAGS.jobs)}: each is one of {', '.join(JOBS)}")
    print("command: python benchmarks/tf_runtime_cpu.py " + " ".join(
        [f"--jobs={','.join(FLAGS.jobs)}", f"--settle={FLAGS.settle:g}",
         f"--window={FLAGS.window:g}"] + trs.sizes()))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "1f1b.json")
        sst.plans(FLAGS.depth + 1)["1f1b"].save(plan_path)
        for job in FLAGS.jobs:
            results[job] = sample_job(job, plan_path, tmp)
            print(f"{job}: step {results[job]['step_ms']:.1f} ms (load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
    ops = lambda r: {k: v for k, v in r["core_ms"].items() if k.startswith("op ")}  # noqa: E731
    classes = ["matmul", "transfer", "op kernels", "runtime", "OS kernel", "python", "idle",
               "other processes"]
    print("\ncore-ms a step (2 cores: twice the step is every core's time)")
    print(f"{'':<18}" + "".join(f"{job:>20}" for job in FLAGS.jobs))
    print(f"{'step (wall)':<18}" + "".join(f"{results[j]['step_ms']:>20.1f}" for j in FLAGS.jobs))
    for c in classes:
        row = [sum(ops(results[j]).values()) if c == "op kernels" else
               results[j]["core_ms"].get(c, 0.0) for j in FLAGS.jobs]
        print(f"{c:<18}" + "".join(f"{v:>20.1f}" for v in row))
    for j in FLAGS.jobs:
        top = sorted(ops(results[j]).items(), key=lambda kv: -kv[1])[:8]
        print(f"{j}, busiest op kernels: " + ", ".join(f"{k[3:]} {v:.1f}" for k, v in top))


if __name__ == "__main__":
    flags.FLAGS.set_default("steps", 250)
    app.run(main)
