"""`dapple verify`: does a plan compute the plain model's gradients for *your* model?

    dapple verify --plan=plan.json --model=mypackage.models:build [--batch_size=64]

Builds the model, feeds one global batch of random data of its input shapes (integers for int
inputs), and compares the pipelined gradients (`PipelinedModel.gradients`) with the plain
model's (`tf.GradientTape`) under a mean squared error against random targets. Prints the
largest absolute difference; exits 1 when it is above `--tolerance` (default 1e-5).

BatchNormalization in training mode normalizes each micro-batch slice on its own in a pipeline,
as in GPipe and DAPPLE. For such models the reference is the plain model run slice by slice
("ghost batches" of the plan's slice size, each slice's loss weighted by its share), and the
command says so; it can do that when every stage with such layers has the same slice size.
Layers that draw random numbers in training (Dropout and its kin) draw other masks in every run,
so by default (`--random_layers=inference`) they run as in inference (rate 0) on both sides and
the command says so; `--random_layers=train` keeps them drawing, and names them if that fails.

With `--timing` it then holds the cost model to measurement (`dapple.timing`): it prints the
plan's step time predicted by the formula (`planner.estimate.cost_model.evaluate`), simulated
(`planner.estimate.simulator`) and measured (median `train_step`), and per-stage forward/backward
times, predicted against measured with each stage's unit timed alone:

    dapple profile --model=m:build --batch_size=64 --output=m.profile.json
    dapple verify --plan=plan.json --model=m:build --timing --profile=m.profile.json

The topology predicted on is `topology.local_topology(devices of the plan)`, or `--topology`
(the one the plan was made for, e.g. GPUs: `1x8,mem=16GB`). Each device computes with
`--intra_op_threads` threads (default 1: logical CPU devices share the process's thread pools,
so one thread each is what lets two devices use two cores); profile with the same setting
(`TF_NUM_INTRAOP_THREADS=1 dapple profile ...`), the command warns when the profile says
otherwise. Without `--profile` the model is profiled here at the plan's micro-batch slice.
"""
from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("plan", None, "plan JSON file")
flags.DEFINE_string("model", None, "module:builder returning a tf.keras.Model")
flags.DEFINE_string("model_args", None, "JSON object of keyword arguments for the builder")
flags.DEFINE_integer("batch_size", None, "global batch (default: the plan's global_batch_size)")
flags.DEFINE_float("tolerance", 1e-5, "largest allowed absolute gradient difference")
flags.DEFINE_integer("seed", 0, "seed of the random data")
flags.DEFINE_enum("random_layers", "inference", ["inference", "train"],
                  "layers that draw random numbers (Dropout): 'inference' runs them at rate 0 on "
                  "both sides, so their masks cannot differ; 'train' keeps them drawing")
flags.DEFINE_bool("timing", False, "also print predicted, simulated and measured step times")
flags.DEFINE_string("profile", None, "with --timing: the model's profile (dapple profile JSON); "
                    "default: profile here")
flags.DEFINE_string("topology", None, "with --timing: the topology to predict on (preset, spec "
                    "or JSON, as dapple plan takes; default: local_topology of the plan's devices)")
flags.DEFINE_integer("timing_warmup", 3, "with --timing: unmeasured runs before each timing")
flags.DEFINE_integer("timing_runs", 10, "with --timing: measured runs (the median is kept)")
flags.DEFINE_integer("intra_op_threads", 1, "with --timing: TensorFlow intra-op threads "
                     "(0: TensorFlow's default)")


def main(argv):
    del argv
    import dapple  # noqa: F401  (devices before TensorFlow initializes)
    import numpy as np
    import tensorflow as tf

    if FLAGS.timing and FLAGS.intra_op_threads > 0:
        _set_intra_op_threads(tf, FLAGS.intra_op_threads)

    from dapple.pipelined_model import PipelinedModel
    from dapple.user_model import build_model, random_inputs, random_targets
    from planner.formats.plan import Plan, PlanError
    from graph_rewrite.keras_adapter import keras_module_of

    def fail(message):
        print(f"dapple verify: {message}", file=sys.stderr)
        return 2

    if not FLAGS.plan or not FLAGS.model:
        return fail("--plan and --model=module:builder are required")
    try:
        plan = Plan.load(FLAGS.plan)
        model = build_model(FLAGS.model, FLAGS.model_args)
        batch = FLAGS.batch_size or plan.global_batch_size
        if batch is None:
            return fail("the plan has no global_batch_size: pass --batch_size")
        if plan.global_batch_size is not None and batch != plan.global_batch_size:
            return fail(f"--batch_size={batch} differs from the plan's global_batch_size "
                        f"{plan.global_batch_size}")
        if FLAGS.random_layers == "inference":
            quiet = _random_layers_at_rate_zero(model)
            if quiet:
                print(f"random layers: {len(quiet)} layer(s) that draw random numbers in training "
                      f"(e.g. {quiet[0]!r}) run at rate 0 on both sides "
                      f"(--random_layers=train keeps them)")
        pm = PipelinedModel(model, plan)
    except (OSError, ValueError, PlanError) as e:
        return fail(str(e))

    api = keras_module_of(model)               # the model's own Keras, whatever tf.keras is
    loss = api.losses.MeanSquaredError()
    pm.compile(api.optimizers.SGD(0.0), loss=loss)
    x = random_inputs(model, batch, seed=FLAGS.seed)
    y = random_targets(model, batch, seed=FLAGS.seed + 1)
    try:
        pipelined = pm.gradients(x, y)
    except ValueError as e:
        return fail(str(e))
    slice_rows, why = _reference_slices(pm, batch)
    if slice_rows is None:
        print(f"dapple verify: {why}", file=sys.stderr)
        return 1
    if slice_rows < batch:
        print(f"reference: the plain model run on {batch // slice_rows} slices of {slice_rows} "
              f"rows (ghost batches), since {why}")
    plain = _plain_gradients(model, loss, x, y, batch, slice_rows)

    worst, worst_name, scale = 0.0, None, 0.0
    for g, w, v in zip(pipelined, plain, model.trainable_variables):
        g = np.zeros(v.shape, "float32") if g is None else np.asarray(g)
        w = np.zeros(v.shape, "float32") if w is None else np.asarray(w)
        diff = float(np.max(np.abs(g - w))) if g.size else 0.0
        scale = max(scale, float(np.max(np.abs(w))) if w.size else 0.0)
        if diff >= worst:
            worst, worst_name = diff, getattr(v, "path", None) or v.name    # Keras 3: a path
    print(f"plan: {plan.num_stages} stage(s) {plan.shape()}, {plan.micro_batches} micro-batch(es), "
          f"schedule {plan.schedule}, global batch {batch}; model {model.name!r} with "
          f"{len(model.trainable_variables)} trainable variables")
    print(f"largest gradient difference: {worst:.3e} (in {worst_name}; largest gradient "
          f"{scale:.3e}); tolerance {FLAGS.tolerance:.1e}")
    if worst <= FLAGS.tolerance:
        print("OK: the pipelined gradients equal the plain model's")
        return _timing(pm, model, plan, x, y, batch) if FLAGS.timing else 0
    print("FAILED: the pipelined gradients differ from the plain model's", file=sys.stderr)
    from graph_rewrite.model_graph import draws_random_numbers
    random = [l.name for l in model._flatten_layers(include_self=False)   # either Keras
              if draws_random_numbers(l)]
    if random:
        print(f"note: {len(random)} layer(s) draw random numbers in training (e.g. "
              f"{random[0]!r}): their masks differ between any two runs, so gradients differ "
              f"by design; --random_layers=inference checks the rest", file=sys.stderr)
    return 1


def _random_layers_at_rate_zero(model) -> list:
    """Sets every random layer's rate to 0 (this command built the model for itself); returns
    their names."""
    from graph_rewrite.model_graph import draws_random_numbers

    names = []
    for layer in model._flatten_layers(include_self=False):    # either Keras
        if draws_random_numbers(layer):
            layer.rate = 0.0
            names.append(layer.name)
    return names


def _reference_slices(pm, batch):
    """(rows per reference slice, why) for the plain reference: the whole batch, or the plan's
    slice size when BatchNormalization layers normalize per slice; (None, why) when their stages
    have different slice sizes, which no plain run reproduces."""
    from graph_rewrite.batch_statistics import updates_in_training
    from graph_rewrite.keras_adapter import layer_of

    plan = pm.plan
    sizes, example = {}, None
    for graph, stage in zip(pm.pipeline_step.stages, plan.stages):
        for node in graph.nodes:
            if updates_in_training(layer_of(node), {"training": True}):
                sizes.setdefault(batch // (plan.micro_batches * stage.replicas), graph.index)
                example = example or layer_of(node).name
    if not sizes or (len(sizes) == 1 and batch in sizes):
        return batch, ""
    if len(sizes) > 1:
        return None, (f"BatchNormalization layers (e.g. {example!r}) normalize slices of "
                      f"{sorted(sizes)} rows in different stages, which no plain run of the "
                      f"model reproduces; verify a plan whose stages with such layers have equal "
                      f"replica counts")
    rows = next(iter(sizes))
    return rows, (f"BatchNormalization layers (e.g. {example!r}) normalize each slice of "
                  f"{rows} rows on its own in this plan")


def _plain_gradients(model, loss, x, y, batch, slice_rows):
    """The plain model's gradients on consecutive slices of `slice_rows` rows (the whole batch
    when equal), each slice's loss weighted by its share; training state left as it was."""
    import numpy as np
    import tensorflow as tf

    state = [v.numpy() for v in model.non_trainable_variables]
    grads = None
    for lo in range(0, batch, slice_rows):
        part = lambda a: a[lo:lo + slice_rows]
        xs, ys = tf.nest.map_structure(part, x), tf.nest.map_structure(part, y)
        with tf.GradientTape() as tape:
            preds = tf.nest.flatten(model(xs, training=True))
            total = tf.add_n([loss(t, p) for t, p in zip(tf.nest.flatten(ys), preds)])
            total = total * (slice_rows / batch)
        g = [None if t is None else tf.convert_to_tensor(t)
             for t in tape.gradient(total, model.trainable_variables)]
        grads = g if grads is None else [a if b is None else (b if a is None else a + b)
                                         for a, b in zip(grads, g)]
    for v, value in zip(model.non_trainable_variables, state):
        v.assign(value)
    return [None if g is None else np.asarray(g) for g in grads]


def _set_intra_op_threads(tf, threads: int) -> None:
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:
        current = tf.config.threading.get_intra_op_parallelism_threads()
        if current != threads:
            print(f"dapple verify: warning: TensorFlow is already initialized with {current} "
                  f"intra-op threads; set TF_NUM_INTRAOP_THREADS={threads} to time with "
                  f"{threads}", file=sys.stderr)


def _timing(pm, model, plan, x, y, batch) -> int:
    """Predicted, simulated and measured step times of `plan` (see the module docstring)."""
    import tensorflow as tf

    from dapple.timing import format_report, measure_plan, timing_report
    from planner.formats.profile import ProfileError
    from planner.formats.profile_readers import load_profile
    from topology import TopologyError, local_topology, parse_topology

    threads = tf.config.threading.get_intra_op_parallelism_threads()
    if FLAGS.profile:
        try:
            profile = load_profile(FLAGS.profile)
        except (OSError, ProfileError) as e:
            print(f"dapple verify: --profile: {e}", file=sys.stderr)
            return 2
        from graph_rewrite.model_graph import model_signature
        if profile.model_signature and profile.model_signature != model_signature(model):
            print(f"dapple verify: --profile={FLAGS.profile} was measured on another model "
                  f"(its model signature differs from {model.name!r}'s): profile this model "
                  f"with `dapple profile --model={FLAGS.model}`", file=sys.stderr)
            return 2
        device = getattr(profile, "device", None) or ""
        if device and f"({threads or 'default'} intra-op" not in device:
            print(f"dapple verify: warning: the profile was measured on {device!r}, this run "
                  f"uses {threads or 'default'} intra-op threads: predictions may not apply",
                  file=sys.stderr)
    else:
        from dapple.profiler import profile as profile_model
        from dapple.user_model import random_inputs
        rows = batch // plan.micro_batches // max(s.replicas for s in plan.stages)
        print(f"profiling the model at batch {rows} (pass --profile to use a `dapple profile` "
              f"result)")
        profile = profile_model(model, random_inputs(model, rows, seed=FLAGS.seed))
    devices = max(d for s in plan.stages for d in s.devices) + 1
    try:
        topo = parse_topology(FLAGS.topology) if FLAGS.topology else local_topology(devices)
    except TopologyError as e:
        print(f"dapple verify: --topology: {e}", file=sys.stderr)
        return 2
    measured = measure_plan(pm, x, y, warmup=FLAGS.timing_warmup, runs=FLAGS.timing_runs)
    report = timing_report(plan, profile, topo, measured)
    where = FLAGS.topology or f"local_topology({devices})"
    print(f"timing on {where} with {threads or 'default'} intra-op threads, "
          f"median of {FLAGS.timing_runs} runs after {FLAGS.timing_warmup} warm-up; profile "
          f"{profile.name!r} at batch {profile.batch_size:g}")
    print(format_report(report))
    return 0
