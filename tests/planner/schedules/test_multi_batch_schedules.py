"""Schedules over several global batches (PipeDream, PipeDream-2BW, AvgPipe, and 1F1B with a
flush per batch), checked without TensorFlow against tables written by hand from the papers'
rules, the papers' own statements about their figures, and counts worked out by hand.

The rules the tables follow (micro-batches numbered over the run, batch t = j // M):

* 2BW (Narayanan §3.2.1): 1F1B over all micro-batches, no flush; UPDATE t after the backward of
  batch t's last micro-batch; micro-batch j reads version max(j // M - 1, 0).
* PipeDream (SOSP'19 §3.3): 1F1B over all micro-batches; UPDATE j after every backward j; a
  forward reads the latest version of its stage, its backward the same (weight stashing);
  vertical sync: every stage reads the version stage 0 read.
* AvgPipe (PPoPP'23 §4.2): per batch, stages but the last run `advance` forwards more than 1F1B
  before their first backward; an update per batch after its last backward (a flush).
"""
import itertools

import pytest

from planner.schedules.actions import (BACKWARD, FORWARD, UPDATE, Action, Schedule, ScheduleError,
                             actions)
from planner.schedules.lowering import lower
from planner.schedules.replay import replay
from planner.schedules.by_name import build_schedule
from planner.schedules.weight_versions import resident_versions, staleness, weight_copies

GOLDEN = {
    # S = 2, M = 2, 3 batches; 1F1B warm-up K = [2, 1].
    ("2bw", 2, 2, 3): """
        0: 0F0v0 0F1v0 0B0v0 0F2v0 0B1v0 0UPDATE0 0F3v0 0B2v0 0F4v1 0B3v0 0UPDATE1 0F5v1 0B4v1 0B5v1 0UPDATE2
        1: 1F0v0 1B0v0 1F1v0 1B1v0 1UPDATE0 1F2v0 1B2v0 1F3v0 1B3v0 1UPDATE1 1F4v1 1B4v1 1F5v1 1B5v1 1UPDATE2""",
    ("pipedream", 2, 2, 2): """
        0: 0F0v0 0F1v0 0B0v0 0UPDATE0 0F2v1 0B1v0 0UPDATE1 0F3v2 0B2v1 0UPDATE2 0B3v2 0UPDATE3
        1: 1F0v0 1B0v0 1UPDATE0 1F1v1 1B1v1 1UPDATE1 1F2v2 1B2v2 1UPDATE2 1F3v3 1B3v3 1UPDATE3""",
    ("pipedream-vertical", 2, 2, 2): """
        0: 0F0v0 0F1v0 0B0v0 0UPDATE0 0F2v1 0B1v0 0UPDATE1 0F3v2 0B2v1 0UPDATE2 0B3v2 0UPDATE3
        1: 1F0v0 1B0v0 1UPDATE0 1F1v0 1B1v0 1UPDATE1 1F2v1 1B2v1 1UPDATE2 1F3v2 1B3v2 1UPDATE3""",
    # advance 1: K = [min(2 + 1, 4), 1] = [3, 1].
    ("avgpipe", 2, 4, 2): """
        0: 0F0v0 0F1v0 0F2v0 0B0v0 0F3v0 0B1v0 0B2v0 0B3v0 0UPDATE0 0F4v1 0F5v1 0F6v1 0B4v1 0F7v1 0B5v1 0B6v1 0B7v1 0UPDATE1
        1: 1F0v0 1B0v0 1F1v0 1B1v0 1F2v0 1B2v0 1F3v0 1B3v0 1UPDATE0 1F4v1 1B4v1 1F5v1 1B5v1 1F6v1 1B6v1 1F7v1 1B7v1 1UPDATE1""",
    ("1f1b", 2, 2, 2): """
        0: 0F0v0 0F1v0 0B0v0 0B1v0 0UPDATE0 0F2v1 0F3v1 0B2v1 0B3v1 0UPDATE1
        1: 1F0v0 1B0v0 1F1v0 1B1v0 1UPDATE0 1F2v1 1B2v1 1F3v1 1B3v1 1UPDATE1""",
}
# Per stage: (resident weight versions, weight copies, staleness), counted by hand above.
# 2BW stage 0 after 0UPDATE0: version 1, and version 0 which 0F3, 0B2, 0B3 still read.
COUNTS = {("2bw", 2, 2, 3): ([2, 2], [2, 2], [1, 1]),
          ("pipedream", 2, 2, 2): ([2, 1], [2, 1], [1, 0]),
          ("pipedream-vertical", 2, 2, 2): ([2, 2], [2, 2], [1, 1]),
          ("avgpipe", 2, 4, 2): ([1, 1], [2, 2], [0, 0]),
          ("1f1b", 2, 2, 2): ([1, 1], [1, 1], [0, 0])}


def build(name, S, M, k):
    if name == "avgpipe":
        return build_schedule(name, S, M, batches=k, advance=1)
    if name == "pipedream-vertical":
        return build_schedule("pipedream", S, M, batches=k, vertical_sync=True)
    return build_schedule(name, S, M, batches=k)


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_schedules_match_the_hand_written_tables(key):
    schedule = build(*key)
    assert str(schedule) == str(Schedule.parse(GOLDEN[key]))
    assert schedule.batches == key[3] and schedule.micro_batches == key[2] * key[3]
    versions, copies, stale = COUNTS[key]
    assert resident_versions(schedule) == versions
    assert weight_copies(schedule) == copies
    assert staleness(schedule) == stale


def test_lowering_puts_each_allreduce_before_its_update_and_avgpipes_after():
    two = lower(build_schedule("2bw", 2, 2, batches=2))
    assert str(two) == (
        "0: 0F0v0 0SEND_F0 0F1v0 0SEND_F1 0RECV_B0 0B0v0 0F2v0 0SEND_F2 0RECV_B1 0B1v0 "
        "0ALLREDUCE0 0UPDATE0 0F3v0 0SEND_F3 0RECV_B2 0B2v0 0RECV_B3 0B3v0 0ALLREDUCE1 0UPDATE1\n"
        "1: 1RECV_F0 1F0v0 1B0v0 1SEND_B0 1RECV_F1 1F1v0 1B1v0 1SEND_B1 1ALLREDUCE0 1UPDATE0 "
        "1RECV_F2 1F2v0 1B2v0 1SEND_B2 1RECV_F3 1F3v0 1B3v0 1SEND_B3 1ALLREDUCE1 1UPDATE1")
    averaged = lower(build_schedule("avgpipe", 2, 2, batches=2))
    assert str(averaged).startswith("0: 0F0v0 0SEND_F0 0F1v0 0SEND_F1 0RECV_B0 0B0v0 0RECV_B1 "
                                    "0B1v0 0UPDATE0 0ALLREDUCE0 0F2v1")
    assert Schedule.parse(str(two), name="2bw", batches=2) == two


def test_pipedream_reads_the_versions_of_the_papers_figures():
    # SOSP'19 Fig. 4 and 9 (4 stages; "minibatch 5" is micro-batch 4 here): "minibatch 5 uses
    # parameter updates from minibatch 1 on machine 1 and from 2 on machine 2", and "the
    # backward pass for minibatch 5 is performed after updates from minibatches 2, 3, and 4".
    schedule = build_schedule("pipedream", 4, 8, batches=1)
    forward = {(a.chunk, a.micro_batch): a.version for l in schedule.lists for a in l
               if a.kind == FORWARD}
    assert (forward[(0, 4)], forward[(1, 4)]) == (1, 2)
    stage0 = list(schedule.lists[0])
    backward4 = stage0.index(Action(0, BACKWARD, 4))
    assert [a.micro_batch for a in stage0[:backward4] if a.kind == UPDATE] == [0, 1, 2, 3]
    assert stage0[backward4].version == 1                     # its stashed weights
    # Vertical sync: "minibatch 5 uses parameters updated by minibatch 1 on all workers".
    synced = build_schedule("pipedream", 4, 8, batches=1, vertical_sync=True)
    assert {a.version for l in synced.lists for a in l if a.micro_batch == 4
            and a.kind in (FORWARD, BACKWARD)} == {1}


def test_2bw_reads_the_versions_of_the_dissertations_figure():
    # Fig. 3.2 (p = 4, m = 4; "input k" is micro-batch k - 1 here): W_4^(4), version 1, "is
    # first used for input 9's forward pass"; "input 7 on worker 3" cannot use the newest
    # version for its backward; every worker discards W^(0) after the backward of input 8.
    schedule = build_schedule("2bw", 4, 4, batches=3)
    last = list(schedule.lists[3])
    assert next(a for a in last if a.version == 1) == Action(3, FORWARD, 8)
    worker3 = list(schedule.lists[2])
    b6 = worker3.index(Action(2, BACKWARD, 6))
    assert Action(2, UPDATE, 0) in worker3[:b6] and worker3[b6].version == 0
    for lst in schedule.lists:
        readers = [a for a in lst if a.kind != UPDATE and a.version == 0]
        assert readers[-1].kind == BACKWARD and readers[-1].micro_batch == 7


GRID = list(itertools.product(range(1, 6), range(1, 9), range(1, 4)))


@pytest.mark.parametrize("S,M,k", GRID)
def test_every_multi_batch_schedule_replays_and_keeps_its_rule(S, M, k):
    """Every action once, no deadlock, and the versions each micro-batch reads recounted from
    the replay's order (not the lists): 2BW's max(t - 1, 0); PipeDream's updates its stage ran
    before the forward (stage 0's with vertical sync); batch t's t for the flushed ones."""
    for name, extra in [("2bw", {}), ("pipedream", {}), ("pipedream", {"vertical_sync": True}),
                        ("avgpipe", {"advance": 0}), ("avgpipe", {"advance": 2}),
                        ("1f1b", {})]:
        schedule = build_schedule(name, S, M, batches=k, **extra)
        result = replay(schedule)
        computed = [(p, a) for p, a in result.order if a.kind in (FORWARD, BACKWARD)]
        assert len(computed) == 2 * S * M * k
        updates_done = [0] * S
        stage0_read = {}
        for p, a in result.order:
            if a.kind == UPDATE:
                updates_done[p] += 1
            elif a.kind == FORWARD:
                if p == 0:
                    stage0_read[a.micro_batch] = updates_done[0]
                t = a.micro_batch // M
                expected = {"2bw": max(t - 1, 0), "avgpipe": t, "1f1b": t,
                            "pipedream": stage0_read[a.micro_batch] if extra
                            else updates_done[p]}[name]
                assert a.version == expected, (name, extra, p, a)
        per_stage = M * k if name == "pipedream" else k
        assert updates_done == [per_stage] * S


@pytest.mark.parametrize("S,M", [(4, 8), (3, 4), (5, 5)])
def test_weight_copies_and_staleness_per_stage_by_hand(S, M):
    # 1F1B (flushed), AvgPipe: one version (AvgPipe keeps the reference z too); 2BW: two;
    # PipeDream: K_s = S - s, the micro-batches in flight, and K_s - 1 updates stale (the
    # paper's W_1(t-p+1) ... W_p(t)); vertical sync keeps K_0 = S on every stage.
    assert weight_copies(build_schedule("1f1b", S, M, batches=3)) == [1] * S
    assert weight_copies(build_schedule("avgpipe", S, M, batches=3)) == [2] * S
    assert weight_copies(build_schedule("2bw", S, M, batches=3)) == [2] * S
    assert weight_copies(build_schedule("pipedream", S, M, batches=3)) == \
        [S - s for s in range(S)]
    assert weight_copies(build_schedule("pipedream", S, M, batches=3, vertical_sync=True)) == \
        [S] * S
    assert staleness(build_schedule("2bw", S, M, batches=3)) == [1] * S
    assert staleness(build_schedule("pipedream", S, M, batches=3)) == \
        [S - 1 - s for s in range(S)]
    assert staleness(build_schedule("pipedream", S, M, batches=3, vertical_sync=True)) == \
        [S - 1] * S
    assert staleness(build_schedule("avgpipe", S, M, batches=3, advance=1)) == [0] * S


def test_avgpipe_runs_ahead_on_every_stage_but_the_last():
    # K_s = min(S - s + floor(advance (S - 1 - s) / (S - 1)), M), the last stage 1. By hand,
    # S = 4, M = 8: advance 2 adds 2, 4 // 3 = 1 and 2 // 3 = 0 forwards to stages 0, 1, 2.
    from planner.schedules.avgpipe_pipelines import advance_depths
    from planner.schedules.by_name import first_backward_depths, warmup_depths
    assert advance_depths(4, 8, 0) == [4, 3, 2, 1]             # 1F1B (Algorithm 1's start)
    assert advance_depths(4, 8, 2) == [6, 4, 2, 1]
    assert advance_depths(4, 8, 3) == [7, 5, 3, 1] == warmup_depths("B", 4, 8)
    assert advance_depths(4, 8, 24) == [8, 8, 8, 1]            # all forwards first (AFAB)
    assert advance_depths(2, 8, 1) == [3, 1]                   # the paper's Fig. 7(c)
    schedule = build_schedule("avgpipe", 4, 8, batches=2, advance=2)
    assert first_backward_depths(schedule) == [6, 4, 2, 1]
    assert replay(schedule).peak_held == [6, 4, 2, 1]


@pytest.mark.parametrize("call,message", [
    (lambda: build_schedule("2bw", 2, 4, batches=0), "batches .* must be a positive integer"),
    (lambda: build_schedule("gpipe", 2, 4, batches=2), "runs one global batch"),
    (lambda: build_schedule("2bw", 2, 4, advance=1), "advance .* applies to 'avgpipe'"),
    (lambda: build_schedule("2bw", 2, 4, vertical_sync=True), "vertical_sync applies to"),
    (lambda: build_schedule("avgpipe", 2, 4, advance=-1), "non-negative integer"),
    (lambda: build_schedule("avgpipe", 2, 4, warmup=[2, 1]), "fixes its own warm-up"),
    (lambda: build_schedule("2bw", 2, 4, warmup=[1, 2]), "K_0 = 1 < K_1 = 2"),
    (lambda: Action(0, UPDATE), "need an update index"),
    (lambda: Action(0, UPDATE, 1, version=1), "read no weight version"),
])
def test_bad_requests_are_refused_clearly(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_hand_written_lists_that_break_the_update_rules_are_refused():
    def replayed(text):
        return replay(Schedule.parse(text))
    with pytest.raises(ScheduleError, match=r"\['0B1'\] are never applied"):
        replayed("0: 0F0 0F1 0B0 0UPDATE0 0B1")
    with pytest.raises(ScheduleError, match=r"must run UPDATE 0, 1, 2, ... in this order"):
        replayed("0: 0F0 0B0 0UPDATE1")
    with pytest.raises(ScheduleError, match=r"\['0B0v1'\] must read the weight version"):
        replayed("0: 0F0v0 0B0v1 0UPDATE0")
    # A forward reading a version its own list makes later: the replay says what it waits for.
    with pytest.raises(ScheduleError, match="its own 0UPDATE0, which comes later"):
        replayed("0: 0F0 0B0 0F1v1 0UPDATE0 0B1v1 0UPDATE1")
    assert [str(a) for a in actions("0UPDATE3 2ALLREDUCE3 1F9v2")] == \
        ["0UPDATE3", "2ALLREDUCE3", "1F9v2"]
