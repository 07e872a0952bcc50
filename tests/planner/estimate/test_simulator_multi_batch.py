"""The simulator on schedules over several global batches, against values computed by hand.

The issue's target: uniform stages (F = 1, B = 2, no communication), p = 4, m = 8, k = 4.

* 1F1B with a flush per batch: each batch takes (m + p - 1)(F + B) = 33, the run 4 x 33 = 132;
  each stage is busy k m (F + B) = 96 and idle k (p - 1)(F + B) = 36: bubble 36/132 = 3/11,
  the (p - 1)/(m + p - 1) of one batch.
* 2BW and PipeDream: one 1F1B over all k m = 32 micro-batches, filled and drained once (the
  updates take no time and each stage's update precedes, in its own list, every forward that
  reads its version): (k m + p - 1)(F + B) = 35 x 3 = 105, idle (p - 1)(F + B) = 9 per stage:
  bubble 9/105 = 3/35 = (p - 1)/(k m + p - 1).
* So both are below the flushed 1F1B by 3/11 - 3/35 = 72/385, and run 132/105 times the global
  batches per second (26.25 ms a batch against 33).
"""
import pytest

from planner.schedules.avgpipe_pipelines import tune_advance
from planner.estimate.pipeline_costs import PipelineCosts
from planner.schedules.by_name import build_schedule
from planner.estimate.simulator import simulate


def uniform(stages, forward, backward, transfer=0.0, allreduce=0.0):
    return PipelineCosts(forward_ms=[forward] * stages, backward_ms=[backward] * stages,
                         send_forward_ms=[transfer] * (stages - 1),
                         send_backward_ms=[transfer] * (stages - 1),
                         allreduce_ms=[allreduce] * stages)


def test_issue_target_2bw_and_pipedream_against_1f1b_with_a_flush_per_batch():
    p, m, k = 4, 8, 4
    costs = uniform(p, 1.0, 2.0)
    flushed = simulate(build_schedule("1f1b", p, m, batches=k), costs)
    assert flushed.iteration_ms == 132.0 and flushed.batch_ms == 33.0
    assert [s.idle_ms for s in flushed.stages] == [36.0] * p
    assert flushed.bubble_fraction == pytest.approx(3 / 11)
    for name in ("2bw", "pipedream"):
        result = simulate(build_schedule(name, p, m, batches=k), costs)
        assert result.iteration_ms == 105.0 and result.batches == k
        assert [s.busy_ms for s in result.stages] == [96.0] * p
        assert [s.idle_ms for s in result.stages] == [9.0] * p
        assert result.bubble_fraction == pytest.approx(3 / 35)
        assert flushed.bubble_fraction - result.bubble_fraction == pytest.approx(72 / 385)
        assert result.batch_ms == 26.25
        assert result.batches_per_second / flushed.batches_per_second == pytest.approx(132 / 105)
    # One batch alone: nothing to overlap, so 2BW is 1F1B's 33.
    assert simulate(build_schedule("2bw", p, m, batches=1), costs).iteration_ms == 33.0


def test_weight_copies_and_staleness_reach_the_results():
    result = simulate(build_schedule("pipedream", 4, 8, batches=2), uniform(4, 1.0, 2.0))
    assert [s.weight_copies for s in result.stages] == [4, 3, 2, 1]
    assert [s.staleness for s in result.stages] == [3, 2, 1, 0]
    d = result.to_dict()
    assert (d["batches"], d["pipelines"], d["batch_ms"]) == (2, 1, result.iteration_ms / 2)
    assert [s["weight_copies"] for s in d["stages"]] == [4, 3, 2, 1]


def test_every_update_pays_its_allreduce():
    # S = 2, M = 2, 2 batches, allreduce 0.5 per stage and update: 2BW runs 2 allreduces per
    # stage, PipeDream 4 (one per micro-batch). The stage statistics count each.
    costs = uniform(2, 1.0, 2.0, allreduce=0.5)
    two = simulate(build_schedule("2bw", 2, 2, batches=2), costs)
    dream = simulate(build_schedule("pipedream", 2, 2, batches=2), costs)
    assert [s.allreduce_ms for s in two.stages] == [1.0, 1.0]
    assert [s.allreduce_ms for s in dream.stages] == [2.0, 2.0]
    assert sum(e.kind == "allreduce" for e in dream.events) == 8


def test_advance_forward_propagation_hides_transfers_by_hand():
    # S = 2, M = 4, F = 1, B = 2, every transfer 1 (full duplex). 1F1B (K = [2, 1]):
    #   stage 0: F0 [0,1) F1 [1,2) B0 [6,8) F2 [8,9) B1 [9,11) F3 [11,12) B2 [14,16) B3 [17,19)
    #   stage 1: F0 [2,3) B0 [3,5) F1 [5,6) B1 [6,8) F2 [10,11) B2 [11,13) F3 [13,14) B3 [14,16)
    # -> 19 a batch. advance 1 (K = [3, 1]): stage 0 sends F2 at 3, so stage 1 runs F0 B0 F1
    # B1 F2 B2 back to back from 2 to 11; its F3 (sent at 9) at [11,12), B3 [12,14), back at
    # 15: stage 0's B3 [15,17) -> 17. advance 2 (all forwards first) also ends at 17, so
    # Algorithm 1 stops at 1. Flushed over 2 batches: 38 and 34.
    costs = uniform(2, 1.0, 2.0, transfer=1.0)
    times = {a: simulate(build_schedule("avgpipe", 2, 4, batches=1, advance=a), costs).iteration_ms
             for a in (0, 1, 2)}
    assert times == {0: 19.0, 1: 17.0, 2: 17.0}
    assert simulate(build_schedule("1f1b", 2, 4, batches=1), costs).iteration_ms == 19.0
    assert simulate(build_schedule("avgpipe", 2, 4, batches=2, advance=0), costs
                    ).iteration_ms == 38.0
    assert simulate(build_schedule("avgpipe", 2, 4, batches=2, advance=1), costs
                    ).iteration_ms == 34.0
    assert tune_advance(lambda a: (times[a], True), 4) == 1
    assert tune_advance(lambda a: (times[a], a < 1), 4) == 0      # advance 1 does not fit
