"""What the step-time benchmarks share: a rank's median `train_step` time, reported on a line the
parent reads back, and running their subprocesses."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

RESULT = "DAPPLE_STEP_MS "
CPU_RESULT = "DAPPLE_STEP_CPU_MS "


def median_step_times(pipelined_model, x, y, steps: int, warmup: int = 3):
    """(wall ms, CPU ms) of `steps` timed `train_step` calls (each up to `.numpy()`), after
    `warmup`, each the median. CPU time is this process's, all its threads (TensorFlow's and
    Horovod's): it moves less than wall time when other processes share the cores."""
    for _ in range(warmup):
        pipelined_model.train_step(x, y).numpy()
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        pipelined_model.train_step(x, y).numpy()
        wall.append(1e3 * (time.perf_counter() - start))
        cpu.append(1e3 * (time.process_time() - start_cpu))
    return statistics.median(wall), statistics.median(cpu)


def median_step_ms(pipelined_model, x, y, steps: int, warmup: int = 3) -> float:
    """Median of `steps` timed `train_step` calls (each up to `.numpy()`), after `warmup`."""
    return median_step_times(pipelined_model, x, y, steps, warmup)[0]


def report(pipelined_model, step_ms: float, cpu_ms: float = None) -> None:
    """Rank 0 prints the figure (and the CPU time, if given) on lines `read_step_ms` (and
    `read_step_cpu_ms`) find in the job's output."""
    if pipelined_model.rank == 0:
        print(RESULT + json.dumps(step_ms), flush=True)
        if cpu_ms is not None:
            print(CPU_RESULT + json.dumps(cpu_ms), flush=True)


def read_step_cpu_ms(output: str) -> float:
    for line in output.splitlines():
        if CPU_RESULT in line:
            return float(json.loads(line.split(CPU_RESULT, 1)[1]))
    raise RuntimeError(f"no step CPU time in the job's output:\n{output[-3000:]}")


def read_step_ms(output: str) -> float:
    for line in output.splitlines():
        if RESULT in line:
            return float(json.loads(line.split(RESULT, 1)[1]))
    raise RuntimeError(f"no step time in the job's output:\n{output[-3000:]}")


def one_thread_env(repo: str, **extra) -> dict:
    """The environment of a timed rank: one intra-op thread (two processes share the 2 cores),
    one device a process, Horovod polling every 0.1 ms, the repository importable."""
    return dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
                DAPPLE_NUM_CPU_DEVICES="1", HOROVOD_CYCLE_TIME="0.1", PYTHONPATH=repo,
                TF_CPP_MIN_LOG_LEVEL="2", **extra)


def run_checked(cmd, env: dict, cwd: str, timeout: float = 1800) -> str:
    """`cmd`'s standard output; its failure raises with the end of what it printed."""
    out = subprocess.run(cmd, env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout


def venv_bin(name: str) -> str:
    """A command installed beside this Python (`dapple`, `horovodrun`), venv activated or not."""
    return os.path.join(os.path.dirname(sys.executable), name)
