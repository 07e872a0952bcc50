"""Plain Horovod data parallelism's step time for a model: the baseline of gpu_first_run.sh.

    horovodrun -np N -H localhost:N python benchmarks/plain_dp_step.py \
        --model=examples.resnet50:build --model_args='{}' --global_batch_size=256 [--steps=20]

The same work as `dapple verify --timing` measures for a pipelined plan: every rank builds the
model (`--model=module:builder`, rank 0's weights broadcast), takes its 1/N share of one global
batch of `dapple.user_model`'s random inputs and targets (the rows verify feeds), and runs a
`tf.function` step: forward, mean squared error, `hvd.DistributedGradientTape` (the allreduce
averages the gradients), SGD apply. One GPU per rank (its local rank) when there are GPUs.
After `--warmup` steps every rank prints the slowest rank's median of `--steps` timed steps:

    DAPPLE_RESULT {"rank": r, "ranks": N, "rows_per_rank": ..., "step_ms": ...,
                   "first_local_loss": ..., "first_loss": ..., "device": "GPU" or "CPU"}

`first_local_loss` is the first step's loss on the rank's own rows, `first_loss` its average
over the ranks: the plain model's loss on the whole global batch
(tests/dapple/runtime/horovod/test_plain_dp_step.py holds both to the plain model's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="module:builder of a tf.keras model")
    parser.add_argument("--model_args", default=None, help="JSON keyword arguments")
    parser.add_argument("--global_batch_size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--learning_rate", type=float, default=0.0,
                        help="SGD's rate (0, as dapple verify --timing: the weights stay put)")
    args = parser.parse_args(argv)

    sys.path.insert(0, REPO)
    # dapple first (its package sets up Keras 2 and devices before TensorFlow initializes).
    from dapple.user_model import build_model, random_inputs, random_targets

    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    n = hvd.size()
    if args.global_batch_size % n:
        print(f"plain_dp_step: the global batch {args.global_batch_size} does not divide into "
              f"{n} ranks", file=sys.stderr)
        return 2
    rows = args.global_batch_size // n

    model = build_model(args.model, args.model_args)
    x = random_inputs(model, args.global_batch_size)
    y = random_targets(model, args.global_batch_size)
    mine = slice(hvd.rank() * rows, (hvd.rank() + 1) * rows)
    x, y = tf.nest.map_structure(lambda a: a[mine], (x, y))
    loss_fn = tf.keras.losses.MeanSquaredError()
    optimizer = tf.keras.optimizers.SGD(args.learning_rate)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.add_n([loss_fn(t, o) for t, o in zip(tf.nest.flatten(y),
                                                           tf.nest.flatten(out))])
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, hvd.allreduce(loss)   # this rank's, and averaged over the ranks

    first_local_loss, first_loss = (float(v) for v in step())
    for _ in range(max(args.warmup - 1, 0)):
        step()[0].numpy()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()[0].numpy()
        times.append((time.perf_counter() - start) * 1e3)
    step_ms = float(hvd.allreduce(tf.constant(statistics.median(times)), op=hvd.Max))
    print("DAPPLE_RESULT " + json.dumps({
        "rank": hvd.rank(), "ranks": n, "rows_per_rank": rows, "step_ms": round(step_ms, 3),
        "first_local_loss": first_local_loss, "first_loss": first_loss,
        "device": "GPU" if gpus else "CPU"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
