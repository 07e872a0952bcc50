"""`transport.byte_groups`: a data-parallel step's gradients cut into grouped allreduces of
about equal bytes, the last tensors (the backward's first gradients) first. Expected groups
worked out by hand from the tensors' sizes."""
import pytest
import tensorflow as tf

from dapple.runtime.horovod.transport import byte_groups


def tensors(sizes, dtype=tf.float32):
    return [tf.zeros([n], dtype) for n in sizes]


# tests.models.mlp_with_skip's gradients (d1 kernel, bias, d2, d3, out) and the loss last:
# 426 elements; cut at 1/4, 2/4, 3/4 of them counted from the end (106.5, 213, 319.5):
# 1+5+50+10+120 = 186 >= 106.5; +12+144 = 342 >= 213; +12 = 354 >= 319.5; the rest.
MLP = [72, 12, 144, 12, 120, 10, 50, 5, 1]


@pytest.mark.parametrize("groups, expected", [
    (1, [[8, 7, 6, 5, 4, 3, 2, 1, 0]]),
    (2, [[8, 7, 6, 5, 4, 3, 2], [1, 0]]),              # 342 >= 213
    (4, [[8, 7, 6, 5, 4], [3, 2], [1], [0]]),
    # cuts every 21.3 elements: 56 passes the first, and each later tensor one more cut
    (20, [[8, 7, 6], [5], [4], [3], [2], [1], [0]]),
])
def test_groups_of_about_equal_bytes_last_tensors_first(groups, expected):
    assert byte_groups(tensors(MLP), groups) == expected


def test_bytes_not_elements_decide():
    # 10 float64 = 80 bytes against 30 float32 = 120: the cut comes after 200 / 2 bytes
    mixed = [tf.zeros([30], tf.float32), tf.zeros([10], tf.float64)]
    assert byte_groups(mixed, 2) == [[1, 0]]      # 80 < 100: both in the first group
    assert byte_groups(mixed[::-1], 2) == [[1], [0]]   # 120 >= 100
