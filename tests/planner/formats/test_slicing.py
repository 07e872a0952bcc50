"""The one row rule, as literal tables."""
import pytest

from planner.formats.slicing import (BatchSplitError, check_even, overlaps, replica_rows, slice_sizes,
                             unit_rows)


def test_units_of_a_16_row_batch_in_4_micro_batches_on_2_replicas():
    table = {(m, r): unit_rows(16, 4, 2, m, r) for m in range(4) for r in range(2)}
    assert table == {(0, 0): (0, 2), (0, 1): (2, 4), (1, 0): (4, 6), (1, 1): (6, 8),
                     (2, 0): (8, 10), (2, 1): (10, 12), (3, 0): (12, 14), (3, 1): (14, 16)}


def test_uneven_slices_differ_by_one_row():
    # boundaries floor(r * 128 / 15): 0 8 17 25 34 42 51 59 68 76 85 93 102 110 119 128
    assert slice_sizes(128, 15) == [8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 9]
    assert [replica_rows(7, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 7)]


def test_a_boundary_from_three_replicas_to_two():
    senders = [replica_rows(6, 3, r) for r in range(3)]          # (0,2) (2,4) (4,6)
    assert overlaps(replica_rows(6, 2, 0), senders) == [(0, 0, 2), (1, 0, 1)]
    assert overlaps(replica_rows(6, 2, 1), senders) == [(1, 1, 2), (2, 0, 2)]
    with pytest.raises(BatchSplitError, match="not covered"):
        overlaps((0, 6), senders[:2])


def test_the_runtime_needs_equal_slices():
    check_even(24, 4, [2, 3])
    with pytest.raises(BatchSplitError, match="stage 1 .*multiple of 12"):
        check_even(16, 4, [2, 3])
