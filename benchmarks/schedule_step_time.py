"""Step time of zb-h1 and interleaved against 1f1b, measured with one process per device and
next to the simulator's prediction; and the split backward (I + W) against the fused one.

    python benchmarks/schedule_step_time.py [--width=1024] [--depth=8] [--batch=256]
        [--micro_batches=8] [--steps=10] [--repeats=3]

Issue #13, item 5. The model is an MLP of `depth` Dense(width, relu) layers and a classifier
(`benchmarks.predicted_vs_measured.build`): uniform layers, a few ms each per micro-batch, so
dispatch does not dominate. In one run:

1. profile it with one TF thread at the micro-batch size (`dapple profile`, which measures each
   layer's input-gradient share too);
2. measure the links between two ranks (`horovodrun -np 2 dapple topology --measure`);
3. predict each plan's step with the simulator on those (`planner.estimate.cost_model.pipeline_costs`,
   `planner.estimate.simulator.simulate_plan`; also with dapple's own transfer cost, with rendezvous
   transfers, and with Horovod's: rendezvous and one collective at a time per rank): 1f1b and
   zb-h1 on the same 2 stages (cut in the middle), interleaved with v = 2 (4 chunks, cut at the
   quarters);
4. measure each plan under `horovodrun -np 2 -H localhost:2 --gloo`, one intra-op thread per
   rank, `HOROVOD_CYCLE_TIME=0.1` (what `dapple launch` sets): median of `--steps` steps after
   3 warm-up steps, plans alternating, `--repeats` rounds, median kept;
5. time the whole model's forward and backward, fused (the split's backward function) and
   split (its I, then its W: the runtime's `graph_rewrite.stage_split`), one process, one
   thread.

Prints the figures and the ratios to 1f1b, predicted and measured side by side. The machine is
shared: read the load average printed with them.
"""
from __future__ import annotations

import importlib.util
import dataclasses
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from benchmarks.step_timing import (median_step_ms, one_thread_env, read_step_ms,  # noqa: E402
                                    report, run_checked, venv_bin)

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 1024, "units of every Dense layer")
flags.DEFINE_integer("depth", 8, "Dense layers before the classifier")
flags.DEFINE_integer("batch", 256, "global batch")
flags.DEFINE_integer("micro_batches", 8, "M")
flags.DEFINE_integer("steps", 10, "timed steps per measurement (median kept)")
flags.DEFINE_integer("repeats", 3, "rounds of alternating measurements (median kept)")
flags.DEFINE_string("worker_plan", "", "internal: time this plan as one rank")
flags.DEFINE_bool("worker_loop", False, "internal: the worker's pipeline with pipeline_loop=True")
flags.DEFINE_bool("worker_out_of_line", False,
                  "internal: the worker's pipeline with inline_stage_calls=False")
RESULT = "DAPPLE_SPLIT_MS "
SCHEDULES = ("1f1b", "zb-h1", "interleaved")


def model_args() -> dict:
    return {"width": FLAGS.width, "depth": FLAGS.depth}


def plans(num_layers: int) -> dict:
    from planner.search.chunking import interleaved_plan
    from planner.formats.plan import straight_plan
    half, quarter = num_layers // 2, num_layers // 4
    M, B = FLAGS.micro_batches, FLAGS.batch
    return {"1f1b": straight_plan([half], num_layers, M, B, schedule="1f1b"),
            "zb-h1": straight_plan([half], num_layers, M, B, schedule="zb-h1"),
            "interleaved": interleaved_plan([quarter, half, half + quarter], num_layers, M, 2,
                                            B)}


# ---- one rank of one measurement ---------------------------------------------------------------
def worker() -> None:
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple  # before TensorFlow
    import numpy as np
    import tensorflow as tf
    from benchmarks.predicted_vs_measured import build
    from planner.formats.plan import Plan
    tf.get_logger().setLevel("ERROR")
    plan = Plan.load(FLAGS.worker_plan)
    pm = dapple.PipelinedModel(build(**model_args()), plan, pipeline_loop=FLAGS.worker_loop,
                               inline_stage_calls=False if FLAGS.worker_out_of_line else None)
    pm.compile(tf.keras.optimizers.SGD(0.01),
               tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(FLAGS.batch, FLAGS.width).astype("float32"))
    y = tf.constant(rng.randint(0, 10, FLAGS.batch).astype("int32"))
    report(pm, median_step_ms(pm, x, y, FLAGS.steps))


# ---- the parent --------------------------------------------------------------------------------
def env() -> dict:
    return one_thread_env(REPO)


def run(cmd, timeout=1800) -> str:
    return run_checked(cmd, env(), REPO, timeout)


def dapple_transfer_ms(size: int) -> float:
    """dapple's own per-transfer cost for `size` bytes between the two ranks, from
    benchmarks/transfer_cost.py (its last row: size, raw step, dapple step, raw/hop,
    dapple/transfer, ...)."""
    out = run([sys.executable, os.path.join(HERE, "transfer_cost.py"), f"--sizes={size}",
               "--hops=32", "--repeats=9"])
    return float(out.strip().splitlines()[-1].split()[4])


def horovodrun(args) -> list:
    return [venv_bin("horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"] + args


def measure_step(plan_path: str) -> float:
    out = run(horovodrun([sys.executable, os.path.abspath(__file__),
                          f"--worker_plan={plan_path}", f"--width={FLAGS.width}",
                          f"--depth={FLAGS.depth}", f"--batch={FLAGS.batch}",
                          f"--micro_batches={FLAGS.micro_batches}", f"--steps={FLAGS.steps}"]))
    return read_step_ms(out)


def split_against_fused() -> tuple:
    """(fused ms, split ms) of the whole model's forward + backward, one thread."""
    code = f"""
import os, json, statistics, time
os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
import numpy as np, tensorflow as tf
from benchmarks.predicted_vs_measured import build
from graph_rewrite.model_graph import cut_model, layer_order
from graph_rewrite.stage_function import StageFunction
from graph_rewrite.stage_split import split_stage
model = build(**{model_args()!r})
rows = {FLAGS.batch // FLAGS.micro_batches}
x = tf.constant(np.random.RandomState(0).randn(rows, {FLAGS.width}).astype("float32"))
stage = cut_model(model, [(0, len(layer_order(model)) - 1)])[0]
# A middle stage (index 1): the input gets its gradient, as the runtime's would.
halves = split_stage(StageFunction(stage, None, stage.output_ids, last=False), 1, rows, rows,
                     (), dict(stage.specs), split_weights=True)
(x_id,) = stage.input_ids
def make(split_backward):
    @tf.function
    def step(x):
        outputs, _, _, residuals = halves.forward({{x_id: x}})
        dys = [2 * outputs[t] for t in halves.differentiated_outputs]   # of sum(out ** 2)
        if not split_backward:
            grads_in, grads = halves.backward(residuals, dys)
        else:
            grads_in, pending = halves.backward_input(residuals, dys)
            grads = halves.backward_weight(pending)
        return list(grads_in.values()) + grads
    return step
out = []
for split in (False, True):
    f = make(split)
    for _ in range(5): f(x)
    ts = []
    for _ in range(30):
        t = time.perf_counter(); [g.numpy() for g in f(x)]; ts.append(1e3 * (time.perf_counter() - t))
    out.append(statistics.median(ts))
print("{RESULT}" + json.dumps(out))
"""
    out = run([sys.executable, "-c", code])
    line = [l for l in out.splitlines() if RESULT in l][-1]
    return tuple(json.loads(line.split(RESULT, 1)[1]))


def main(argv):
    del argv
    if FLAGS.worker_plan:
        return worker()
    from planner.estimate.cost_model import pipeline_costs
    from planner.formats.profile_readers import load_profile
    from planner.estimate.simulator import simulate_plan
    from topology.parse import parse_topology

    print(f"command: python benchmarks/schedule_step_time.py --width={FLAGS.width} "
          f"--depth={FLAGS.depth} --batch={FLAGS.batch} --micro_batches={FLAGS.micro_batches} "
          f"--steps={FLAGS.steps} --repeats={FLAGS.repeats}")
    micro = FLAGS.batch // FLAGS.micro_batches
    with tempfile.TemporaryDirectory() as tmp:
        prof_path, topo_path = os.path.join(tmp, "mlp.json"), os.path.join(tmp, "topo.json")
        run([venv_bin("dapple"), "profile", "--model=benchmarks.predicted_vs_measured:build",
             f"--model_args={json.dumps(model_args())}", f"--batch_size={micro}",
             f"--output={prof_path}", "--runs=20", "--warmup=3"])
        run(horovodrun([venv_bin("dapple"), "topology", "--measure", f"--output={topo_path}"]))
        profile, topology = load_profile(prof_path), parse_topology(topo_path)
        boundary = micro * FLAGS.width * 4          # bytes of one micro-batch's activations
        transfer_ms = dapple_transfer_ms(boundary)
        link = (f"link between the ranks (measured): {1e3 * topology.intra_host_latency:.3f} ms "
                f"latency, {topology.intra_host_bandwidth / 1e9:.2f} GB/s; dapple's own "
                f"transfer of {boundary} bytes: {transfer_ms:.3f} ms (benchmarks/transfer_cost.py)")
        # The same prediction with every transfer costing what dapple's transfer measured.
        runtime_link = dataclasses.replace(topology, intra_host_latency=transfer_ms / 1e3,
                                           intra_host_bandwidth=float("inf"))
        with_runtime_link, rendezvous, horovod = {}, {}, {}
        predicted, paths = {}, {}
        for name, plan in plans(profile.num_layers).items():
            costs = pipeline_costs(plan, profile, topology)
            predicted[name] = simulate_plan(plan, costs).iteration_ms
            with_runtime_link[name] = simulate_plan(plan, pipeline_costs(
                plan, profile, runtime_link)).iteration_ms
            # Horovod's alltoall is a collective: a transfer starts when both ranks entered it.
            rendezvous[name] = simulate_plan(plan, costs, rendezvous=True).iteration_ms
            # ... and one background thread per rank performs its collectives one at a time:
            # what the planner simulates for a plan made with --transfers=horovod.
            horovod[name] = simulate_plan(dataclasses.replace(plan, transfers="horovod"),
                                          costs).iteration_ms
            paths[name] = os.path.join(tmp, f"{name}.json")
            plan.save(paths[name])
        measured = {name: [] for name in SCHEDULES}
        loads = []
        for _ in range(FLAGS.repeats):
            for name in SCHEDULES:
                loads.append(os.getloadavg()[0])
                measured[name].append(measure_step(paths[name]))
        med = {name: statistics.median(v) for name, v in measured.items()}
    fused, split = split_against_fused()
    print(f"\nMLP {FLAGS.depth} x Dense({FLAGS.width}), global batch {FLAGS.batch}, "
          f"M = {FLAGS.micro_batches}, 2 ranks (horovodrun), 1 intra-op thread each; "
          f"load average {min(loads):.1f}..{max(loads):.1f}")
    print(link)
    print(f"{'schedule':<13}{'predicted ms':>14}{'measured ms':>13}{'pred / 1f1b':>13}"
          f"{'meas / 1f1b':>13}{'meas / pred':>13}")
    for name in SCHEDULES:
        print(f"{name:<13}{predicted[name]:>14.1f}{med[name]:>13.1f}"
              f"{predicted[name] / predicted['1f1b']:>13.3f}{med[name] / med['1f1b']:>13.3f}"
              f"{med[name] / predicted[name]:>13.3f}")
    for how, prediction in (("", predicted),
                            (" with dapple's transfer cost as the link", with_runtime_link),
                            (" with rendezvous transfers (a transfer waits for its receive)",
                             rendezvous),
                            (" with Horovod's transfers (rendezvous, one at a time per rank)",
                             horovod)):
        for name in SCHEDULES[1:]:
            p, m = prediction[name] / prediction["1f1b"], med[name] / med["1f1b"]
            print(f"{name}, predicted{how}: ratio to 1f1b {p:.3f} ({prediction[name]:.1f} / "
                  f"{prediction['1f1b']:.1f} ms), measured {m:.3f}, gap {m / p - 1:+.1%} "
                  f"(target within 15%)")
    print("per round (ms): " + "; ".join(f"{n} " + ", ".join(f"{t:.0f}" for t in measured[n])
                                          for n in SCHEDULES))
    print(f"whole-model forward + backward, one micro-batch, one thread: fused {fused:.2f} ms, "
          f"split I + W {split:.2f} ms, split / fused {split / fused:.3f}")


if __name__ == "__main__":
    app.run(main)
