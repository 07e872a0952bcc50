"""Keras 3 models on the relaxed schedules (#30): PipeDream, PipeDream-2BW and AvgPipe train by
their rules, as Keras 2 models do (tests/dapple/test_relaxed_schedules.py, the twin). The
references are the rules written out on the plain Keras 3 model with plain SGD
(`tests/relaxed_rules.py`, from the papers, no dapple code); each case also lands far from
synchronous training on the same data, so the comparison can fail.
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest

from dapple.pipelined_model import PipelinedModel
from planner.formats.plan import straight_plan
from tests import keras3_models
from tests.keras3_models import keras, loss_fn
from tests import relaxed_rules as rules


B, M, LR, STEPS = 16, 4, 0.5, 5
TOLERANCE = 1e-5
FAR = 1e-3
LAYERS = ["d1", "d2", "add", "d3", "out"]


def mlp_with_skip(seed=3):
    return keras3_models.mlp_with_skip(seed)


def data(rows, seed=1):
    return keras3_models.data(rows, seed)


def make_plan(schedule, cuts, replicas, settings=None):
    plan = straight_plan(cuts, len(LAYERS), M, B, replicas=replicas, schedule=schedule)
    for key, value in (settings or {}).items():
        setattr(plan, key, value)
    plan.validate()
    return plan


def expected(schedule, cuts, replicas, settings, x, y):
    """(the rule's weights, synchronous training's) on the plain Keras 3 model."""
    N = replicas[0] if schedule == "avgpipe" else 1
    batches = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(STEPS * N)]
    if schedule == "avgpipe":
        steps = [batches[t * N:(t + 1) * N] for t in range(STEPS)]
        want, _ = rules.avgpipe(mlp_with_skip(), loss_fn(), steps, LR)
        return want, rules.data_parallel(mlp_with_skip(), loss_fn(), steps, LR)
    sync = rules.synchronous(mlp_with_skip(), loss_fn(), batches, LR)
    if schedule == "2bw":
        return rules.two_bw(mlp_with_skip(), loss_fn(), batches, LR), sync
    mb = B // M
    minibatches = [(x[j * mb:(j + 1) * mb], y[j * mb:(j + 1) * mb]) for j in range(STEPS * M)]
    bounds = [0] + list(cuts) + [len(LAYERS)]
    plain, S = mlp_with_skip(), len(replicas)
    stage_of = rules.stage_of_variables(plain, [LAYERS[a:b] for a, b in zip(bounds, bounds[1:])])
    return rules.pipedream(plain, loss_fn(), minibatches, LR, stage_of,
                           [S - s for s in range(S)], (settings or {}).get("vertical_sync",
                                                                           False)), sync


CASES = [
    # (id, schedule, cuts, replicas, plan settings, runs (global batches per train_step))
    ("2bw-2", "2bw", [2], [1, 1], {}, [2, 3]),
    pytest.param(("2bw-2:1", "2bw", [2], [2, 1], {}, [1, 4]), marks=pytest.mark.slow),
    ("pipedream-3", "pipedream", [1, 3], [1, 1, 1], {}, [1, 1, 3]),
    pytest.param(("pipedream-3-vsync", "pipedream", [1, 3], [1, 1, 1], {"vertical_sync": True},
                  [3, 2]), marks=pytest.mark.slow),
    ("pipedream-1:2-recompute", "pipedream", [3], [1, 2], {"recompute": True}, [2, 3]),
    ("avgpipe-2x2", "avgpipe", [2], [2, 2], {}, [2, 3]),
]


@pytest.mark.parametrize("case", CASES, ids=[(c.values[0] if hasattr(c, "values") else c)[0]
                                             for c in CASES])
def test_keras3_weights_follow_the_rule(case, loop=None):
    """Relaxed plans loop only when asked (`pipeline_loop=True`)."""
    name, schedule, cuts, replicas, settings, runs = case
    N = replicas[0] if schedule == "avgpipe" else 1
    x, y = data(STEPS * N * B)
    pm = PipelinedModel(mlp_with_skip(), make_plan(schedule, cuts, replicas, settings),
                        pipeline_loop=loop)
    pm.compile(keras.optimizers.SGD(LR), loss_fn())
    lo = 0
    for k in runs:                     # the rule must not depend on where runs start and end
        rows = k * N * B
        assert np.isfinite(float(pm.train_step(x[lo:lo + rows], y[lo:lo + rows])))
        lo += rows
    assert (pm.training_step.schedule_loops > 0) == bool(loop)
    got = [v.numpy() for v in pm.model.trainable_variables]
    want, sync = expected(schedule, cuts, replicas, settings, x, y)
    assert rules.max_difference(got, want) < TOLERANCE
    assert rules.max_difference(got, sync) > FAR
    assert rules.max_difference(want, sync) > FAR


def test_keras3_optimizers_update_inside_a_loop():
    """PipeDream looped (`pipeline_loop=True`): Keras 3's optimizers step inside the
    `tf.while_loop`'s body."""
    test_keras3_weights_follow_the_rule(("pipedream-3", "pipedream", [1, 3], [1, 1, 1], {},
                                         [1, 1, 3]), loop=True)


def test_keras3_train_step_runs_apply_the_rule_with_steps_per_execution():
    """5 global batches in train_step runs of steps_per_execution=2 (the last one shorter),
    with a compiled metric: 2BW's rule."""
    x, y = data(STEPS * B)
    pm = PipelinedModel(mlp_with_skip(), make_plan("2bw", [2], [1, 1]))
    pm.compile(keras.optimizers.SGD(LR), loss_fn(), metrics=["accuracy"],
               steps_per_execution=2)
    for start in range(0, STEPS, 2):
        rows = slice(start * B, min(start + 2, STEPS) * B)
        pm.train_step(x[rows], y[rows])
    want, _ = expected("2bw", [2], [1, 1], {}, x, y)
    got = [v.numpy() for v in pm.model.trainable_variables]
    assert rules.max_difference(got, want) < TOLERANCE


@pytest.mark.parametrize("schedule, replicas", [("2bw", [1, 1]), ("avgpipe", [2, 2])])
def test_keras3_fit_applies_the_rule_with_steps_per_execution(schedule, replicas):
    """Keras 3's own fit, one run a Keras step: 5 steps in runs of steps_per_execution=2 (the
    last one shorter; AvgPipe: N=2 global batches a step, and one batch more, which does not
    make a step, skipped), with a compiled metric and validation data: the rule's weights,
    far from synchronous training, and Keras 3's History keys, a step per run."""
    N = replicas[0] if schedule == "avgpipe" else 1
    x, y = data(STEPS * N * B + (B if N > 1 else 0))
    pm = PipelinedModel(mlp_with_skip(), make_plan(schedule, [2], replicas))
    pm.compile(keras.optimizers.SGD(LR), loss_fn(), metrics=["accuracy"],
               steps_per_execution=2)
    batches = []
    history = pm.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                     validation_data=data(B, seed=2), callbacks=[keras.callbacks.LambdaCallback(
                         on_train_batch_end=lambda batch, logs: batches.append(batch))])
    want, sync = expected(schedule, [2], replicas, {}, x, y)
    got = [v.numpy() for v in pm.model.trainable_variables]
    assert rules.max_difference(got, want) < TOLERANCE
    assert rules.max_difference(got, sync) > FAR
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert batches == [0, 1, 2]                 # runs of 2, 2 and 1 steps


def test_keras3_relaxed_refusals_name_the_reason():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8, name="d1")(x))
    bn_model = keras.Model(x, keras.layers.Dense(5, name="out")(h), name="k3_bn")
    pm = PipelinedModel(bn_model, straight_plan([2], 3, M, B, schedule="2bw"))
    with pytest.raises(ValueError, match="does not train BatchNormalization yet.*'bn'"):
        pm.compile(keras.optimizers.SGD(LR), loss_fn())
    pm = PipelinedModel(mlp_with_skip(), make_plan("pipedream", [2], [1, 1]))
    with pytest.raises(ValueError, match="global norm"):
        pm.compile(keras.optimizers.SGD(0.1, global_clipnorm=1.0), loss_fn())
