"""Start-up cost and steady step time of the pipelined training step, working tree vs a baseline.

    python benchmarks/startup.py [--baseline_rev=ae11530] [--replicas=4]
        [--micro_batches=1,2,4,8] [--rows_per_unit=2] [--steps=5] [--repeats=1] [--threads=0]
        [--current_unrolled]
    python benchmarks/startup.py --pipeline [--schedules=1f1b] [--model=mobilenetv2]
        [--micro_batches=2,16] [--rows_per_unit=2] [--steps=5] [--ab_steps=10] [--repeats=1]

The case of issue #12: Keras ResNet50 (weights=None, 32x32x3 inputs, 10 classes) under a
data-parallel plan (1 stage, R replicas on R logical CPU devices), M micro-batches, global batch
rows_per_unit x R x M, SGD and sparse categorical crossentropy. For each implementation and M:
first call = wall time of the first `train_step` (tracing, graph optimization, first run, up to
`.numpy()`); steady = median of `--steps` later steps (ms); graph nodes = nodes of the traced
step function and its library functions.

"current" is the tree this script lies in, with its defaults (a data-parallel plan's lanes run
as loops from M = 2), or with `--current_unrolled` its step unrolled (`PipelinedModel(...,
micro_batch_loop=False)`: `--baseline_rev=HEAD --current_unrolled` compares the two ways of the
same tree); "baseline" is `--baseline_rev`, checked out into a
temporary `git worktree` (removed at the end); empty skips it. Every measurement runs in a fresh
subprocess (this script with `--worker`) so no tracing cache carries over; the two
implementations alternate config by config so machine noise hits both alike, `--repeats` times
(median kept). Prints the command, a table (a failed worker prints its error in its row), and
the issue's targets: first-call(R x max M) / first-call(R x 1) <= 1.5 for current, steady
current / baseline <= 1.05 per config. Wall-clock timings on a shared machine: read the ratios.

`--pipeline`, the case of issue #28: `--model` (Keras MobileNetV2 or ResNet50, weights=None,
32x32x3, 10 classes, or an MLP of 16 Dense(64)) cut in two at the layer nearest the middle where one tensor crosses, one
stage per logical CPU device, for each of `--schedules` (interleaved: cut in four chunks, two per
device, chunk c on device c % 2); global batch rows_per_unit x M. Each
(schedule, M) is measured in fresh processes, the tree's default (loops where the schedule
allows them) and unrolled (`micro_batch_loop=False`) alternating, first call in wall and CPU
seconds (the process's; on a shared machine the steadier of the two); then one process per
schedule and build order builds both at the largest M and times their steps alternately
(`--ab_steps` each, median wall and process CPU time; on a shared machine CPU time is the
steadier). Targets: looped first call at max M / min M <= 1.5; steady
loop / unrolled <= 1.05.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("baseline_rev", "", "git revision to compare against (empty: skip it)")
flags.DEFINE_integer("replicas", 4, "data-parallel replicas (= logical CPU devices)")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8"], "values of M")
flags.DEFINE_integer("rows_per_unit", 2, "rows per replica per micro-batch")
flags.DEFINE_integer("steps", 5, "timed steps after the first call (median kept)")
flags.DEFINE_integer("repeats", 1, "fresh processes per (implementation, M) (median kept)")
flags.DEFINE_integer("threads", 0, "TF_NUM_INTRAOP_THREADS for the workers (0: TF default)")
flags.DEFINE_integer("timeout", 1800, "seconds a worker may take")
flags.DEFINE_bool("current_unrolled", False,
                  "build current's lanes unrolled (micro_batch_loop=False)")
flags.DEFINE_bool("pipeline", False, "measure a 2-stage pipeline, looped vs unrolled")
flags.DEFINE_list("schedules", ["1f1b"], "--pipeline: the plans' schedules")
flags.DEFINE_enum("model", "mobilenetv2", ["mobilenetv2", "resnet50", "mlp"],
                  "--pipeline: the model (mlp: 16 x Dense(64) on the flattened image, many "
                  "small variables, so per-iteration costs of a loop show)")
flags.DEFINE_bool("inline_stage_calls", False, "--pipeline: PipelinedModel(..., "
                  "inline_stage_calls=True) (benchmarks/inline_stage_calls.py)")
flags.DEFINE_integer("ab_steps", 10, "--pipeline: steps of each in the in-process A/B")
flags.DEFINE_bool("ab", False, "internal: the worker runs the in-process A/B")
# Worker mode (internal): one measurement against the implementation in --impl_root.
flags.DEFINE_bool("worker", False, "internal: measure one config and print a RESULT line")
flags.DEFINE_string("impl_root", "", "internal: repository root whose dapple the worker uses")

RESULT = "RESULT "
HERE = os.path.dirname(os.path.abspath(__file__))
CURRENT_ROOT = os.path.dirname(HERE)


# ---- worker: runs in its own process, importing dapple from --impl_root -------------------
def graph_nodes(fn, *args) -> int:
    """Nodes of the traced function (outer graph + library functions); -1 if unavailable."""
    try:
        graph_def = fn.get_concrete_function(*args).graph.as_graph_def()
        return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    except Exception:  # private layout may differ between revisions: the size is optional
        return -1


def measure(root: str, M: int, unrolled: bool) -> dict:
    # The script's own folder is sys.path[0]; the implementation must win over it and over
    # the editable install, so it goes first, and we check where dapple came from.
    sys.path.insert(0, root)
    os.environ["DAPPLE_NUM_CPU_DEVICES"] = str(FLAGS.replicas)   # before TF initializes
    if importlib.util.find_spec("tf_keras") is not None:   # written for Keras 2:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras
    import dapple
    dapple_file = os.path.realpath(dapple.__file__)
    if not dapple_file.startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(f"dapple imported from {dapple_file}, not under {root}")
    import numpy as np
    import tensorflow as tf
    from dapple.pipelined_model import PipelinedModel
    from graph_rewrite.model_graph import layer_order
    from planner.formats.plan import straight_plan
    tf.get_logger().setLevel("ERROR")

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    batch = FLAGS.rows_per_unit * FLAGS.replicas * M
    plan = straight_plan([], len(layer_order(model)), M, batch, replicas=[FLAGS.replicas])
    pm = PipelinedModel(model, plan, micro_batch_loop=False) if unrolled else \
        PipelinedModel(model, plan)
    pm.compile(tf.keras.optimizers.SGD(0.01), tf.keras.losses.SparseCategoricalCrossentropy())
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(batch, 32, 32, 3).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=batch).astype("int32"))

    start = time.perf_counter()
    pm.train_step(x, y).numpy()
    first_call_s = time.perf_counter() - start
    return dict(first_call_s=first_call_s, steady_ms=steady_ms(pm, x, y),
                graph_nodes=graph_nodes(pm.train_function, x, y, None), dapple_file=dapple_file)


def steady_ms(pm, x, y) -> float:
    """Median of --steps timed train steps after the first call."""
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        pm.train_step(x, y).numpy()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def pipeline_model(schedule: str, M: int, unrolled: bool, inline_stage_calls=None):
    """(PipelinedModel, x, y): `--model` cut in two, `schedule`, M micro-batches."""
    os.environ["DAPPLE_NUM_CPU_DEVICES"] = "2"     # before TF initializes
    sys.path.insert(0, CURRENT_ROOT)
    import dapple  # noqa: F401
    import numpy as np
    import tensorflow as tf
    from dapple.pipelined_model import PipelinedModel
    from graph_rewrite.model_graph import cut_model, layer_order
    from planner.formats.plan import straight_plan
    from planner.search.chunking import interleaved_plan
    tf.get_logger().setLevel("ERROR")
    tf.keras.utils.set_random_seed(0)
    build = dict(mobilenetv2=tf.keras.applications.MobileNetV2,
                 resnet50=tf.keras.applications.ResNet50, mlp=small_mlp)[FLAGS.model]
    model = build(weights=None, input_shape=(32, 32, 3), classes=10)
    n = len(layer_order(model))
    chunks = 4 if schedule == "interleaved" else 2

    def single_crossing(c):     # one tensor crosses a cut before layer c
        return 0 < c < n and len(cut_model(model, [(0, c - 1), (c, n - 1)])[1].input_ids) == 1

    cuts = [next(c for d in range(n) for c in (k * n // chunks - d, k * n // chunks + d)
                 if single_crossing(c)) for k in range(1, chunks)]
    batch = FLAGS.rows_per_unit * M
    if schedule == "interleaved":
        plan = interleaved_plan(cuts, n, M, 2, batch)
    else:
        plan = straight_plan(cuts, n, M, batch, schedule=schedule)
    pm = PipelinedModel(model, plan, micro_batch_loop=not unrolled, pipeline_loop=not unrolled,
                        inline_stage_calls=inline_stage_calls)
    pm.compile(tf.keras.optimizers.SGD(0.01), tf.keras.losses.SparseCategoricalCrossentropy())
    rng = np.random.RandomState(0)
    x = tf.constant(rng.rand(batch, 32, 32, 3).astype("float32"))
    y = tf.constant(rng.randint(0, 10, size=batch).astype("int32"))
    return pm, x, y


def small_mlp(weights, input_shape, classes):
    import tensorflow as tf
    del weights
    x = tf.keras.Input(input_shape)
    h = tf.keras.layers.Flatten()(x)
    for _ in range(16):
        h = tf.keras.layers.Dense(64, activation="relu")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(classes, activation="softmax")(h))


def measure_pipeline(schedule: str, M: int, unrolled: bool, inline_stage_calls=None) -> dict:
    pm, x, y = pipeline_model(schedule, M, unrolled, inline_stage_calls)
    start, cpu = time.perf_counter(), time.process_time()
    pm.train_step(x, y).numpy()
    first_call_s = time.perf_counter() - start
    first_call_cpu_s = time.process_time() - cpu
    return dict(first_call_s=first_call_s, first_call_cpu_s=first_call_cpu_s,
                steady_ms=steady_ms(pm, x, y),
                looped=pm.training_step.schedule_loops > 0,
                graph_nodes=graph_nodes(pm.train_function, x, y, None))


def pipeline_ab(schedule: str, M: int, unrolled_first: bool) -> dict:
    """Looped and unrolled steps of one process, alternating: medians and their ratio. The
    order they are built in is an argument: which is built first has moved the ratio by a
    third here."""
    by_kind = {}
    for unrolled in ((True, False) if unrolled_first else (False, True)):   # built and traced
        pm, x, y = by_kind[unrolled] = pipeline_model(schedule, M, unrolled)
        pm.train_step(x, y).numpy()
        pm.train_step(x, y).numpy()
    built = [by_kind[False], by_kind[True]]
    times, cpu_times = [[], []], [[], []]
    for _ in range(FLAGS.ab_steps):
        for i, (pm, x, y) in enumerate(built):
            start, cpu = time.perf_counter(), time.process_time()
            pm.train_step(x, y).numpy()
            times[i].append(time.perf_counter() - start)
            cpu_times[i].append(time.process_time() - cpu)
    loop_ms, unrolled_ms = (1e3 * statistics.median(t) for t in times)
    loop_cpu_ms, unrolled_cpu_ms = (1e3 * statistics.median(t) for t in cpu_times)
    return dict(loop_ms=loop_ms, unrolled_ms=unrolled_ms, ratio=loop_ms / unrolled_ms,
                loop_cpu_ms=loop_cpu_ms, unrolled_cpu_ms=unrolled_cpu_ms,
                cpu_ratio=loop_cpu_ms / unrolled_cpu_ms)


def worker_main() -> None:
    try:
        if FLAGS.pipeline and FLAGS.ab:
            result = pipeline_ab(FLAGS.schedules[0], int(FLAGS.micro_batches[0]),
                                 FLAGS.current_unrolled)
        elif FLAGS.pipeline:
            result = measure_pipeline(FLAGS.schedules[0], int(FLAGS.micro_batches[0]),
                                      FLAGS.current_unrolled,
                                      inline_stage_calls=FLAGS.inline_stage_calls or None)
        else:
            result = measure(FLAGS.impl_root, int(FLAGS.micro_batches[0]),
                             FLAGS.current_unrolled)
    except Exception as e:  # the parent prints it in the table row
        result = dict(error=f"{type(e).__name__}: {e}".splitlines()[0][:200])
    print(RESULT + json.dumps(result), flush=True)


# ---- parent: worktree, alternating subprocesses, table ------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", CURRENT_ROOT, *args], check=True, text=True,
                          capture_output=True).stdout.strip()


def run_worker(root: str, M: int, unrolled: bool = False, extra=()) -> dict:
    env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
    if FLAGS.threads > 0:
        env["TF_NUM_INTRAOP_THREADS"] = str(FLAGS.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--impl_root={root}",
           f"--micro_batches={M}", f"--replicas={FLAGS.replicas}",
           f"--rows_per_unit={FLAGS.rows_per_unit}", f"--steps={FLAGS.steps}"] + \
        (["--current_unrolled"] if unrolled else []) + list(extra)
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, text=True, capture_output=True,
                              timeout=FLAGS.timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {FLAGS.timeout} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(error=f"exit {proc.returncode}: {last[:200]}")


def combine(runs: list) -> dict:
    """Median of the successful repeats; the first error if none succeeded."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    return dict(first_call_s=statistics.median(r["first_call_s"] for r in ok),
                steady_ms=statistics.median(r["steady_ms"] for r in ok),
                graph_nodes=ok[0]["graph_nodes"], dapple_file=ok[0]["dapple_file"])


def cell(result, key: str, fmt: str) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return "error"
    return "?" if result[key] < 0 else format(result[key], fmt)


def print_table(impls: list, Ms: list, results: dict) -> None:
    R = FLAGS.replicas
    base = "baseline" in impls
    cols = [("first call s", "first_call_s", ".2f"), ("steady ms", "steady_ms", ".1f"),
            ("graph nodes", "graph_nodes", "d")]
    head = f"{'R x M':<7}{'units':>6}"
    for title, _, _ in cols:
        head += "".join(f"{title + ' ' + i[:4]:>20}" for i in impls)
    print(head + (f"{'steady cur/base':>17}" if base else ""))
    for M in Ms:
        row = f"{f'{R}x{M}':<7}{R * M:>6}"
        for _, key, fmt in cols:
            row += "".join(f"{cell(results[i].get(M), key, fmt):>20}" for i in impls)
        if base:
            b, c = results["baseline"][M], results["current"][M]
            ratio = ("-" if "error" in b or "error" in c
                     else f"{c['steady_ms'] / b['steady_ms']:.3f}")
            row += f"{ratio:>17}"
        print(row)
    for i in impls:
        for M in Ms:
            if "error" in results[i][M]:
                print(f"{i} {R}x{M}: {results[i][M]['error']}")

    print()
    lo, hi = min(Ms), max(Ms)
    for i in impls:
        a, b = results[i][lo], results[i][hi]
        if "error" in a or "error" in b:
            continue
        ratio = b["first_call_s"] / a["first_call_s"]
        target = f" (target <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})" \
            if i == "current" else ""
        print(f"{i}: first call {R}x{hi} / {R}x{lo} = {ratio:.2f}{target}")
    if base:
        ratios = [results["current"][M]["steady_ms"] / results["baseline"][M]["steady_ms"]
                  for M in Ms if not any("error" in results[i][M] for i in impls)]
        if ratios:
            worst = max(ratios)
            print(f"steady current / baseline: worst {worst:.3f} (target <= 1.05: "
                  f"{'met' if worst <= 1.05 else 'NOT met'})")


def pipeline_main() -> None:
    """The `--pipeline` case: per schedule, first calls per M (fresh processes) and the A/B."""
    Ms = [int(m) for m in FLAGS.micro_batches]
    impls = ("loop", "unrolled")
    print(f"{FLAGS.model} 32x32x3 cut in two, 1 device per stage, global batch "
          f"{FLAGS.rows_per_unit} x M, {FLAGS.steps} steady steps, {FLAGS.repeats} repeat(s), "
          f"A/B {FLAGS.ab_steps} steps each, intra-op threads: {FLAGS.threads or 'TF default'}")
    for schedule in FLAGS.schedules:
        common = ["--pipeline", f"--schedules={schedule}", f"--model={FLAGS.model}"]
        runs = {i: {M: [] for M in Ms} for i in impls}
        for _ in range(FLAGS.repeats):
            for M in Ms:
                for impl in impls:
                    runs[impl][M].append(run_worker(CURRENT_ROOT, M, impl == "unrolled", common))
        results = {i: {M: combine_pipeline(runs[i][M]) for M in Ms} for i in impls}
        print(f"\nschedule {schedule}")
        columns = (("first call s", "first_call_s", ".2f"),
                   ("first call cpu s", "first_call_cpu_s", ".2f"),
                   ("steady ms", "steady_ms", ".1f"), ("graph nodes", "graph_nodes", "d"))
        print(f"{'M':>4}" + "".join(f"{t + ' ' + i:>26}" for t, _, _ in columns for i in impls)
              + f"{'looped':>8}")
        for M in Ms:
            row = f"{M:>4}"
            for _, key, fmt in columns:
                row += "".join(f"{cell(results[i][M], key, fmt):>26}" for i in impls)
            looped = results["loop"][M].get("looped")
            print(row + f"{'?' if looped is None else 'yes' if looped else 'no':>8}")
        for i in impls:
            for M in Ms:
                if "error" in results[i][M]:
                    print(f"{i} M={M}: {results[i][M]['error']}")
        lo, hi = results["loop"][min(Ms)], results["loop"][max(Ms)]
        if "error" not in lo and "error" not in hi:
            for what, key in (("wall", "first_call_s"), ("CPU", "first_call_cpu_s")):
                ratio = hi[key] / lo[key]
                print(f"{schedule}: first call ({what}) M={max(Ms)} / M={min(Ms)} = {ratio:.2f} "
                      f"(target <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
        for unrolled_first in (False, True):
            ab = run_worker(CURRENT_ROOT, max(Ms), unrolled_first,
                            common + ["--ab", f"--ab_steps={FLAGS.ab_steps}"])
            built = "unrolled" if unrolled_first else "loop"
            if "error" in ab:
                print(f"{schedule}: A/B at M={max(Ms)}: {ab['error']}")
                continue
            print(f"{schedule}: steady step at M={max(Ms)}, one process, alternating, {built} "
                  f"built first: loop {ab['loop_ms']:.1f} ms / unrolled {ab['unrolled_ms']:.1f} "
                  f"ms = {ab['ratio']:.3f} (target <= 1.05: "
                  f"{'met' if ab['ratio'] <= 1.05 else 'NOT met'}); CPU {ab['loop_cpu_ms']:.1f} / "
                  f"{ab['unrolled_cpu_ms']:.1f} ms = {ab['cpu_ratio']:.3f}", flush=True)


def combine_pipeline(runs: list) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    return dict(ok[0], **{k: statistics.median(r[k] for r in ok)
                          for k in ("first_call_s", "first_call_cpu_s", "steady_ms")})


def main(argv):
    del argv
    if FLAGS.worker:
        return worker_main()
    print("command: " + shlex.join(["python"] + sys.argv))
    if FLAGS.pipeline:
        print(f"tree: {CURRENT_ROOT} at {git('rev-parse', '--short', 'HEAD')}"
              + (" + working-tree changes" if git("status", "--porcelain") else ""))
        return pipeline_main()
    Ms = [int(m) for m in FLAGS.micro_batches]
    dirty = " + working-tree changes" if git("status", "--porcelain") else ""
    print(f"current: {CURRENT_ROOT} at {git('rev-parse', '--short', 'HEAD')}{dirty}")
    roots = {}
    worktree = None
    try:
        if FLAGS.baseline_rev:
            sha = git("rev-parse", "--short", FLAGS.baseline_rev + "^{commit}")
            worktree = tempfile.mkdtemp(prefix="dapple-baseline-")
            git("worktree", "add", "--detach", worktree, sha)
            roots["baseline"] = worktree
            print(f"baseline: {FLAGS.baseline_rev} = {sha}, worktree {worktree}")
        roots["current"] = CURRENT_ROOT
        if FLAGS.current_unrolled:
            print("current: lanes unrolled (micro_batch_loop=False)")
        runs = {i: {M: [] for M in Ms} for i in roots}
        for _ in range(FLAGS.repeats):
            for M in Ms:
                for impl, root in roots.items():   # baseline first, then current: alternating
                    start = time.perf_counter()
                    r = run_worker(root, M, FLAGS.current_unrolled and impl == "current")
                    runs[impl][M].append(r)
                    print(f"  {impl} {FLAGS.replicas}x{M}: "
                          f"{r.get('error') or 'ok'} ({time.perf_counter() - start:.0f} s)",
                          flush=True)
    finally:
        if worktree:
            subprocess.run(["git", "-C", CURRENT_ROOT, "worktree", "remove", "--force",
                            worktree], capture_output=True)
    results = {i: {M: combine(runs[i][M]) for M in Ms} for i in roots}
    for i in roots:
        files = {r["dapple_file"] for r in results[i].values() if "dapple_file" in r}
        print(f"{i} dapple: {', '.join(sorted(files)) or '(no successful run)'}")
    print(f"\nResNet50 32x32x3, 1 stage x {FLAGS.replicas} replicas, global batch "
          f"{FLAGS.rows_per_unit} x R x M, units = R x M, {FLAGS.steps} steady steps, "
          f"{FLAGS.repeats} repeat(s), intra-op threads: {FLAGS.threads or 'TF default'}")
    print_table(list(roots), Ms, results)


if __name__ == "__main__":
    app.run(main)
