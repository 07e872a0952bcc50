"""The lowering's checks of compute lists (`check_compute`, `checked_lowering`): a chunk's
missing, repeated and unexpected actions named, with their weight versions; an action twice
in a lowered list named. They compare (chunk, kind, micro-batch) tuples first and build the
message from the actions only when something is wrong."""
import pytest

from planner.schedules.actions import Schedule, ScheduleError
from planner.schedules.lowering import check_compute
from planner.schedules.replay import checked_lowering


def refusal(text):
    with pytest.raises(ScheduleError) as caught:
        check_compute(Schedule.parse(text))
    return str(caught.value)


def test_missing_repeated_and_unexpected_are_named():
    assert refusal("0: 0F0 0F1 0B0 0B0") == (
        "position 0: chunk 0 must run F and B of micro-batches 0..1 once each; missing "
        "['0B1'], repeated ['0B0'], unexpected []")
    assert "unexpected ['0B2']" in refusal("0: 0F0 0F1 0B0 0B1 0B2")
    assert refusal("0: 0F0 0I0 0W0 0F1 0I1") == (
        "position 0: chunk 0 must run F, I and W of micro-batches 0..1 once each; missing "
        "['0W1'], repeated [], unexpected []")


def test_a_repeated_action_is_named_with_its_version():
    message = refusal("0: 0F0v0 0F0v1 0B0 0F1 0B1")
    assert "repeated ['0F0v0']" in message or "repeated ['0F0v1']" in message


def test_complete_lists_pass_and_an_action_twice_in_a_lowered_list_is_named():
    check_compute(Schedule.parse("0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1"))
    lowered = Schedule.parse("0: 0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0 0ALLREDUCE\n"
                             "1: 1RECV_F0 1F0 1B0 1SEND_B0 1ALLREDUCE")
    with pytest.raises(ScheduleError, match=r"position 0: 0SEND_F0 appears twice"):
        checked_lowering(lowered)
