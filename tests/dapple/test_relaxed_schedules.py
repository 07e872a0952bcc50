"""The relaxed schedules train by their rules: PipeDream, PipeDream-2BW and AvgPipe.

Each case trains the pipelined model for 5 steps with plain SGD (no momentum), M = 4, on 2- and
3-stage plans, and compares every weight with the schedule's rule computed on the plain,
unpipelined Keras model (`tests/relaxed_rules.py`, written from the papers, no dapple code)
within 1e-5; and with synchronous training on the same data, from which it must differ by
far more (so the comparison can fail). The 5 steps are cut into runs of different lengths
(train_step over several global batches, fit with steps_per_execution), because the rule must
not depend on where runs start and end. Each case runs looped (the lists' periodic parts as
`tf.while_loop`s, `graph_rewrite.schedule_loop`) and unrolled.
"""
import collections

import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from planner.formats.plan import straight_plan
from tests import relaxed_rules as rules
from tests.models import data_for, losses_for, mlp_with_skip, small_conv

B, M, LR, STEPS = 16, 4, 0.5, 5
TOLERANCE = 1e-5
FAR = 1e-3           # how far from synchronous training a relaxed rule must land
LAYERS = ["d1", "d2", "add", "d3", "out"]


def regularized(seed=0):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,), name="x")
    h = tf.keras.layers.Dense(12, activation="tanh", name="d1",
                              kernel_regularizer=tf.keras.regularizers.L2(0.05))(x)
    h = tf.keras.layers.Dense(12, activation="relu", name="d2")(h)
    h = tf.keras.layers.Dense(10, activation="tanh", name="d3",
                              bias_regularizer=tf.keras.regularizers.L1(0.02))(h)
    out = tf.keras.layers.Dense(5, name="out")(h)
    return tf.keras.Model(x, out, name="regularized")


CASES = [
    # (id, schedule, cuts, replicas, plan settings, runs (global batches per train_step))
    ("2bw-2", "2bw", [2], [1, 1], {}, [2, 3]),
    ("2bw-3", "2bw", [1, 3], [1, 1, 1], {}, [5]),
    ("2bw-2:1", "2bw", [2], [2, 1], {}, [1, 4]),
    ("pipedream-2", "pipedream", [2], [1, 1], {}, [2, 3]),
    ("pipedream-3", "pipedream", [1, 3], [1, 1, 1], {}, [1, 1, 3]),
    ("pipedream-3-vsync", "pipedream", [1, 3], [1, 1, 1], {"vertical_sync": True}, [3, 2]),
    ("pipedream-1:2-recompute", "pipedream", [3], [1, 2], {"recompute": True}, [2, 3]),
    ("avgpipe-2x2", "avgpipe", [2], [2, 2], {}, [2, 3]),
    ("avgpipe-2x3-advance", "avgpipe", [1, 3], [2, 2, 2], {"advance": 1}, [5]),
]


def make_plan(schedule, cuts, replicas, settings, layers=5):
    plan = straight_plan(cuts, layers, M, B, replicas=replicas, schedule=schedule)
    for key, value in settings.items():
        setattr(plan, key, value)
    plan.validate()
    return plan


def stage_layers(cuts):
    bounds = [0] + list(cuts) + [len(LAYERS)]
    return [LAYERS[a:b] for a, b in zip(bounds, bounds[1:])]


def expected(schedule, cuts, replicas, settings, x, y, builder=mlp_with_skip):
    """(the rule's weights, synchronous training's) on the plain model."""
    plain, loss = builder(seed=3), losses_for(builder())
    N = replicas[0] if schedule == "avgpipe" else 1
    batches = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(STEPS * N)]
    if schedule == "avgpipe":
        steps = [batches[t * N:(t + 1) * N] for t in range(STEPS)]
        want, _ = rules.avgpipe(plain, loss, steps, LR)
        return want, rules.data_parallel(builder(seed=3), loss, steps, LR)
    sync = rules.synchronous(builder(seed=3), loss, batches, LR)
    if schedule == "2bw":
        return rules.two_bw(plain, loss, batches, LR), sync
    mb = B // M
    minibatches = [(x[j * mb:(j + 1) * mb], y[j * mb:(j + 1) * mb]) for j in range(STEPS * M)]
    S = len(replicas)
    want = rules.pipedream(plain, loss, minibatches, LR,
                           rules.stage_of_variables(plain, stage_layers(cuts)),
                           [S - s for s in range(S)], settings.get("vertical_sync", False))
    return want, sync


def train(pm, x, y, runs, N):
    lo = 0
    for k in runs:
        rows = k * N * B
        loss = pm.train_step(x[lo:lo + rows], y[lo:lo + rows])
        assert np.isfinite(float(loss))
        lo += rows
    return [v.numpy() for v in pm.model.trainable_variables]


# The cases whose runs loop (asked): PipeDream's updates inside the body, 2BW's between loops.
# Not:
# 2BW on 3 stages (its positions' lists have different numbers of periodic runs between the
# updates), vertical sync (every forward moves weights), recomputation, AvgPipe (its pipelines'
# weights take turns in a stage's variables).
LOOPED = {"2bw-2", "2bw-2:1", "pipedream-2", "pipedream-3"}


@pytest.mark.parametrize("loop", [True, False], ids=["looped", "unrolled"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_weights_follow_the_rule(case, loop):
    name, schedule, cuts, replicas, settings, runs = case
    N = replicas[0] if schedule == "avgpipe" else 1
    x, y = data_for(mlp_with_skip(), STEPS * N * B, seed=1)
    pm = PipelinedModel(mlp_with_skip(seed=3), make_plan(schedule, cuts, replicas, settings),
                        pipeline_loop=loop)
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
    got = train(pm, x, y, runs, N)
    assert (pm.training_step.schedule_loops > 0) == (loop and name in LOOPED)
    want, sync = expected(schedule, cuts, replicas, settings, x, y)
    assert rules.max_difference(got, want) < TOLERANCE
    assert rules.max_difference(got, sync) > FAR
    assert rules.max_difference(want, sync) > FAR


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_a_relaxed_steps_calls_do_not_grow_with_the_micro_batches(schedule):
    """Looped, the traced run holds one loop and as many function calls at M = 4 as at
    M = 16; unrolled, the calls grow with M (so the count can see a step that does not loop)."""
    def calls(m, loop):
        plan = straight_plan([2], 5, m, 4 * m, replicas=[1, 1], schedule=schedule)
        pm = PipelinedModel(mlp_with_skip(seed=3), plan, pipeline_loop=loop)
        pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
        x, y = data_for(mlp_with_skip(), 4 * m, seed=1)
        pm.train_step(x, y)         # builds the optimizers the run's updates use
        fn = tf.function(lambda x, y: pm.training_step.run(x, y).loss)
        ops = collections.Counter(
            n.op for n in fn.get_concrete_function(x, y).graph.as_graph_def().node)
        return ops["StatefulPartitionedCall"] + ops["PartitionedCall"], ops["While"]

    (calls4, loops4), (calls16, loops16) = calls(4, True), calls(16, True)
    assert loops4 == loops16 == 1
    assert calls4 == calls16
    (unrolled4, none4), (unrolled16, none16) = calls(4, False), calls(16, False)
    assert none4 == none16 == 0
    assert unrolled16 > unrolled4


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_relaxed_plans_loop_only_when_asked(schedule):
    """`pipeline_loop` left to the runtime (which loops synchronous pipelines in one process):
    a relaxed plan runs unrolled, its looped steady step being slower (docs/runtime.md)."""
    x, y = data_for(mlp_with_skip(), 2 * B, seed=1)
    pm = PipelinedModel(mlp_with_skip(seed=3), make_plan(schedule, [2], [1, 1], {}))
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
    pm.train_step(x, y)
    assert pm.pipeline_step.pipeline_loop and pm.training_step.schedule_loops == 0


def test_a_looped_pipedream_run_reads_each_update_every_time():
    """A loop's iterations overlap; each forward must still read the weights the update
    before it made. Before every split in such a loop stayed a call, an inlined forward read
    them early in about 1 run in 3 (3 stages, a run of 3 batches): here 5 fresh traces must
    all give the unrolled step's weights exactly."""
    x, y = data_for(mlp_with_skip(), 3 * B, seed=1)
    plan = make_plan("pipedream", [1, 3], [1, 1, 1], {})

    def trained(loop):
        pm = PipelinedModel(mlp_with_skip(seed=3), plan, pipeline_loop=loop)
        pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
        pm.train_step(x, y)
        assert (pm.training_step.schedule_loops > 0) == loop
        return [v.numpy() for v in pm.model.trainable_variables]

    want = trained(False)
    for _ in range(5):
        assert rules.max_difference(trained(True), want) < TOLERANCE


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_weight_penalties_count_once_per_update(schedule):
    """PipeDream's minibatch (a micro-batch) and 2BW's global batch each add the penalties
    once, like Keras's compiled loss on a batch of that size."""
    steps = 3
    x, y = data_for(regularized(), steps * B, seed=4)
    pm = PipelinedModel(regularized(seed=3), make_plan(schedule, [2], [1, 1], {}, layers=4))
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
    got = train(pm, x, y, [1, 2], 1)
    plain, loss = regularized(seed=3), losses_for(regularized())
    if schedule == "2bw":
        want = rules.two_bw(plain, loss, [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
                                          for i in range(steps)], LR)
    else:
        mb = B // M
        want = rules.pipedream(plain, loss, [(x[j * mb:(j + 1) * mb], y[j * mb:(j + 1) * mb])
                                             for j in range(steps * M)], LR,
                               rules.stage_of_variables(plain, [["d1", "d2"], ["d3", "out"]]),
                               [2, 1])
    assert rules.max_difference(got, want) < TOLERANCE


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_fit_applies_the_rule_whatever_steps_per_execution(steps_per_execution):
    """fit with runs of 1 or 2 global batches (the last one shorter) over 5 batches: 2BW's
    rule, as one run of 5 gives."""
    x, y = data_for(mlp_with_skip(), STEPS * B, seed=1)
    plan = make_plan("2bw", [2], [1, 1], {})
    pm = PipelinedModel(mlp_with_skip(seed=3), plan)
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model), metrics=["accuracy"],
               steps_per_execution=steps_per_execution)
    history = pm.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    want, _ = expected("2bw", [2], [1, 1], {}, x, y)
    got = [v.numpy() for v in pm.model.trainable_variables]
    assert rules.max_difference(got, want) < TOLERANCE
    assert set(history.history) == {"loss", "accuracy"}


def test_fit_validation_split_and_freq_on_a_relaxed_schedule():
    """tf_keras's own fit on 2BW: validation_split holds out the last rows before training, as
    Keras does; validation_freq=2 evaluates at the second epoch only, with the weights the
    rule reached over both epochs' 4 + 4 global batches."""
    x, y = data_for(mlp_with_skip(), 5 * B, seed=1)
    pm = PipelinedModel(mlp_with_skip(seed=3), make_plan("2bw", [2], [1, 1], {}))
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
    history = pm.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                     validation_split=0.2, validation_freq=2)
    plain, loss = mlp_with_skip(seed=3), losses_for(mlp_with_skip())
    batches = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(4)]
    want = rules.two_bw(plain, loss, batches * 2, LR)
    got = [v.numpy() for v in pm.model.trainable_variables]
    assert rules.max_difference(got, want) < TOLERANCE
    reference = mlp_with_skip(seed=3)
    for variable, value in zip(reference.trainable_variables, want):
        variable.assign(value)
    val_loss = float(loss(y[4 * B:], reference(x[4 * B:])))
    assert len(history.history["loss"]) == 2
    assert len(history.history["val_loss"]) == 1
    assert abs(history.history["val_loss"][0] - val_loss) < 1e-5


def test_avgpipe_fit_gives_each_pipeline_its_own_batch():
    """fit over 5 steps of 2 pipelines (10 global batches) with steps_per_execution=2, and an
    11th batch that makes no whole step (skipped): the rule's reference z."""
    N = 2
    x, y = data_for(mlp_with_skip(), (STEPS * N + 1) * B, seed=1)
    plan = make_plan("avgpipe", [2], [N, N], {})
    pm = PipelinedModel(mlp_with_skip(seed=3), plan)
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model), steps_per_execution=2)
    pm.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    want, _ = expected("avgpipe", [2], [N, N], {}, x, y)
    got = [v.numpy() for v in pm.model.trainable_variables]
    assert rules.max_difference(got, want) < TOLERANCE


def test_evaluate_and_predict_use_the_latest_weights():
    x, y = data_for(mlp_with_skip(), 2 * B, seed=1)
    pm = PipelinedModel(mlp_with_skip(seed=3), make_plan("2bw", [2], [1, 1], {}))
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
    pm.train_step(x, y)
    plain = mlp_with_skip(seed=5)
    plain.set_weights(pm.model.get_weights())
    np.testing.assert_allclose(pm.predict(x[:B]), plain(x[:B]).numpy(), atol=1e-5)
    want = float(losses_for(plain)(y[:B], plain(x[:B])))
    assert abs(pm.evaluate(x[:B], y[:B]) - want) < 1e-5


def test_load_weights_starts_the_rule_afresh(tmp_path):
    """After load_weights, 2BW's first batch reads the loaded weights, not an older version."""
    x, y = data_for(mlp_with_skip(), 3 * B, seed=2)
    pm = PipelinedModel(mlp_with_skip(seed=3), make_plan("2bw", [2], [1, 1], {}))
    pm.compile(tf.keras.optimizers.SGD(LR), losses_for(pm.model))
    path = str(tmp_path / "w.h5")
    mlp_with_skip(seed=8).save_weights(path)
    pm.train_step(x[:B], y[:B])
    pm.load_weights(path)
    pm.train_step(x[B:], y[B:])
    plain = mlp_with_skip(seed=8)
    want = rules.two_bw(plain, losses_for(plain), [(x[B:2 * B], y[B:2 * B]),
                                                   (x[2 * B:], y[2 * B:])], LR)
    assert rules.max_difference([v.numpy() for v in pm.model.trainable_variables],
                                want) < TOLERANCE


# ---- refusals -----------------------------------------------------------------------------------

def test_refusals_name_the_reason():
    from tests.models import dense_batchnorm
    plan = make_plan("2bw", [2], [1, 1], {})
    pm = PipelinedModel(dense_batchnorm(), straight_plan([2], 4, M, B, schedule="2bw"))
    with pytest.raises(ValueError, match="does not train BatchNormalization"):
        pm.compile("sgd", losses_for(pm.model))
    pm = PipelinedModel(mlp_with_skip(), plan)
    with pytest.raises(ValueError, match="global norm"):
        pm.compile(tf.keras.optimizers.SGD(0.1, global_clipnorm=1.0), losses_for(pm.model))
    with pytest.raises(ValueError, match="steps_per_execution must be a positive integer"):
        pm.compile("sgd", losses_for(pm.model), steps_per_execution=0)
    pm.compile("sgd", losses_for(pm.model))
    with pytest.raises(ValueError, match="whole steps of 16 rows"):
        pm.train_step(*data_for(pm.model, 24, seed=0))
    sync = PipelinedModel(mlp_with_skip(), straight_plan([2], 5, M, B))
    with pytest.raises(ValueError, match="steps_per_execution applies to the relaxed"):
        sync.compile("sgd", losses_for(sync.model), steps_per_execution=4)


def test_conv_model_two_bw():
    """A convolutional stage: 2BW's rule."""
    x, y = data_for(small_conv(), 3 * B, seed=6)
    plan = straight_plan([2], 5, M, B, schedule="2bw")
    pm = PipelinedModel(small_conv(seed=3), plan)
    pm.compile(tf.keras.optimizers.SGD(0.2), losses_for(pm.model))
    got = train(pm, x, y, [3], 1)
    plain = small_conv(seed=3)
    want = rules.two_bw(plain, losses_for(plain), [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
                                                   for i in range(3)], 0.2)
    assert rules.max_difference(got, want) < TOLERANCE
