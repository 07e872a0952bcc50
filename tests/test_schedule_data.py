"""Schedules as data, checked without TensorFlow against hand-written task lists."""
import itertools

import pytest

from planner.schedule import (ScheduleError, Task, check_warmup, pipeline_schedule, replay,
                              stage_tasks, warmup_depths)


def names(tasks):
    return " ".join(str(t) for t in tasks)


def test_two_stage_policy_a_matches_the_paper():
    # DAPPLE Fig. 3(b)/Fig. 11: stage 0 runs 2 forwards then alternates; stage 1 is 1F1B.
    s0, s1 = pipeline_schedule(2, 4, "A")
    assert names(s0) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert names(s1) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_gpipe_runs_all_forwards_first():
    assert names(stage_tasks(3, 3)) == "F0 F1 F2 B0 B1 B2"


def test_warmup_depths_by_policy():
    assert warmup_depths("A", 4, 8) == [4, 3, 2, 1]
    assert warmup_depths("B", 4, 8) == [7, 5, 3, 1]
    assert warmup_depths("B", 4, 4) == [4, 4, 3, 1]
    assert warmup_depths("gpipe", 3, 5) == [5, 5, 5]
    assert warmup_depths("B", 4, 8, memory_limit=2) == [2, 2, 2, 1]


@pytest.mark.parametrize("S,M,policy", itertools.product([1, 2, 3, 4], [1, 2, 3, 8], ["A", "B", "gpipe"]))
def test_every_policy_replays_without_deadlock(S, M, policy):
    schedule = pipeline_schedule(S, M, policy)
    order = replay(schedule)
    assert len(order) == 2 * S * M
    # each stage's tasks complete in its own list order
    for s in range(S):
        assert [t for (st, t) in order if st == s] == schedule[s]


def test_replay_reports_missing_task():
    s0, s1 = pipeline_schedule(2, 2, "A")
    with pytest.raises(ScheduleError, match="missing"):
        replay([s0, s1[:-1]])


def test_replay_reports_deadlock_naming_tasks():
    # stage 0 waits for B0 before doing F0; B0 needs stage 1's B0 which needs F0: a cycle.
    bad = [[Task("B", 0), Task("F", 0)], [Task("F", 0), Task("B", 0)]]
    with pytest.raises(ScheduleError, match=r"deadlocks.*stage 0: B0.*stage 1: F0"):
        replay(bad)


def test_warmup_must_not_grow_along_the_pipeline():
    with pytest.raises(ScheduleError, match="K_0 = 1 < K_1 = 2"):
        check_warmup([1, 2], 4)
    with pytest.raises(ScheduleError, match="between 1 and micro_batches"):
        check_warmup([5, 1], 4)
