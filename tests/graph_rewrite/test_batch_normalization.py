"""BatchNormalization in a pipeline: each slice normalizes with its own statistics (as in GPipe
and DAPPLE), and the moving statistics move once per step from the whole global batch, exactly
as plain Keras `fit` moves them (the reference here: the plain model's own `train_on_batch`).
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.batch_statistics import UnsupportedLayerError
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests.models import (assert_ran_as_loops, conv_batchnorm, dense_batchnorm,
                          ghost_batch_loss_and_grads)

BATCH = 16
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batches(model, steps, seed=0):
    rng = np.random.RandomState(seed)
    for _ in range(steps):
        # an offset and a scale, so that mean and variance both move visibly
        x = (rng.randn(BATCH, *model.input.shape[1:]) * 2.0 + 1.5).astype("float32")
        yield x, rng.randint(0, 3, BATCH).astype("int32")


def moving_statistics(model):
    return {v.name: v.numpy() for v in model.non_trainable_variables}


def train_both(builder, cuts, replicas, micro_batches, schedule="A", recompute=False,
               steps=2, lr=0.0, loop=False):
    model, reference = builder(), builder()
    plan = straight_plan(cuts, len(layer_order(model)), micro_batches, BATCH,
                         replicas=replicas, schedule=schedule)
    plan.recompute = recompute
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=loop)
    pm.compile(optimizer=tf.keras.optimizers.SGD(lr), loss=LOSS)
    reference.compile(optimizer=tf.keras.optimizers.SGD(lr), loss=LOSS)
    for x, y in batches(model, steps):
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
    assert_ran_as_loops(pm, loop)
    return model, reference


CASES = [
    # (builder, cuts, replicas, M, schedule, recompute)
    (dense_batchnorm, [2], [2, 1], 4, "A", False),        # the 2:1, M = 4
    (conv_batchnorm, [3], [2, 1], 4, "A", False),         # BN on both sides of the cut
    (conv_batchnorm, [4], [1, 2], 2, "B", True),          # split, recomputed
    (conv_batchnorm, [], [4], 2, "gpipe", False),         # data parallel
    (conv_batchnorm, [], [2], 4, "A", False),             # data parallel, 1F1B
    (conv_batchnorm, [], [2], 4, "A", False, True),       # the same, lanes as loops
    (dense_batchnorm, [1, 3], [1, 1, 1], 8, "A", False),  # BN alone in a stage
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].__name__}-{c[2]}-M{c[3]}-{c[4]}"
                         + ("-rc" if c[5] else "") + ("-loop" if c[6:] else ""))
def test_moving_statistics_equal_plain_fit(case):
    builder, cuts, replicas, m, schedule, recompute, *loop = case
    model, reference = train_both(builder, cuts, replicas, m, schedule, recompute,
                                  loop=bool(loop))
    got, want = moving_statistics(model), moving_statistics(reference)
    initial = moving_statistics(builder())
    assert sorted(got) == sorted(want) and got
    for name in want:
        assert np.max(np.abs(want[name] - initial[name])) > 1e-2, f"{name} did not move"
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_frozen_batch_normalization_keeps_its_statistics():
    model, reference = dense_batchnorm(), dense_batchnorm()
    model.get_layer("bn").trainable = False
    before = moving_statistics(model)
    plan = straight_plan([2], 4, 4, BATCH, replicas=[2, 1])
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss=LOSS)
    for x, y in batches(model, 2):
        pm.train_step(x, y)
    for name, value in before.items():
        np.testing.assert_array_equal(moving_statistics(model)[name], value)


def test_a_layer_called_twice_updates_twice_like_keras():
    def shared_bn(seed=0):
        tf.keras.utils.set_random_seed(seed)
        x = tf.keras.Input((4,))
        bn = tf.keras.layers.BatchNormalization(momentum=0.7, name="bn")
        a = bn(x)                                         # first call: stage 0
        for i in range(3):
            a = tf.keras.layers.Dense(4, name=f"a{i}")(a)
        h = tf.keras.layers.Dense(4, name="d1")(x)
        b = bn(h)                                         # second call: after the cut
        h = tf.keras.layers.Concatenate(name="cat")([a, b])
        return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))
    assert [l.name for l in layer_order(shared_bn())][:3] == ["bn", "a0", "d1"]
    model, reference = train_both(shared_bn, [2], [1, 2], 2)
    for name, want in moving_statistics(reference).items():
        np.testing.assert_allclose(moving_statistics(model)[name], want, atol=1e-5, rtol=1e-5)
    # Across processes the two stages' updates could not be ordered: refused by name there.
    from dapple.runtime.horovod.transport import check_shared_across_processes
    from graph_rewrite.model_graph import cut_model
    with pytest.raises(UnsupportedLayerError, match="'bn'.*stages 0 and 1"):
        check_shared_across_processes(cut_model(model, [(0, 1), (2, 6)]))
    check_shared_across_processes(cut_model(model, [(0, 6)]))       # one stage: fine


@pytest.mark.parametrize("builder,replicas", [(dense_batchnorm, [2, 1]), (conv_batchnorm, [1, 1])])
def test_gradients_equal_the_plain_model_run_slice_by_slice(builder, replicas):
    """Normalization per slice: the plain model run on the plan's slices (ghost batches) is
    the reference for the gradients; every BN of these plans lies in stages of one slice size."""
    model, reference = builder(), builder()
    m = 4
    plan = straight_plan([2], len(layer_order(model)), m, BATCH, replicas=replicas)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer="sgd", loss=LOSS)
    x, y = next(batches(model, 1))
    got = pm.gradients(x, y)
    slice_rows = BATCH // (m * replicas[0])
    _, want = ghost_batch_loss_and_grads(reference, LOSS, x, y, slice_rows)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
    assert diff < 1e-5
    _, whole = ghost_batch_loss_and_grads(reference, LOSS, x, y, BATCH)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, whole)) > 1e-4   # not vacuous


@pytest.mark.parametrize("option", [dict(renorm=True), dict(virtual_batch_size=2)])
def test_batch_normalization_options_that_cannot_be_pipelined_are_named(option):
    x = tf.keras.Input((4,))
    h = tf.keras.layers.BatchNormalization(name="odd_bn", **option)(x)
    model = tf.keras.Model(x, tf.keras.layers.Dense(2)(h))
    with pytest.raises(UnsupportedLayerError, match="odd_bn"):
        dapple.PipelinedModel(model, straight_plan([1], 2, 2, 8))


def _waits_for(op):
    """Every op `op` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        node = todo.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "loops"])
def test_forwards_on_different_devices_are_not_ordered_by_the_moving_statistics(loop):
    # Keras updates a BatchNormalization layer's moving statistics inside every training call;
    # had the calls written the layer's own variables, TensorFlow would order every call after
    # the previous one, whatever its device (the replicas then ran one after another).
    model = conv_batchnorm()
    plan = straight_plan([], len(layer_order(model)), 2, BATCH, replicas=[2])
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=loop)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    x, y = next(batches(model, 1))
    pm.train_step(x, y)
    assert_ran_as_loops(pm, loop)
    graph = pm.train_function.get_concrete_function(x, y, None).graph
    calls = [op for op in graph.get_operations()
             if op.type == "StatefulPartitionedCall" and op.name.startswith("stage0/replica")]
    on = {op: op.name.split("/")[1] for op in calls}
    assert set(on.values()) == {"replica0", "replica1"}
    for op in calls:
        waited = [other.name for other in _waits_for(op) if on.get(other, on[op]) != on[op]]
        assert not waited, f"{op.name} waits for {waited}"


def test_a_call_fixed_to_inference_reads_the_layers_own_statistics():
    # A call the model fixes to training=False normalizes with the layer's moving statistics,
    # which must stay the layer's own (not the scratch pair Keras's updates are sent to).
    def fixed_bn(seed=0):
        tf.keras.utils.set_random_seed(seed)
        x = tf.keras.Input((4,))
        h = tf.keras.layers.BatchNormalization(name="fixed", moving_mean_initializer="ones",
                                               moving_variance_initializer=tf.constant_initializer(
                                                   4.0))(x, training=False)
        h = tf.keras.layers.BatchNormalization(name="bn")(tf.keras.layers.Dense(4)(h))
        return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))
    model, reference = train_both(fixed_bn, [], [1], 1, lr=0.1)
    for got, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=1e-5)
