"""The schedules beyond GPipe and early backward, checked without TensorFlow against tables
written by hand and against counts worked out from their definitions.

Interleaved 1F1B (Narayanan's dissertation, Fig. 4.4 bottom; Megatron's order): position s
holds chunks s and s + S; micro-batches go in groups of S, each group runs chunk s's forwards
then chunk s + S's; backwards take the same order with the chunks reversed; position s warms up
with W_s = 2(S - s - 1) + (v - 1) S forwards, then runs one forward and one backward in turn.
Worked out by hand for S = 4, v = 2, M = 8: W = 10, 8, 6, 4; forwards of position 0 in order
0F0..0F3 4F0..4F3 0F4..0F7 4F4..4F7, backwards 4B0..4B3 0B0..0B3 4B4..4B7 0B4..0B7.

ZB-H1 (Qi et al., Fig. 3): 1F1B's order (K_s = S - s) with each B split into I and W, and stage
s's W of micro-batch j run right after its I of micro-batch j + s, the rest at the end.
"""
import itertools

import pytest

from planner.schedules.actions import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule, ScheduleError
from planner.schedules.interleaved import interleaved_schedule, micro_batch_groups
from planner.schedules.replay import replay
from planner.schedules.by_name import (SCHEDULES, build_schedule, first_backward_depths,
                              pipeline_schedule, require_runtime_support, runtime_supported,
                              warmup_depths)
from planner.schedules.zb_h1 import zb_h1_schedule

INTERLEAVED_GOLDEN = {
    (2, 2, 4): """
        0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3""",
    (4, 2, 8): """
        0: 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7
        1: 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7
        2: 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7
        3: 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7""",
}
# Peak chunk-micro-batches held per position: W_s + 1 (a forward comes before each backward).
INTERLEAVED_PEAKS = {(2, 2, 4): [5, 3], (4, 2, 8): [11, 9, 7, 5]}

ZB_H1_GOLDEN = {
    (2, 4): """
        0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3
        1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3""",
    (4, 8): """
        0: 0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
        1: 1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7
        2: 2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7
        3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7""",
}
# Held (forward to I): 1F1B's K_s = S - s. Awaiting W: s + 1 (I(j) .. I(j + s) before W(j)).
ZB_H1_PEAKS = {(2, 4): ([2, 1], [1, 2]), (4, 8): ([4, 3, 2, 1], [1, 2, 3, 4])}


@pytest.mark.parametrize("key", sorted(INTERLEAVED_GOLDEN))
def test_interleaved_matches_the_hand_written_table(key):
    S, v, M = key
    schedule = interleaved_schedule(S, M, v)
    expected = Schedule.parse(INTERLEAVED_GOLDEN[key], name="interleaved",
                              placement=[c % S for c in range(S * v)])
    assert str(schedule) == str(expected)
    assert schedule == expected
    assert replay(schedule).peak_held == INTERLEAVED_PEAKS[key]


@pytest.mark.parametrize("key", sorted(ZB_H1_GOLDEN))
def test_zb_h1_matches_the_hand_written_table(key):
    S, M = key
    schedule = zb_h1_schedule(S, M)
    assert str(schedule) == str(Schedule.parse(ZB_H1_GOLDEN[key]))
    result = replay(schedule)
    assert (result.peak_held, result.peak_awaiting_weight) == ZB_H1_PEAKS[key]


GRID = list(itertools.product(range(1, 7), range(1, 17)))


@pytest.mark.parametrize("S,M", GRID)
def test_every_schedule_replays_for_every_shape(S, M):
    """Every action once, every dependency met, no deadlock: S in 1..6, M in 1..16, v in 1..3
    (interleaved also where M is not a multiple of S)."""
    schedules = [build_schedule(name, S, M) for name in SCHEDULES if name != "interleaved"]
    schedules += [build_schedule("interleaved", S, M, virtual_stages=v) for v in (1, 2, 3)]
    for schedule in schedules:
        result = replay(schedule)          # raises ScheduleError naming what is wrong
        chunks = schedule.num_chunks
        per_micro_batch = 3 if schedule.name == "zb-h1" else 2
        assert sum(a.is_compute for _, a in result.order) == per_micro_batch * chunks * M
        for p, lst in enumerate(result.schedule.lists):   # each position runs its list in order
            assert tuple(a for q, a in result.order if q == p) == lst


@pytest.mark.parametrize("S,M", GRID)
def test_zb_h1_holds_what_1f1b_holds_on_every_stage(S, M):
    ones = replay(build_schedule("1f1b", S, M))
    zero = replay(build_schedule("zb-h1", S, M))
    assert zero.peak_held == ones.peak_held == [min(S - s, M) for s in range(S)]
    assert first_backward_depths(zero.schedule) == warmup_depths("1f1b", S, M)
    # With the deeper warm-up of policy B too (what the planner gives 1F1B on slow links).
    deep = warmup_depths("B", S, M)
    assert replay(build_schedule("zb-h1", S, M, warmup=deep)).peak_held == \
        replay(build_schedule("1f1b", S, M, warmup=deep)).peak_held == deep
    # Forward to W, counted from the lists here (not by the code under test): min(S, M).
    for s, lst in enumerate(zero.schedule.lists):
        in_flight = peak = 0
        for a in lst:
            in_flight += {FORWARD: 1, BACKWARD_WEIGHT: -1}.get(a.kind, 0)
            peak = max(peak, in_flight)
        assert peak == min(S, M)


@pytest.mark.parametrize("S,M", GRID)
def test_interleaved_with_one_chunk_is_policy_b(S, M):
    # Megatron's warm-up 2(S - s - 1) with v = 1 is DAPPLE's policy B: K = 2(S - s) - 1.
    one = interleaved_schedule(S, M, 1)
    assert one.lists == pipeline_schedule(S, M, "B").lists


def test_interleaved_groups_hold_at_least_one_micro_batch_per_position():
    assert [list(g) for g in micro_batch_groups(4, 8)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(g) for g in micro_batch_groups(4, 9)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [list(g) for g in micro_batch_groups(4, 3)] == [[0, 1, 2]]


def test_interleaved_chunks_of_a_position_split_its_work():
    schedule = interleaved_schedule(3, 6, 2)
    assert schedule.placement == (0, 1, 2, 0, 1, 2)
    assert {a.chunk for a in schedule.lists[1]} == {1, 4}


def test_first_backward_depths_are_the_warmup_of_each_schedule():
    assert first_backward_depths(build_schedule("gpipe", 3, 5)) == [5, 5, 5]
    assert first_backward_depths(build_schedule("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert first_backward_depths(build_schedule("B", 4, 8)) == [7, 5, 3, 1]
    assert first_backward_depths(interleaved_schedule(4, 8, 2)) == [11, 9, 7, 5]


def test_names_old_and_new():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1")
    assert build_schedule("1f1b", 4, 8).lists == pipeline_schedule(4, 8, "A").lists
    assert build_schedule("A", 2, 4).lists == build_schedule("1f1b", 2, 4).lists
    assert all(runtime_supported(n) for n in ("gpipe", "1f1b", "A", "B", "interleaved", "zb-h1",
                                              "pipedream", "2bw", "avgpipe"))
    assert not runtime_supported("dualpipe")


def test_the_runtime_check_names_the_schedule_and_what_runs():
    from planner.formats.plan import straight_plan
    for name in ("gpipe", "1f1b", "A", "B", "zb-h1", "pipedream", "2bw"):
        require_runtime_support(straight_plan([1], 2, 4, schedule=name))
    require_runtime_support(straight_plan([1], 2, 4, replicas=[2, 2], schedule="avgpipe"))
    plan = straight_plan([1], 2, 4)
    plan.schedule = "dualpipe"          # a name from a newer dapple, say
    with pytest.raises(ScheduleError) as info:
        require_runtime_support(plan)
    assert str(info.value).startswith(
        "the plan's schedule 'dualpipe' is not one the dapple runtime runs (it runs gpipe, "
        "1f1b, A, B, interleaved, zb-h1, pipedream, 2bw, avgpipe); re-plan with `dapple plan "
        "--schedule=1f1b`")


@pytest.mark.parametrize("call,message", [
    (lambda: build_schedule("zigzag", 2, 4), "unknown schedule 'zigzag'"),
    (lambda: build_schedule("interleaved", 2, 4), "needs virtual_stages"),
    (lambda: build_schedule("interleaved", 2, 4, warmup=[2, 1], virtual_stages=2),
     "fixes its own warm-up"),
    (lambda: build_schedule("zb-h1", 2, 4, warmup=[1, 2]), "K_0 = 1 < K_1 = 2"),
    (lambda: build_schedule("1f1b", 2, 4, virtual_stages=2), "one chunk per position"),
    (lambda: interleaved_schedule(2, 4, 0), "virtual_stages must be a positive integer"),
    (lambda: zb_h1_schedule(0, 4), "stages must be a positive integer"),
])
def test_bad_schedule_requests_are_refused_clearly(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_split_backward_kinds_appear_only_in_zb_h1():
    kinds = {a.kind for lst in build_schedule("zb-h1", 3, 4).lists for a in lst}
    assert kinds == {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}
