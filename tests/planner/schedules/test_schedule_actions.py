"""Schedules as action lists, checked without TensorFlow against tables written by hand.

The tables follow the papers' figures: GPipe (all forwards, then all backwards), DAPPLE's early
backward (Fig. 3(b) and Fig. 11: stage i runs K_i forwards, then one backward and one forward in
turn), policy A (K_i = S - i, which is PipeDream-Flush/1F1B, Narayanan Fig. 4.x) and policy B
(K_i = 2(S - i) - 1).
"""
import itertools
import re

import pytest

from planner.schedules.actions import Action, Schedule, ScheduleError, actions
from planner.schedules.lowering import lower
from planner.schedules.replay import replay
from planner.schedules.by_name import check_warmup, pipeline_schedule, warmup_depths


def table(text):
    return Schedule.parse(text)


GOLDEN = {
    ("gpipe", 2, 4): """
        0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        1: 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3""",
    ("A", 2, 4): """
        0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3""",
    ("B", 2, 4): """
        0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3""",
    ("gpipe", 4, 4): """
        0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        1: 1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3
        2: 2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3
        3: 3F0 3F1 3F2 3F3 3B0 3B1 3B2 3B3""",
    ("A", 4, 8): """
        0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7
        1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7
        2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7""",
    ("B", 4, 8): """
        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0F7 0B1 0B2 0B3 0B4 0B5 0B6 0B7
        1: 1F0 1F1 1F2 1F3 1F4 1B0 1F5 1B1 1F6 1B2 1F7 1B3 1B4 1B5 1B6 1B7
        2: 2F0 2F1 2F2 2B0 2F3 2B1 2F4 2B2 2F5 2B3 2F6 2B4 2F7 2B5 2B6 2B7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7""",
}

# Peak micro-batches held per position: K_i (GPipe: M).
PEAKS = {("gpipe", 2, 4): [4, 4], ("A", 2, 4): [2, 1], ("B", 2, 4): [3, 1],
         ("gpipe", 4, 4): [4, 4, 4, 4], ("A", 4, 8): [4, 3, 2, 1], ("B", 4, 8): [7, 5, 3, 1]}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_schedules_match_the_hand_written_tables(key):
    policy, S, M = key
    assert pipeline_schedule(S, M, policy) == Schedule.parse(GOLDEN[key], name=policy)
    assert replay(pipeline_schedule(S, M, policy)).peak_held == PEAKS[key]


def test_lowering_adds_transfers_and_allreduce_as_written_by_hand():
    lowered = lower(pipeline_schedule(2, 2, "A"))
    assert str(lowered) == (
        "0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0ALLREDUCE\n"
        "1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1ALLREDUCE")


def test_lowering_a_split_backward_sends_after_I_and_reduces_after_the_last_W():
    lowered = lower(table("""
        0: 0F0 0F1 0I0 0I1 0W0 0W1
        1: 1F0 1I0 1F1 1I1 1W0 1W1"""))
    assert str(lowered) == (
        "0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0RECV_B1 0I1 0W0 0W1 0ALLREDUCE\n"
        "1: 1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1W1 1ALLREDUCE")
    result = replay(lowered)
    assert result.peak_held == [2, 1]                 # full activations: forward to I
    assert result.peak_awaiting_weight == [2, 2]      # then what W reads: I to W


def test_chunks_on_one_position_pass_data_without_transfers():
    # Two chunks on one position (a device holding two model chunks): no sends, no receives.
    schedule = Schedule("one device", (0, 0), tuple([tuple(actions("0F0 1F0 1B0 0B0"))]))
    assert str(lower(schedule)) == "0: 0F0 1F0 1B0 1ALLREDUCE 0B0 0ALLREDUCE"


@pytest.mark.parametrize("text", ["1F3", "0I2", "0W2", "12B7", "1RECV_F3", "0SEND_B0",
                                  "3ALLREDUCE", "3ALLREDUCE2", "0UPDATE2", "0F9v1", "1B3v0"])
def test_actions_round_trip_through_text(text):
    assert str(Action.parse(text)) == text


def test_schedules_round_trip_through_text():
    for key in GOLDEN:
        s = lower(pipeline_schedule(key[1], key[2], key[0]))
        assert Schedule.parse(str(s), name=s.name) == s


@pytest.mark.parametrize("bad", ["F3", "1X3", "1F", "0F3v", "x"])
def test_unreadable_actions_are_refused_with_the_form(bad):
    with pytest.raises(ScheduleError, match="chunk|micro-batch"):
        Action.parse(bad)


@pytest.mark.parametrize("S,M,policy", itertools.product([1, 2, 3, 4], [1, 2, 3, 8],
                                                         ["A", "B", "gpipe"]))
def test_every_policy_replays_without_deadlock(S, M, policy):
    schedule = pipeline_schedule(S, M, policy)
    result = replay(schedule)
    assert sum(a.is_compute for _, a in result.order) == 2 * S * M
    for s in range(S):    # each position runs its list in order
        assert tuple(a for p, a in result.order if p == s) == result.schedule.lists[s]
    assert result.peak_held == warmup_depths(policy, S, M)


def test_replay_names_the_stuck_actions_of_a_deadlocking_list():
    # Stage 0 runs B0 before F0: it waits for stage 1's gradient, which needs F0 first.
    bad = table("""
        0: 0B0 0F0
        1: 1F0 1B0""")
    with pytest.raises(ScheduleError) as info:
        replay(bad)
    assert str(info.value) == (
        "schedule deadlocks; waiting actions: position 0 at 0RECV_B0 waits for 1SEND_B0 on "
        "position 1 (stuck at 1RECV_F0); position 1 at 1RECV_F0 waits for 0SEND_F0 on "
        "position 0 (stuck at 0RECV_B0)")


def test_replay_refuses_a_missing_action():
    with pytest.raises(ScheduleError, match=r"missing \['1B1'\]"):
        replay(table("""
            0: 0F0 0F1 0B0 0B1
            1: 1F0 1B0 1F1"""))


def test_warmup_depths_by_policy():
    assert warmup_depths("A", 4, 8) == [4, 3, 2, 1]
    assert warmup_depths("B", 4, 8) == [7, 5, 3, 1]
    assert warmup_depths("B", 4, 4) == [4, 4, 3, 1]
    assert warmup_depths("gpipe", 3, 5) == [5, 5, 5]
    assert warmup_depths("B", 4, 8, memory_limit=2) == [2, 2, 2, 1]


def test_warmup_must_not_grow_along_the_pipeline():
    with pytest.raises(ScheduleError, match="K_0 = 1 < K_1 = 2"):
        check_warmup([1, 2], 4)
    with pytest.raises(ScheduleError, match="between 1 and micro_batches"):
        check_warmup([5, 1], 4)


def test_shared_action_is_the_action_and_refuses_what_action_refuses():
    from planner.schedules.actions import KINDS, shared_action
    for kind in KINDS:
        for m in (None, 0, 3):
            try:
                expected = Action(2, kind, m)
            except ScheduleError as e:
                with pytest.raises(ScheduleError, match=re.escape(str(e))):
                    shared_action(2, kind, m)
                continue
            made = shared_action(2, kind, m)
            assert made == expected and hash(made) == hash(expected) and str(made) == str(expected)
            assert made.__dict__ == expected.__dict__ and made is shared_action(2, kind, m)
    with pytest.raises(ScheduleError, match="unknown action kind"):
        shared_action(0, "X", 1)
