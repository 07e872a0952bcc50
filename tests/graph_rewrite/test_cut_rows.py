"""A unit's rows of a tensor made elsewhere are cut beside it (`graph_rewrite.cut_rows`), so only
its rows move to the unit's device. Reference: the traced step's own graph, read back: no op
placed on a unit's device reads a whole fed tensor, for every way a step takes its rows
(unrolled actions, a data-parallel lane's loop, a pipeline's loop), and every cut of a boundary
runs where its tensor was made; the step's loss against the plain model's."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite import cut_rows
from planner.formats.plan import straight_plan

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed=0):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,))
    h = tf.keras.layers.Dense(8, activation="tanh")(x)
    h = tf.keras.layers.Dense(8, activation="tanh")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(4)(h))


@pytest.mark.parametrize("cuts, replicas, loop", [
    ([], [2], True), ([], [2], False), ([2], [1, 2], False), ([2], [2, 1], True)],
    ids=["dp-lanes-looped", "dp-unrolled", "1:2-unrolled", "2:1-looped"])
def test_no_unit_device_reads_a_whole_fed_tensor(cuts, replicas, loop):
    plan = straight_plan(cuts, 3, 2, 16, replicas=replicas)
    pm = dapple.PipelinedModel(mlp(), plan, micro_batch_loop=loop, pipeline_loop=loop)
    pm.compile(optimizer="sgd", loss=LOSS)
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 6).astype("float32"), rng.randint(0, 4, 16).astype("int32")
    w = np.ones(16, "float32")
    fn = tf.function(lambda x, y, w: pm.pipeline_step.run(x, y, sample_weight=w).loss)
    graph = fn.get_concrete_function(x, y, w).graph
    fed = [t.op for t in graph.inputs[:3]]          # x, y, w (captures follow them)
    readers = [c for op in fed for c in op.outputs[0].consumers()]
    assert readers
    unit_devices = {pm.pipeline_step.device(s, r) for s, R in enumerate(replicas)
                    for r in range(R)}
    assert len(unit_devices) == sum(replicas) > 1
    for op in readers:
        assert op.device not in unit_devices, (op.name, op.device)
        assert set(op.colocation_groups()) & {f"loc:@{p.name}".encode() for p in fed}, op.name
    # and the rows are still each unit's own: the step's loss is the plain model's
    plain = LOSS(y, mlp()(x, training=True), sample_weight=w)
    np.testing.assert_allclose(fn(x, y, w), plain, rtol=1e-5)


def test_rows_are_cut_waiting_for_nothing_and_moved_to_the_enclosing_device():
    @tf.function
    def f(x):
        with tf.device("/device:CPU:1"):
            first = tf.reduce_sum(x)
            with tf.control_dependencies([first]):
                return cut_rows.rows(x, 2, 4)

    graph = f.get_concrete_function(tf.TensorSpec([6, 3])).graph
    (moved,) = [op for op in graph.get_operations() if op.type == "Identity"
                and op.inputs[0].op.type == "StridedSlice"]
    cut = moved.inputs[0].op
    assert cut.control_inputs == [] and not cut.device
    assert cut.colocation_groups() == [b"loc:@x"]
    assert moved.device == "/device:CPU:1" and moved.control_inputs
    np.testing.assert_array_equal(f(tf.reshape(tf.range(18.0), [6, 3])),
                                  np.arange(18.0).reshape(6, 3)[2:4])


def placed(op):
    """`op`'s device, or where the op it is colocated with is placed."""
    if op.device:
        return op.device
    (group,) = op.colocation_groups()
    name = group.decode()[len("loc:@"):]
    return "" if name == op.name else placed(op.graph.get_operation_by_name(name))


@pytest.mark.parametrize("replicas", [[1, 2], [2, 1], [2, 3]], ids=["1:2", "2:1", "2:3"])
def test_a_boundarys_rows_are_cut_where_the_sender_or_receiver_made_them(replicas):
    plan = straight_plan([2], 3, 2, 24, replicas=replicas)
    pm = dapple.PipelinedModel(mlp(), plan, micro_batch_loop=False, pipeline_loop=False)
    pm.compile(optimizer="sgd", loss=LOSS)
    rng = np.random.RandomState(0)
    x, y = rng.randn(24, 6).astype("float32"), rng.randint(0, 4, 24).astype("int32")
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).loss)
    graph = fn.get_concrete_function(x, y).graph
    # cuts of a stage function's outputs: activations going forward, gradients coming back
    boundary = [op for op in graph.get_operations() if op.type == "StridedSlice"
                and op.inputs[0].op.type in ("StatefulPartitionedCall", "PartitionedCall")]
    assert len(boundary) >= 2 * plan.micro_batches
    for op in boundary:
        made = placed(op.inputs[0].op)
        assert made and placed(op) == made, (op.name, placed(op), made)
    plain = LOSS(y, mlp()(x, training=True))
    np.testing.assert_allclose(fn(x, y), plain, rtol=1e-5)
