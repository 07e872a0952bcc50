"""The chief of a TensorFlow-cluster job for the fault tests: a 2-stage pipeline of the test
MLP trained step after step, printing `step N done` after each.

--mode=ok     3 steps, then exits 0.
--mode=fail   raises in step 2 (exit status 1).
--mode=loop   trains until ended (the test interrupts the launcher or kills a server).
"""
import argparse
import os

import dapple
import numpy as np
import tensorflow as tf

from planner.formats.plan import straight_plan
from tests import models

parser = argparse.ArgumentParser()
parser.add_argument("--mode", default="ok")
parser.add_argument("--replicas", default="1,1", help="of the plan's two stages")
args = parser.parse_args()

model = models.mlp_with_skip(seed=3)
plan = straight_plan([2], 5, 4, 24, replicas=[int(r) for r in args.replicas.split(",")])
pm = dapple.PipelinedModel(model, plan)
pm.compile(optimizer=tf.keras.optimizers.SGD(0.01),
           loss=models.losses_for(model))
print(f"chief pid {os.getpid()}", flush=True)
step = 0
while args.mode == "loop" or step < 3:
    if args.mode == "fail" and step == 2:
        raise RuntimeError("injected failure in step 2")
    x, y = models.data_for(model, 24, seed=step)
    pm.train_step(x, y)
    print(f"step {step} done", flush=True)
    step += 1
