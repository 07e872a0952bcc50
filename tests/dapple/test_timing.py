"""`dapple.timing` and `dapple verify --timing`: structure of the measurements, never their speed.

The machine is shared, so nothing here asserts a duration. What is checked: every stage gets a
positive forward and backward time for the right slice on its own device; the report's simulated-from-measured time is
the schedule replayed with the measured durations (hand-computed); and the command prints the
three step times and one row per stage.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import dapple  # noqa: F401  (logical devices first)
from dapple.pipelined_model import PipelinedModel
from dapple.measure import median_ms
from dapple.timing import (MeasuredPlan, StageTiming, format_report, measure_plan,
                           measure_stages, timing_report)
from planner.estimate.cost_model import evaluate
from planner.formats.plan import Plan, straight_plan
from planner.formats.profile import Layer, Profile
from planner.formats.profile_readers import load_profile
from tests.models import mlp_with_skip
from tests.paths import REPO as ROOT
from topology import local_topology, parse_topology


def heavy_then_light(seed=0):
    """4 layers: two Dense(384) (heavy), then Dense(2) and Dense(1) (almost nothing)."""
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((384,), name="x")
    h = tf.keras.layers.Dense(384, activation="relu", name="big1")(x)
    h = tf.keras.layers.Dense(384, activation="relu", name="big2")(h)
    h = tf.keras.layers.Dense(2, activation="relu", name="small1")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(1, name="small2")(h), name="heavy_then_light")


def compiled(model, plan):
    pm = PipelinedModel(model, plan)
    pm.compile(tf.keras.optimizers.SGD(0.0), tf.keras.losses.MeanSquaredError())
    return pm


def test_every_stage_is_timed_on_its_device_for_its_slice():
    plan = straight_plan([1, 3], 5, 2, 16, replicas=[2, 1, 1])   # micro-batch 8; stage 0 slices of 4
    pm = compiled(mlp_with_skip(), plan)
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 6).astype("float32"), rng.randn(16, 5).astype("float32")
    stages = measure_stages(pm, x, y, warmup=1, runs=3)
    assert [s.stage for s in stages] == [0, 1, 2]
    assert [s.rows for s in stages] == [4, 8, 8]
    assert [s.device for s in stages] == [pm.devices[0], pm.devices[2], pm.devices[3]]
    for s in stages:
        assert s.forward_ms > 0 and s.backward_ms > 0


def test_measure_plan_keeps_the_weights_with_a_zero_learning_rate_and_reports_steps():
    plan = straight_plan([2], 4, 2, 16)
    model = heavy_then_light()
    before = [v.numpy().copy() for v in model.trainable_variables]
    pm = compiled(model, plan)
    rng = np.random.RandomState(0)
    measured = measure_plan(pm, rng.randn(16, 384).astype("float32"),
                            rng.randn(16, 1).astype("float32"), warmup=1, runs=2)
    assert measured.step_ms > 0 and measured.gradients_ms > 0
    assert len(measured.stages) == 2
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


def test_median_ms_refuses_no_runs():
    with pytest.raises(ValueError, match="runs >= 1"):
        median_ms(lambda: None, warmup=0, runs=0)


def _flat_profile(n_layers, forward_ms, backward_ms, batch):
    layers = [Layer(name=f"l{i}", type="Dense", forward_ms=forward_ms, backward_ms=backward_ms,
                    output_bytes=0.0, parameter_bytes=0.0) for i in range(n_layers)]
    return Profile(name="flat", batch_size=batch, layers=layers)


def test_two_stage_report_counts_the_cores_the_schedule_keeps_busy():
    # Straight 2 stages, M = 2, measured F = 1, B = 2 on both, transfers of 0 bytes (latency
    # only, LOCAL_CPU_COPY_LATENCY = 0.05 ms each way). Schedule A: stage 0 F0 F1 B0 B1 (K=2),
    # stage 1 F0 B0 F1 B1. Stage 0: F0 0-1, F1 1-2; stage 1: F0 1.05-2.05, B0 2.05-4.05,
    # F1 4.05-5.05, B1 5.05-7.05; stage 0: B0 4.1-6.1, B1 7.1-9.1. Busy 2 x 2 x 3 = 12 ms.
    plan = straight_plan([1], 2, 2, 16)
    profile = _flat_profile(2, 1.0, 2.0, 8)
    measured = MeasuredPlan(stages=[StageTiming(0, "/device:CPU:0", 8, 1.0, 2.0),
                                    StageTiming(1, "/device:CPU:1", 8, 1.0, 2.0)],
                            step_ms=10.0, gradients_ms=9.0, warmup=0, runs=1, step_cpu_ms=5.0)
    report = timing_report(plan, profile, local_topology(2), measured)
    assert report.simulated_measured_ms == pytest.approx(9.1)
    assert report.expected_cores == pytest.approx(12.0 / 9.1)
    assert report.cores_used == pytest.approx(0.5)
    assert "did not compute side by side" in format_report(report)


def test_report_replays_the_schedule_with_the_measured_unit_times():
    # One stage, M = 4 micro-batches, measured F = 2 ms, B = 3 ms: the replay is 4 x (2 + 3).
    plan = straight_plan([], 2, 4, 32)
    profile = _flat_profile(2, 1.0, 2.0, 8)
    measured = MeasuredPlan(stages=[StageTiming(0, "/device:CPU:0", 8, 2.0, 3.0)],
                            step_ms=30.0, gradients_ms=25.0, warmup=0, runs=1)
    report = timing_report(plan, profile, local_topology(1), measured)
    assert report.simulated_measured_ms == pytest.approx(20.0)
    assert report.expected_cores == pytest.approx(1.0)     # 20 ms busy over 20 ms
    assert report.measured_ms == 30.0
    assert report.ratio == pytest.approx(30.0 / report.predicted_ms)
    text = format_report(report)
    assert "predicted" in text and "simulated" in text and "measured 30.00" in text


def _run_verify(tmp_path, plan, builder, *extra):
    path = str(tmp_path / "plan.json")
    plan.save(path)
    env = dict(os.environ, DAPPLE_NUM_CPU_DEVICES="4")
    return subprocess.run([sys.executable, "-m", "dapple.cli", "verify", f"--plan={path}",
                           f"--model={builder}", "--timing", "--timing_warmup=1",
                           "--timing_runs=2", *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env)


STEP_LINE = re.compile(r"step time, ms:\s+predicted ([\d.]+)\s+simulated ([\d.]+)\s+"
                       r"measured ([\d.]+)")


def _stage_rows(stdout):
    return [line.split() for line in stdout.splitlines() if re.match(r"^\d+\s+\d+\s+[\d.]+", line)]


def test_verify_timing_prints_three_step_times_and_a_row_per_stage(tmp_path):
    proc = _run_verify(tmp_path, straight_plan([1, 3], 5, 2, 16, replicas=[2, 1, 1]),
                       "tests.models:mlp_with_skip")
    assert proc.returncode == 0, proc.stderr
    assert "OK: the pipelined gradients equal" in proc.stdout      # the old behaviour stays
    m = STEP_LINE.search(proc.stdout)
    assert m, proc.stdout
    assert all(float(v) > 0 for v in m.groups())
    rows = _stage_rows(proc.stdout)
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert [r[1] for r in rows] == ["4", "8", "8"]
    assert "measured / predicted" in proc.stdout


def test_verify_timing_uses_a_dapple_profile(tmp_path):
    prof = str(tmp_path / "mlp.profile.json")
    env = dict(os.environ, DAPPLE_NUM_CPU_DEVICES="4")
    done = subprocess.run([sys.executable, "-m", "dapple.cli", "profile",
                           "--model=tests.models:mlp_with_skip", "--batch_size=8",
                           f"--output={prof}", "--runs=2"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    proc = _run_verify(tmp_path, straight_plan([2], 5, 2, 16), "tests.models:mlp_with_skip",
                       f"--profile={prof}")
    assert proc.returncode == 0, proc.stderr
    assert "profiling the model" not in proc.stdout
    assert "profile 'mlp_with_skip' at batch 8" in proc.stdout
    assert STEP_LINE.search(proc.stdout), proc.stdout
    assert len(_stage_rows(proc.stdout)) == 2
    # --topology: the prediction is the cost model's on that topology (slow links: far above).
    spec = "1x2,nvlink=0.01MB/s"
    slow = _run_verify(tmp_path, straight_plan([2], 5, 2, 16), "tests.models:mlp_with_skip",
                       f"--profile={prof}", f"--topology={spec}")
    assert slow.returncode == 0, slow.stderr
    assert f"timing on {spec} with" in slow.stdout
    plan = Plan.load(str(tmp_path / "plan.json"))
    want = evaluate(plan, load_profile(prof), parse_topology(spec)).latency_ms
    assert float(STEP_LINE.search(slow.stdout).group(1)) == pytest.approx(want, abs=0.01)
    assert want > 2 * float(STEP_LINE.search(proc.stdout).group(1))


def test_verify_timing_refuses_a_profile_of_another_model(tmp_path):
    prof = str(tmp_path / "conv.profile.json")
    done = subprocess.run([sys.executable, "-m", "dapple.cli", "profile",
                           "--model=tests.models:small_conv", "--batch_size=4",
                           f"--output={prof}", "--runs=1", "--warmup=0"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    proc = _run_verify(tmp_path, straight_plan([2], 5, 2, 16), "tests.models:mlp_with_skip",
                       f"--profile={prof}")
    assert proc.returncode == 2
    assert "measured on another model" in proc.stderr


def test_verify_timing_explains_a_missing_profile(tmp_path):
    proc = _run_verify(tmp_path, straight_plan([2], 5, 2, 16), "tests.models:mlp_with_skip",
                       f"--profile={tmp_path / 'nope.json'}")
    assert proc.returncode == 2
    assert "--profile" in proc.stderr and "nope.json" in proc.stderr
