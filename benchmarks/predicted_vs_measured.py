"""Predicted, simulated and measured step time of a 2-stage plan on 2 logical CPU devices.

    python benchmarks/predicted_vs_measured.py [--width=1024] [--depth=8] [--batch=256] \
        [--micro_batches=4] [--repeats=3]

Runs the user's commands, as a user would, from the repository root:

    TF_NUM_INTRAOP_THREADS=1 dapple profile --model=benchmarks.predicted_vs_measured:build \
        --model_args=... --batch_size=<micro-batch> --output=<tmp>/mlp.profile.json
    dapple verify --plan=<tmp>/plan.json --model=... --timing --profile=<tmp>/mlp.profile.json

`--repeats` times (fresh processes; the profile is measured once per repeat too), and prints
each run's predicted / simulated / measured figures and their medians with the ratio
measured / predicted. The model (`build`) is an MLP of `depth` Dense(width) layers: a few ms
per layer at the micro-batch, so per-op dispatch does not dominate. The plan is a straight
2-stage cut in the middle, early backward (policy A), M = `--micro_batches`.

The machine is shared: compare figures from one run of this script, and read the load average
printed with them (other processes take cores from the two devices).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

CORES = re.compile(r"keeps ([\d.]+) busy on average .* the process had ([\d.]+)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(width: int = 1024, depth: int = 8, classes: int = 10, seed: int = 0):
    """An MLP: `depth` Dense(width, relu) layers and a Dense(classes) head."""
    import tensorflow as tf
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((width,), name="x")
    h = x
    for i in range(depth):
        h = tf.keras.layers.Dense(width, activation="relu", name=f"dense{i}")(h)
    out = tf.keras.layers.Dense(classes, name="classifier")(h)
    return tf.keras.Model(x, out, name="mlp")


FIGURES = re.compile(r"predicted ([\d.]+)\s+simulated ([\d.]+)\s+measured ([\d.]+)")
EXTRA = re.compile(r"simulated from measured units ([\d.]+); measured without the optimizer's "
                   r"apply ([\d.]+)")


def _dapple(args, env):
    cmd = [sys.executable, "-m", "dapple.cli"] + args
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def main(argv):
    del argv
    from absl import flags
    F = flags.FLAGS
    from planner.formats.plan import straight_plan

    env = dict(os.environ, TF_NUM_INTRAOP_THREADS=str(F.intra_op_threads),
               TF_NUM_INTEROP_THREADS=str(F.inter_op_threads), DAPPLE_NUM_CPU_DEVICES="2",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    model_args = json.dumps({"width": F.width, "depth": F.depth})
    model = "benchmarks.predicted_vs_measured:build"
    layers = F.depth + 1
    micro = F.batch // F.micro_batches
    rows, singles = [], []
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, prof_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "mlp.profile.json")
        single_path = os.path.join(tmp, "single.json")
        straight_plan([(layers + 1) // 2], layers, F.micro_batches, F.batch).save(plan_path)
        straight_plan([], layers, 1, F.batch).save(single_path)
        profile_cmd = ["profile", f"--model={model}", f"--model_args={model_args}",
                       f"--batch_size={micro}", f"--output={prof_path}", "--runs=20",
                       "--warmup=3"]
        verify_cmd = ["verify", f"--plan={plan_path}", f"--model={model}",
                      f"--model_args={model_args}", "--timing", f"--profile={prof_path}",
                      f"--intra_op_threads={F.intra_op_threads}", f"--timing_runs={F.runs}"]
        print(f"MLP {F.depth} x Dense({F.width}), global batch {F.batch}, M={F.micro_batches} "
              f"(micro-batch {micro}), 2 stages on 2 logical CPU devices; intra-op threads "
              f"{F.intra_op_threads}, inter-op {F.inter_op_threads}")
        print("commands: dapple " + " ".join(profile_cmd).replace(tmp, "<tmp>"))
        print("          dapple " + " ".join(verify_cmd).replace(tmp, "<tmp>"))
        for i in range(F.repeats):
            load = os.getloadavg()[0]
            _dapple(profile_cmd, env)
            out = _dapple(verify_cmd, env)
            pred, sim, meas, sim_meas, grads, want_cores, had_cores = _figures(out)
            rows.append((pred, sim, meas, sim_meas, grads, want_cores, had_cores))
            if i == 0:
                print("\nfirst run's output (2 stages):\n" + out.strip())
            print(f"run {i}: load {load:.1f}  predicted {pred:.1f}  simulated {sim:.1f}  "
                  f"measured {meas:.1f}  (sim from measured units {sim_meas:.1f}, gradients only "
                  f"{grads:.1f}; cores {had_cores:.2f} of {want_cores:.2f})  measured/predicted "
                  f"{meas / pred:.2f}")
            if F.single:
                one = _figures(_dapple([a.replace(plan_path, single_path) for a in verify_cmd],
                                       env))
                singles.append(one)
                print(f"       1 device, M=1: predicted {one[0]:.1f}  measured {one[2]:.1f}  "
                      f"measured/predicted {one[2] / one[0]:.2f}")
    med = [statistics.median(col) for col in zip(*rows)]
    print(f"\nmedian of {len(rows)}: predicted {med[0]:.1f} ms  simulated {med[1]:.1f} ms  "
          f"measured {med[2]:.1f} ms  -> measured/predicted {med[2] / med[0]:.2f} "
          f"(target within 25%: {'met' if abs(med[2] / med[0] - 1) <= 0.25 else 'MISSED'}); "
          f"simulated from measured units {med[3]:.1f} ms, gradients only {med[4]:.1f} ms; "
          f"cores the process had {med[6]:.2f} of the {med[5]:.2f} the schedule keeps busy")
    # Runs in which the process had the cores the schedule keeps busy (CPU / wall of the step
    # at least 90% of the measured units' replay): the machine let the pipeline run.
    quiet = [r for r in rows if r[6] >= 0.9 * r[5]]
    if quiet:
        q = [statistics.median(col) for col in zip(*quiet)]
        print(f"median of the {len(quiet)} run(s) where the process had the cores: predicted "
              f"{q[0]:.1f} ms  simulated {q[1]:.1f} ms  measured {q[2]:.1f} ms  -> "
              f"measured/predicted {q[2] / q[0]:.2f}; per run: "
              + ", ".join(f"{r[2] / r[0]:.2f}" for r in quiet))
    else:
        print("no run had the cores the schedule needs (the machine was busy): the measured "
              "times include waiting for other processes")
    if singles:
        one = [statistics.median(col) for col in zip(*singles)]
        print(f"1 device (1-stage plan, M=1): predicted {one[0]:.1f} ms, measured {one[2]:.1f} ms"
              f" ({one[2] / one[0]:.2f}); speedup of 2 stages: predicted {one[0] / med[0]:.2f}x, "
              f"measured {one[2] / med[2]:.2f}x")


def _figures(out):
    m, extra, cores = FIGURES.search(out), EXTRA.search(out), CORES.search(out)
    if not m or not extra or not cores:
        raise SystemExit(f"no timing figures in dapple verify's output:\n{out}")
    return tuple(map(float, m.groups() + extra.groups() + cores.groups()))


if __name__ == "__main__":
    from absl import app, flags
    flags.DEFINE_integer("width", 1024, "units of every Dense layer")
    flags.DEFINE_integer("depth", 8, "Dense layers")
    flags.DEFINE_integer("batch", 256, "global batch")
    flags.DEFINE_integer("micro_batches", 4, "micro-batches of the 2-stage plan")
    flags.DEFINE_integer("repeats", 3, "fresh profile + verify runs (medians kept)")
    flags.DEFINE_integer("runs", 10, "measured runs inside each verify (its median)")
    flags.DEFINE_integer("intra_op_threads", 1, "TF intra-op threads")
    flags.DEFINE_integer("inter_op_threads", 4, "TF inter-op threads")
    flags.DEFINE_bool("single", True, "also time the 1-device plan (M=1): the speedup")
    app.run(main)
