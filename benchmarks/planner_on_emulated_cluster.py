"""The planner held to measurement: predicted and measured step times of data parallelism, the
straight pipeline and the planner's best plan on an emulated 2-host cluster, at two link rates.

    python benchmarks/planner_on_emulated_cluster.py [--runtime=horovod|tensorflow]
        [--rates=100Mbps,5Gbps] [--global_batch_size=128] [--steps=8] [--repeats=2] [--pin=false]
        [--host_cpus=CPUS/2]

Issue #17, item 3 (`--runtime=horovod`, the default); issue #27 (`--runtime=tensorflow`). Needs
root (`dapple emulate`). In one run:

1. profile the model on one core at `--profile_batch` (`dapple profile`, one intra-op and one
   inter-op thread: with two inter-op threads a layer's backward used the second core and read
   half the time a rank gets beside a busy neighbour);
2. per rate: `dapple emulate --topology=2x1,net=RATE -- dapple topology --measure` (one rank a
   host: the link between hosts is measured, the in-host link is not used by any plan); with
   `--runtime=tensorflow`, `dapple emulate --runtime=tensorflow` (no plan: a task per host), so
   the chief times TensorFlow's Send/Recv between the hosts (`dapple.tf_link_measure`);
3. per rate: the planner's best data-parallel plan, best straight pipeline and best plan
   (`planner.search.baselines`, `planner.search.plan_space.plan_dapple`, even slices as the runtime needs),
   each with the planner's estimate and the simulator's replay; with `--runtime=tensorflow` the
   plans carry `transfers="tensorflow"` (as `dapple plan --transfers=tensorflow`: buffered,
   full-duplex Send/Recv, and the chief sending a first stage's remote replicas their rows
   before their first forward), planned and estimated with it;
4. per rate: each distinct plan trained under `dapple emulate` at that rate (with
   `--runtime=tensorflow --plan=PLAN`: a server on host 1, this script once as the chief on host
   0), median of `--steps` steps after 3 warm-up steps, plans alternating, `--repeats` rounds
   (median kept); and a reference. Under Horovod it is plain Horovod data parallelism of the
   same model (`plain_dp_step.py`), which says how much of a gap is the runtime's and how much
   the model's. The TF runtime has no plain counterpart that runs as it does (one script on
   the chief driving the other task; a `tf.distribute` strategy would be another program with
   another data path), so its reference is dapple's own data parallelism on it, M = 1 (one
   replica a host): the data-parallel row itself whenever the planner's best data-parallel
   plan is that one, as it is for this model (its runs are then not repeated). Under this
   runtime each stage's weights live on its own devices (docs/runtime.md), so a step moves
   boundaries and replica gradients as the cost model has them, and host 1's first-stage
   replica gets its rows of the batch from the chief (`PipelineCosts.start_ms`).

Prints predicted and measured side by side, the rankings, and the targets (the rankings match;
each prediction within 20%).

Why this model (`build`): three 3x3 convolutions (most of the compute, few parameters, 64 KiB of
activations a sample between them), a 2x2 max-pool, then Dense(512) on the 4096 pooled
features (2.1 M parameters, 8.4 MB of gradients, little compute) and a classifier. Data
parallelism's allreduce carries the dense layer's 8.4 MB; a pipeline's boundary carries either
the convolutions' large activations (a balanced cut) or the few pooled/dense features (a cut
near the end, which leaves one stage almost all the work). On a slow link the allreduce is what
hurts, so a pipeline wins; on a fast link the allreduce costs less than a pipeline's bubble and
boundary transfers, so data parallelism wins: both terms matter, and which plan is best flips.

Ranks run unpinned (`--pin=false`): pinned to one CPU each, Horovod's per-transfer latency
read 5 to 8 ms here instead of about 1 ms (the rank's helper threads wait behind its own
busy-waiting TF threads), which would make every pipeline transfer cost what the network
does not (the TF runtime's data parallelism measured 2.1 times its prediction pinned). Each
host gets this machine's CPUs over the 2 hosts instead (`--host_cpus`, a CPU quota per host on
any core): unlimited, a rank whose neighbour idles takes the neighbour's core, and a plan that
leaves host 1 idle measured 0.64 of its prediction (docs/cluster.md).
"""
from __future__ import annotations

import importlib.util
import os
import re
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks.step_timing import (median_step_ms, read_step_ms, report,  # noqa: E402
                                    run_checked, venv_bin)

FLAGS = flags.FLAGS
flags.DEFINE_enum("runtime", "horovod", ["horovod", "tensorflow"],
                  "dapple's runtime the plans run on under `dapple emulate` (see the module doc)")
flags.DEFINE_list("rates", ["100Mbps", "5Gbps"], "link rates between the two hosts")
flags.DEFINE_integer("global_batch_size", 128, "global batch")
flags.DEFINE_integer("profile_batch", 32, "batch the profile is measured at")
flags.DEFINE_integer("steps", 8, "timed steps per measurement (median kept)")
flags.DEFINE_integer("repeats", 2, "rounds of alternating measurements (median kept)")
flags.DEFINE_bool("pin", False, "pin each rank to one CPU (see the module doc)")
flags.DEFINE_float("host_cpus", None, "CPUs each emulated host may use (`dapple emulate "
                   "--host_cpus`); unset: this machine's CPUs over the 2 hosts; 0: no limit")
flags.DEFINE_string("worker_plan", "", "internal: train this plan as one rank and time it")
SIZE, CHANNELS = 16, 32
BEST = "planner's best"


def build(convs: int = 3, filters: int = 64, dense: int = 512, classes: int = 10, seed: int = 0):
    """The benchmark's model (see the module doc)."""
    import tensorflow as tf
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((SIZE, SIZE, CHANNELS), name="x")
    h = x
    for i in range(convs):
        h = tf.keras.layers.Conv2D(filters, 3, padding="same", activation="relu",
                                   name=f"conv{i}")(h)
    h = tf.keras.layers.MaxPooling2D(2, name="pool")(h)
    h = tf.keras.layers.Flatten(name="flatten")(h)
    h = tf.keras.layers.Dense(dense, activation="relu", name="dense")(h)
    out = tf.keras.layers.Dense(classes, name="classifier")(h)
    return tf.keras.Model(x, out, name="convs_then_dense")


# ---- one rank of one measurement ---------------------------------------------------------------
def worker() -> None:
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # before TensorFlow
    import numpy as np
    import tensorflow as tf
    from planner.formats.plan import Plan
    tf.get_logger().setLevel("ERROR")
    pm = dapple.PipelinedModel(build(), Plan.load(FLAGS.worker_plan))
    pm.compile(tf.keras.optimizers.SGD(0.01),
               tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    B = FLAGS.global_batch_size
    x = tf.constant(rng.randn(B, SIZE, SIZE, CHANNELS).astype("float32"))
    y = tf.constant(rng.randint(0, 10, B).astype("int32"))
    report(pm, median_step_ms(pm, x, y, FLAGS.steps))


# ---- the parent --------------------------------------------------------------------------------
def env() -> dict:
    # HOROVOD_CYCLE_TIME as `dapple launch` sets it; one TF thread a rank comes from emulate.
    return dict(os.environ, HOROVOD_CYCLE_TIME="0.1", PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")


def run(cmd, timeout=1800) -> str:
    return run_checked(cmd, env(), REPO, timeout)


def emulated(rate: str, program, plan_path: str = "") -> list:
    """`program` under `dapple emulate` at `rate`: every rank (Horovod), or the chief of a TF
    cluster (`--runtime=tensorflow`; `plan_path` its plan, none for a command without one)."""
    tf_cluster = (["--runtime=tensorflow"] + ([f"--plan={plan_path}"] if plan_path else [])
                  if FLAGS.runtime == "tensorflow" else [])
    cpus = [f"--host_cpus={host_cpus():g}"] if host_cpus() else []
    return [venv_bin("dapple"), "emulate", f"--topology=2x1,net={rate}",
            f"--pin={str(FLAGS.pin).lower()}"] + cpus + tf_cluster + ["--"] + list(program)


def host_cpus() -> float:
    return FLAGS.host_cpus if FLAGS.host_cpus is not None else len(os.sched_getaffinity(0)) / 2


def plain_data_parallel_ms(rate: str) -> float:
    """Step time of plain Horovod data parallelism (no dapple) of the same model and batch on
    the same emulated cluster: what the runtime adds to the model's work."""
    out = run(emulated(rate, [sys.executable, os.path.join(HERE, "plain_dp_step.py"),
                              "--model=benchmarks.planner_on_emulated_cluster:build",
                              f"--global_batch_size={FLAGS.global_batch_size}",
                              f"--steps={FLAGS.steps}", "--warmup=3"]))
    found = re.search(r'DAPPLE_RESULT .*"step_ms": ([0-9.]+)', out)
    if not found:
        raise RuntimeError(f"no step time from plain_dp_step.py:\n{out[-3000:]}")
    return float(found.group(1))


def plan_key(plan) -> tuple:
    return (plan.micro_batches, plan.schedule, plan.warmup and tuple(plan.warmup),
            tuple((st.first, st.last, tuple(st.devices)) for st in plan.stages))


def describe(plan) -> str:
    stages = " | ".join(f"layers {st.first}-{st.last} x{st.replicas}" for st in plan.stages)
    return f"M={plan.micro_batches} {plan.schedule}: {stages}"


def reference_plan(profile, topology, B: int):
    """--runtime=tensorflow's reference: dapple's data parallelism, M = 1 (see the module doc)."""
    from planner.formats.plan import Plan, Stage
    from planner.search.plan_finishing import finish_plan
    plan = Plan(stages=[Stage(layers=[0, profile.num_layers - 1], devices=[0, 1])],
                micro_batches=1, global_batch_size=B, transfers="tensorflow")
    return finish_plan(plan, profile, topology)


def ranking(times: dict) -> list:
    return sorted(times, key=times.get)


def main(argv):
    del argv
    if FLAGS.worker_plan:
        return worker()
    from planner.search.baselines import best_data_parallel_plan, best_straight_plan
    from planner.estimate.cost_model import pipeline_costs
    from planner.search.plan_space import plan_dapple
    from planner.formats.profile_readers import load_profile
    from planner.estimate.simulator import simulate_plan
    from topology.parse import parse_topology

    B = FLAGS.global_batch_size
    tf_runtime = FLAGS.runtime == "tensorflow"
    print(f"command: python benchmarks/planner_on_emulated_cluster.py "
          f"--runtime={FLAGS.runtime} --rates={','.join(FLAGS.rates)} --global_batch_size={B} "
          f"--profile_batch={FLAGS.profile_batch} --steps={FLAGS.steps} "
          f"--repeats={FLAGS.repeats} --pin={str(FLAGS.pin).lower()} "
          f"--host_cpus={host_cpus():g}")
    misses = []
    with tempfile.TemporaryDirectory() as tmp:
        prof_path = os.path.join(tmp, "model.profile.json")
        # One core, as a rank gets when every core is busy: TensorFlow's inter-op pool would
        # otherwise run a layer's two gradients (input, weights) on the other core at once.
        prof_env = dict(env(), TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                        OMP_NUM_THREADS="1")
        run_checked([venv_bin("dapple"), "profile",
                     "--model=benchmarks.planner_on_emulated_cluster:build",
                     f"--batch_size={FLAGS.profile_batch}", f"--output={prof_path}",
                     "--runs=20", "--warmup=3"], prof_env, REPO)
        profile = load_profile(prof_path)
        print(f"profile: {profile.num_layers} layers at batch {FLAGS.profile_batch}, one core: "
              f"forward {profile.forward_ms(0, profile.num_layers - 1):.2f} ms, backward "
              f"{profile.backward_ms(0, profile.num_layers - 1):.2f} ms")
        for rate in FLAGS.rates:
            topo_path = os.path.join(tmp, f"topology-{rate}.json")
            run(emulated(rate, [venv_bin("dapple"), "topology", "--measure", f"--output={topo_path}"]))
            topology = parse_topology(topo_path)
            transfers = "tensorflow" if tf_runtime else "async"
            plans = {"data parallel": best_data_parallel_plan(profile, topology, B,
                                                              even_slices=True,
                                                              transfers=transfers),
                     "straight pipeline": best_straight_plan(profile, topology, B,
                                                             even_slices=True,
                                                             transfers=transfers),
                     BEST: plan_dapple(profile, topology, B, even_slices=True,
                                       transfers=transfers)}
            if tf_runtime:
                reference = reference_plan(profile, topology, B)
            paths, measured = {}, {}
            for plan in list(plans.values()) + ([reference] if tf_runtime else []):
                key = plan_key(plan)
                if key not in paths:
                    paths[key] = os.path.join(tmp, f"{rate}-{len(paths)}.json")
                    plan.save(paths[key])
                    measured[key] = []
            loads, plain = [], []
            for _ in range(FLAGS.repeats):
                for key, path in paths.items():
                    loads.append(os.getloadavg()[0])
                    out = run(emulated(rate, [sys.executable, os.path.abspath(__file__),
                                              f"--worker_plan={path}",
                                              f"--global_batch_size={B}",
                                              f"--steps={FLAGS.steps}"],
                                       path if tf_runtime else ""))
                    measured[key].append(read_step_ms(out))
                if not tf_runtime:
                    plain.append(plain_data_parallel_ms(rate))
            print(f"\n== {rate}: measured link {8 * topology.inter_host_bandwidth / 1e9:.3f} "
                  f"Gbit/s, {1e3 * topology.inter_host_latency:.2f} ms a transfer" + (
                      f", an end's compute {1e3 * topology.transfer_cpu_latency:.3f} ms + its "
                      f"bytes at {topology.transfer_cpu_bandwidth / 1e9:.2f} GB/s"
                      if topology.transfer_cpu_latency or topology.transfer_cpu_bandwidth
                      else "") + f"; load average {min(loads):.1f}..{max(loads):.1f}")
            print(f"{'plan':<19}{'predicted ms':>13}{'simulated ms':>13}{'measured ms':>12}"
                  f"{'meas / pred':>12}   shape")
            predicted, meas = {}, {}
            for name, plan in plans.items():
                key = plan_key(plan)
                predicted[name] = plan.estimate.latency_ms
                simulated = simulate_plan(plan, pipeline_costs(plan, profile,
                                                               topology)).iteration_ms
                meas[name] = statistics.median(measured[key])
                ratio = meas[name] / predicted[name]
                if abs(ratio - 1) > 0.20:
                    misses.append(f"{rate} {name}: measured / predicted {ratio:.2f}")
                print(f"{name:<19}{predicted[name]:>13.1f}{simulated:>13.1f}{meas[name]:>12.1f}"
                      f"{ratio:>12.2f}   {describe(plan)}")
            names = {key: " = ".join(n for n, p in plans.items() if plan_key(p) == key)
                     or "dapple DP M=1" for key in paths}
            if tf_runtime:
                ref = plan_key(reference)
                print(f"{'dapple DP M=1':<19}{'':>13}{'':>13}"
                      f"{statistics.median(measured[ref]):>12.1f}{'':>12}   the reference on "
                      f"this runtime" + (f": the {names[ref]} row's runs" if names[ref] !=
                                         "dapple DP M=1" else ""))
            else:
                print(f"{'plain Horovod DP':<19}{'':>13}{'':>13}{statistics.median(plain):>12.1f}"
                      f"{'':>12}   benchmarks/plain_dp_step.py: the same model, batch and ranks "
                      f"without dapple")
            print("per round (ms): " + "; ".join(
                f"{names[key]} " + ", ".join(f"{t:.0f}" for t in measured[key])
                for key in paths))
            # The distinct plans, ordered by prediction and by measurement.
            by_pred = ranking({names[plan_key(p)]: predicted[n] for n, p in plans.items()})
            by_meas = ranking({names[plan_key(p)]: meas[n] for n, p in plans.items()})
            print(f"ranking predicted: {' < '.join(by_pred)}; measured: {' < '.join(by_meas)}"
                  f" -> {'match' if by_pred == by_meas else 'MISMATCH'}")
            if by_pred != by_meas:
                misses.append(f"{rate}: ranking predicted {by_pred}, measured {by_meas}")
    print("\ntargets: rankings match and each prediction within 20%: "
          + ("met" if not misses else "not met: " + "; ".join(misses)))


if __name__ == "__main__":
    app.run(main)
