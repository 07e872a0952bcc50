"""`dapple verify`: does a plan compute the plain model's gradients for *your* model?

    dapple verify --plan=plan.json --model=mypackage.models:build [--batch_size=64]

Builds the model, feeds one global batch of random data of its input shapes (integers for int
inputs), and compares the pipelined gradients (`PipelinedModel.gradients`) with the plain
model's (`tf.GradientTape`) under a mean squared error against random targets. Prints the
largest absolute difference; exits 1 when it is above `--tolerance` (default 1e-5).

Batch-dependent layers (BatchNormalization in training mode) see micro-batch statistics in a
pipeline, as in GPipe and DAPPLE, so such models differ by design when micro_batches > 1 or a
stage is replicated; the command says so when it finds them.
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


def main(argv):
    del argv
    import dapple  # noqa: F401  (devices before TensorFlow initializes)
    import numpy as np
    import tensorflow as tf

    from dapple.pipelined_model import PipelinedModel
    from dapple.user_model import build_model, random_inputs, random_targets
    from planner.plan import Plan, PlanError

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
        pm = PipelinedModel(model, plan)
    except (OSError, ValueError, PlanError) as e:
        return fail(str(e))

    loss = tf.keras.losses.MeanSquaredError()
    pm.compile(tf.keras.optimizers.SGD(0.0), loss=loss)
    x = random_inputs(model, batch, seed=FLAGS.seed)
    y = random_targets(model, batch, seed=FLAGS.seed + 1)
    try:
        pipelined = pm.gradients(x, y)
    except ValueError as e:
        return fail(str(e))
    with tf.GradientTape() as tape:
        preds = tf.nest.flatten(model(x, training=True))
        total = tf.add_n([loss(t, p) for t, p in zip(tf.nest.flatten(y), preds)])
    plain = tape.gradient(total, model.trainable_variables)

    worst, worst_name, scale = 0.0, None, 0.0
    for g, w, v in zip(pipelined, plain, model.trainable_variables):
        g = np.zeros(v.shape, "float32") if g is None else np.asarray(g)
        w = np.zeros(v.shape, "float32") if w is None else np.asarray(w)
        diff = float(np.max(np.abs(g - w))) if g.size else 0.0
        scale = max(scale, float(np.max(np.abs(w))) if w.size else 0.0)
        if diff >= worst:
            worst, worst_name = diff, v.name
    print(f"plan: {plan.num_stages} stage(s) {plan.shape()}, {plan.micro_batches} micro-batch(es), "
          f"schedule {plan.schedule}, global batch {batch}; model {model.name!r} with "
          f"{len(model.trainable_variables)} trainable variables")
    print(f"largest gradient difference: {worst:.3e} (in {worst_name}; largest gradient "
          f"{scale:.3e}); tolerance {FLAGS.tolerance:.1e}")
    if worst <= FLAGS.tolerance:
        print("OK: the pipelined gradients equal the plain model's")
        return 0
    batch_dependent = [l.name for l in model.layers
                       if isinstance(l, tf.keras.layers.BatchNormalization)]
    print("FAILED: the pipelined gradients differ from the plain model's", file=sys.stderr)
    if batch_dependent:
        print(f"note: {len(batch_dependent)} BatchNormalization layer(s) (e.g. "
              f"{batch_dependent[0]!r}) normalize each micro-batch on its own, so this model is "
              f"not micro-batch transparent by design", file=sys.stderr)
    return 1
