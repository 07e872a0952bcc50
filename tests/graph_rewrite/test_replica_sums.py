"""A stage's gradients summed onto every replica's device (`graph_rewrite.replica_sums`): the
sums against numpy's, the same on every replica bit for bit, for 1 to 5 replicas and mixed
dtypes; and what crosses devices, read back from the traced graph: two replicas exchange one
gradient's worth each, more move 2 (R - 1) / R of it into each device, where an exchange
would move R - 1 times it."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite import replica_sums

SHAPES = [(7, 5), (5,), (), (3, 2, 2), (1,)]


def devices(R):
    return {r: f"/device:CPU:{r}" for r in range(R)}


def gradients(R, dtypes=("float32",) * len(SHAPES), seed=0):
    rng = np.random.RandomState(seed)
    return {r: [np.asarray(rng.randn(*s)).astype(d) for s, d in zip(SHAPES, dtypes)]
            for r in range(R)}


def summed(arrays, R):
    out = {}
    for r in range(R):
        with tf.device(devices(R)[r]):
            out[r] = [tf.constant(a) for a in arrays[r]]
    return replica_sums.on_every_replica(out, devices(R), "test")


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtypes", [("float32",) * 5,
                                    ("float32", "float16", "float32", "float16", "float32")],
                         ids=["float32", "mixed"])
def test_every_replica_gets_the_sums(R, dtypes):
    arrays = gradients(R, dtypes)
    got = summed(arrays, R)
    assert sorted(got) == list(range(R))
    for i, dtype in enumerate(dtypes):
        want = np.sum([arrays[r][i].astype("float64") for r in range(R)], axis=0)
        for r in range(R):
            t = got[r][i]
            assert t.dtype == tf.as_dtype(dtype) and tuple(t.shape) == SHAPES[i]
            np.testing.assert_allclose(t.numpy(), want, rtol=2e-3 if dtype == "float16"
                                       else 1e-6, atol=1e-2 if dtype == "float16" else 1e-6)
            assert np.array_equal(t.numpy(), got[0][i].numpy())       # bit for bit
            assert devices(R)[r] in t.device


def crossing_elements(R):
    """Elements read across devices by the traced sums, and one replica's gradient elements."""
    arrays = gradients(R)
    fn = tf.function(lambda: summed(arrays, R))
    graph = fn.get_concrete_function().graph
    crossing = 0
    for op in graph.get_operations():
        for t in op.inputs:
            if op.device and t.op.device and t.op.device != op.device:
                crossing += t.shape.num_elements()
    return crossing, sum(int(np.prod(s)) for s in SHAPES)


@pytest.mark.parametrize("R", [2, 3, 4, 5])
def test_each_device_receives_at_most_two_pieces_per_replica(R):
    crossing, G = crossing_elements(R)
    if R == 2:
        assert crossing == 2 * G                      # each device adds the other's gradients
    else:
        assert crossing <= 2 * (R - 1) * (G + R)      # R devices, 2 (R - 1) / R of G each
        assert crossing < R * (R - 1) * G             # an exchange's


def test_gradients_without_static_shapes_are_exchanged():
    """An unknown shape cannot be cut into pieces ahead of time: each device adds them all."""
    R = 3
    fn = tf.function(lambda parts: replica_sums.on_every_replica(
        {r: [parts[r]] for r in range(R)}, devices(R), "test"),
        input_signature=[[tf.TensorSpec([None], tf.float32)] * R])
    values = [np.arange(4, dtype="float32") * (r + 1) for r in range(R)]
    got = fn([tf.constant(v) for v in values])
    for r in range(R):
        np.testing.assert_array_equal(got[r][0].numpy(), np.sum(values, axis=0))
