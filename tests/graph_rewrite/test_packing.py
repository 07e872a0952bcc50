"""Boundary tensors packed into one byte matrix come back bit for bit, row slices included."""
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.packing import pack, row_bytes, unpack

SPECS = [tf.TensorSpec([None, 3, 2], tf.float32), tf.TensorSpec([None], tf.int32),
         tf.TensorSpec([None, 4], tf.float16), tf.TensorSpec([None, 2], tf.bool),
         tf.TensorSpec([None, 5], tf.int8), tf.TensorSpec([None, 1], tf.int64),
         tf.TensorSpec([None, 2], tf.uint8)]


def tensors(rows, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randn(rows, 3, 2).astype("float32"), rng.randint(-9, 9, rows).astype("int32"),
            rng.randn(rows, 4).astype("float16"), rng.rand(rows, 2) > 0.5,
            rng.randint(-9, 9, (rows, 5)).astype("int8"),
            rng.randint(-2**40, 2**40, (rows, 1)).astype("int64"),
            rng.randint(0, 255, (rows, 2)).astype("uint8")]


def test_row_bytes_by_hand():
    # 3*2 float32 + int32 + 4 float16 + 2 bools + 5 int8 + int64 + 2 uint8
    assert [row_bytes(s) for s in SPECS] == [24, 4, 8, 2, 5, 8, 2]
    assert pack([tf.constant(t) for t in tensors(5)], SPECS).shape == (5, 53)


@pytest.mark.parametrize("lo,hi", [(0, 5), (1, 4), (2, 2)])
def test_pack_then_unpack_returns_every_tensor_and_row_range(lo, hi):
    originals = tensors(5)
    packed = pack([tf.constant(t) for t in originals], SPECS)
    for want, got, spec in zip(originals, unpack(packed[lo:hi], SPECS), SPECS):
        assert got.dtype == spec.dtype
        np.testing.assert_array_equal(got.numpy(), want[lo:hi])


def test_one_tensor_is_packed_alone():
    x = np.arange(6, dtype="float32").reshape(3, 2)
    spec = tf.TensorSpec([None, 2], tf.float32)
    (back,) = unpack(pack([tf.constant(x)], [spec]), [spec])
    np.testing.assert_array_equal(back.numpy(), x)


def test_unknown_inner_dimension_is_refused_by_name():
    with pytest.raises(ValueError, match="'h'.*static"):
        row_bytes(tf.TensorSpec([None, None], tf.float32, name="h"))
