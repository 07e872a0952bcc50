"""`dapple profile`: measure a Keras model's per-layer profile (native JSON) for the planner.

    dapple profile --model=examples.vgg19:build --model_args='{"image_size": 32}' \
        --batch_size=8 --output=vgg19.profile.json

The model is `builder(**model_args)`; it is fed random data of its input shapes (see
`dapple.user_model`). Times are for the local default device; the batch is the profile's batch
(the planner scales times and activation bytes linearly to other batches).
"""
from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "module:builder returning a tf.keras.Model")
flags.DEFINE_string("model_args", None, "JSON object of keyword arguments for the builder")
flags.DEFINE_integer("batch_size", 8, "batch the layers are measured at")
flags.DEFINE_string("output", None, "write the profile JSON here (default: print it)")
flags.DEFINE_string("name", None, "profile name (default: the model's name)")
flags.DEFINE_integer("warmup", 2, "unmeasured runs per layer before timing")
flags.DEFINE_integer("runs", 5, "measured runs per layer; the median is kept")


def main(argv):
    del argv
    import json

    import dapple  # noqa: F401  (devices before TensorFlow initializes)
    from dapple.profiler import measure_profile
    from dapple.user_model import build_model, random_inputs

    if not FLAGS.model:
        print("dapple profile: --model=module:builder is required", file=sys.stderr)
        return 2
    if FLAGS.batch_size < 1:
        print(f"dapple profile: --batch_size must be >= 1, got {FLAGS.batch_size}",
              file=sys.stderr)
        return 2
    try:
        model = build_model(FLAGS.model, FLAGS.model_args)
    except ValueError as e:
        print(f"dapple profile: {e}", file=sys.stderr)
        return 2
    x = random_inputs(model, FLAGS.batch_size)
    prof = measure_profile(model, x, name=FLAGS.name, warmup=FLAGS.warmup, runs=FLAGS.runs)
    if FLAGS.output:
        prof.save(FLAGS.output)
        print(f"wrote {FLAGS.output}: {prof.num_layers} layers, batch {prof.batch_size:g}, "
              f"forward {prof.forward_ms(0, prof.num_layers - 1):.2f} ms, backward "
              f"{prof.backward_ms(0, prof.num_layers - 1):.2f} ms")
    else:
        print(json.dumps(prof.to_dict(), indent=1))
    return 0
