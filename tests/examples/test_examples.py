"""Every example runs end to end at its tiny size: profile -> plan -> a few training steps.

The BERT example with a 2-stage pipeline is in the default run (seconds); the others, and the
planner's own choice for each, are `slow`. ResNet-50's BatchNormalization is not micro-batch
transparent, so no test here compares its gradients (see examples/resnet50.py).
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples.run import even_straight_plan, run
from graph_rewrite.model_graph import layer_order
from tests.paths import REPO as ROOT


def check_run(result, steps, stages=None):
    model, prof, plan, history = (result[k] for k in ("model", "profile", "plan", "history"))
    assert [l.name for l in prof.layers] == [l.name for l in layer_order(model)]
    assert plan.num_layers == prof.num_layers
    if stages is not None:
        assert plan.num_stages == stages
    assert history.params["steps"] == steps
    assert math.isfinite(history.history["loss"][0])


def test_bert_tiny_two_stage_pipeline_trains_and_matches_plain_gradients():
    result = run("bert", devices=2, steps=2, planner="straight", micro_batches=2,
                 profile_runs=1, verbose=0)
    check_run(result, steps=2, stages=2)
    # The example model is micro-batch transparent: its pipelined gradients are the plain ones.
    from dapple.pipelined_model import PipelinedModel
    from dapple.user_model import random_inputs
    model = result["model"]
    x = random_inputs(model, 8, seed=5)
    y = np.arange(8) % 4
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)   # the example's Keras
    pm = PipelinedModel(model, result["plan"])
    pm.compile("sgd", loss)
    with tf.GradientTape() as tape:
        total = loss(y, model(x, training=True))
    for g, w in zip(pm.gradients(x, y), tape.gradient(total, model.trainable_variables)):
        np.testing.assert_allclose(g, tf.convert_to_tensor(w), rtol=1e-4, atol=1e-5)


def test_even_straight_plan_cuts_where_time_splits_evenly():
    from planner.formats.profile import Layer, Profile
    layers = [Layer(f"l{i}", "Dense", t, t, 1.0, 1.0, (i - 1,)) for i, t in
              enumerate([1.0, 1.0, 1.0, 1.0, 4.0, 4.0])]
    prof = Profile(name="p", batch_size=4, layers=layers)
    plan = even_straight_plan(prof, 2, 2, 4)        # total 12: first half is l0..l4 (8 >= 6)
    assert [s.layers for s in plan.stages] == [[0, 4], [5, 5]]
    plan = even_straight_plan(prof, 3, 2, 4)        # shares 4 and 8: cut after l3, after l4
    assert [s.layers for s in plan.stages] == [[0, 3], [4, 4], [5, 5]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vgg19", "resnet50", "bert", "gnmt"])
def test_example_with_the_dapple_planner(name):
    check_run(run(name, devices=2, steps=2, profile_runs=1, verbose=0), steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vgg19", "resnet50", "gnmt"])
def test_example_as_a_two_stage_pipeline(name):
    check_run(run(name, devices=2, steps=2, planner="straight", profile_runs=1, verbose=0),
              steps=2, stages=2)


@pytest.mark.slow
def test_example_command_line(tmp_path):
    plan = str(tmp_path / "plan.json")
    proc = subprocess.run([sys.executable, "-m", "examples.gnmt", "--size=tiny", "--devices=2",
                           "--steps=2", "--profile_runs=1", "--planner=straight",
                           f"--plan_output={plan}"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan: straight" in proc.stdout and "trained 2 steps" in proc.stdout
    assert os.path.exists(plan)
