"""Plain Horovod: every rank allreduces once per step; rank `--fail_rank` raises in step 2.

Used to check what the job does when one rank fails (no dapple involved)."""
import argparse

import horovod.tensorflow as hvd
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--fail_rank", type=int, default=1)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

hvd.init()


@tf.function
def step(x):
    return hvd.allreduce(x, op=hvd.Sum, name="grad")


for i in range(args.steps):
    if hvd.rank() == args.fail_rank and i == 2:
        raise RuntimeError(f"injected failure on rank {hvd.rank()} in step {i}")
    print(f"rank {hvd.rank()} step {i} sum {float(step(tf.constant([1.0]))[0])}", flush=True)
