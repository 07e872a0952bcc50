"""A unit's gradient sums over its micro-batches (`graph_rewrite.pipeline.Accumulator`): added in
place into variables of the unit's own, which a loop adds to as well. References: the plain
Keras model's gradients of the same batch (no pipeline), and the traced step's own ops."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from planner.formats.plan import straight_plan

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def dense_mlp(seed=0):
    """4 Dense layers and no other arithmetic, so every add in the step is an accumulation."""
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,))
    h = x
    for width in (16, 16, 12):
        h = tf.keras.layers.Dense(width, activation="tanh")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(4)(h))


def pipelined(schedule="1f1b", loop=False, m=4):
    pm = dapple.PipelinedModel(dense_mlp(), straight_plan([2], 4, m, 8 * m, schedule=schedule),
                               micro_batch_loop=loop)
    pm.compile(optimizer="sgd", loss=LOSS)
    return pm


def plain_gradients(x, y):
    model = dense_mlp()
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def data(rows, seed):
    rng = np.random.RandomState(seed)
    return rng.randn(rows, 6).astype("float32"), rng.randint(0, 4, rows).astype("int32")


@pytest.mark.parametrize("schedule,loop", [("1f1b", False), ("1f1b", True), ("zb-h1", False),
                                           ("gpipe", True)],
                         ids=["1f1b-unrolled", "1f1b-looped", "zb-h1", "gpipe-looped"])
def test_gradient_sums_equal_the_plain_models_step_after_step(schedule, loop):
    # Two steps on other data: the second must not start from the first one's sums.
    pm = pipelined(schedule, loop)
    for seed in (1, 2):
        x, y = data(32, seed)
        got = pm.gradients(x, y)
        for a, b in zip(got, plain_gradients(x, y)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_unrolled_step_adds_its_gradients_in_place():
    pm = pipelined()
    x, y = data(32, 0)
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    library = fn.get_concrete_function(x, y).graph.as_graph_def().library.function
    ops = [n.op for f in library for n in f.node_def]
    # 8 variables, 2 stages: from the third micro-batch on, each adds every one of its
    # stage's in place; the second's add sets the sums (its result assigned, not returned).
    assert ops.count("AssignAddVariableOp") >= 8
    for f in library:
        adds = {n.name for n in f.node_def if n.op == "AddV2"}
        assigned = {i.split(":")[0] for n in f.node_def if n.op == "AssignVariableOp"
                    for i in n.input}
        assert adds <= assigned, f.signature.name
