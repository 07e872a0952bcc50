"""Timing TensorFlow work on a shared machine: medians after warm-up, waiting for the values."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import tensorflow as tf

# Backward is timed as (forward + gradients) - forward; noise can make that negative.
MIN_BACKWARD_MS = 1e-3


def median_ms(fn: Callable[[], object], warmup: int, runs: int) -> float:
    """Median wall time of `fn()` in ms, after `warmup` unmeasured calls; waits for results."""
    return median_wall_and_cpu_ms(fn, warmup, runs)[0]


def median_wall_and_cpu_ms(fn: Callable[[], object], warmup: int, runs: int):
    """(median wall ms, median process CPU ms) of `fn()` after `warmup` unmeasured calls.

    CPU over wall is how many cores the process really had: a 2-device pipeline needs about 2;
    on a shared machine other processes take them (the reason a measured speedup can fall far
    below the planner's while every per-stage time agrees with the profile)."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    for _ in range(warmup):
        _wait(fn())
    walls, cpus = [], []
    for _ in range(runs):
        start, cpu = time.perf_counter(), time.process_time()
        _wait(fn())
        walls.append((time.perf_counter() - start) * 1000.0)
        cpus.append((time.process_time() - cpu) * 1000.0)
    return float(statistics.median(walls)), float(statistics.median(cpus))


def _wait(out) -> None:
    for t in tf.nest.flatten(out):   # the clock stops when the values exist
        if hasattr(t, "numpy"):
            t.numpy()
