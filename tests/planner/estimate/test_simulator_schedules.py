"""The simulator on interleaved 1F1B and ZB-H1, against values computed by hand.

The issue's targets: uniform stages, forward 1 and backward 2 (split into I = W = 1), p = 4
stages, m = 8 micro-batches, no communication.

* 1F1B: iteration (m + p - 1)(F + B) = 11 * 3 = 33; each stage busy m(F + B) = 24, idle 9.
* ZB-H1: stage 0 runs F0..F3 by t = 4 and waits for I0, which comes back after F0 on stage 3
  ([3, 4)) and I0 on stages 3, 2, 1 ([4, 5), [5, 6), [6, 7)): it idles 3 (= (p - 1) F), then
  never waits again (each stage's deferred Ws fill the gaps in which 1F1B waited), so the
  iteration is 4 + 3 + 20 = 27 and every stage is idle 27 - 24 = 3: (p - 1)(F + I - W), a
  third of 1F1B's 9 (target <= 0.4).
* Interleaved, v = 2: each stage's layers become two chunks of F = 0.5, B = 1. The bubble
  (Narayanan §4.2.2) is (p - 1)(F + B) / v = 3 * 3 / 2 = 4.5 per device, the iteration
  24 + 4.5 = 28.5: half of 1F1B's idle time (target <= 0.55).
* Peak held micro-batches (forward to B or I): 1F1B's K_s = p - s = [4, 3, 2, 1] on both.
"""
import itertools

import pytest

from planner.estimate.pipeline_costs import PipelineCosts
from planner.schedules.by_name import build_schedule
from planner.schedules.memory import peak_bytes, peak_counts
from planner.estimate.simulator import (BACKWARD_INPUT_KIND, BACKWARD_WEIGHT_KIND, SEND_BACKWARD_KIND,
                               SEND_FORWARD_KIND, simulate)


def uniform(chunks, forward, backward, transfer=0.0, **extra):
    return PipelineCosts(forward_ms=[forward] * chunks, backward_ms=[backward] * chunks,
                         send_forward_ms=[transfer] * (chunks - 1),
                         send_backward_ms=[transfer] * (chunks - 1),
                         allreduce_ms=[0.0] * chunks, **extra)


def test_issue_targets_zb_h1_and_interleaved_against_1f1b():
    p, m = 4, 8
    one_f_one_b = simulate(build_schedule("1f1b", p, m), uniform(p, 1.0, 2.0))
    zero_bubble = simulate(build_schedule("zb-h1", p, m), uniform(p, 1.0, 2.0))
    interleaved = simulate(build_schedule("interleaved", p, m, virtual_stages=2),
                           uniform(2 * p, 0.5, 1.0))
    assert one_f_one_b.iteration_ms == 33.0
    assert [s.idle_ms for s in one_f_one_b.stages] == [9.0] * p
    assert zero_bubble.iteration_ms == 27.0
    assert [s.idle_ms for s in zero_bubble.stages] == [3.0] * p
    assert interleaved.iteration_ms == pytest.approx(28.5)
    assert [s.idle_ms for s in interleaved.stages] == pytest.approx([4.5] * p)
    for s in range(p):
        assert zero_bubble.stages[s].idle_ms <= 0.4 * one_f_one_b.stages[s].idle_ms
        assert interleaved.stages[s].idle_ms <= 0.55 * one_f_one_b.stages[s].idle_ms
    held = [s.peak_held_micro_batches for s in zero_bubble.stages]
    assert held == [s.peak_held_micro_batches for s in one_f_one_b.stages] == [4, 3, 2, 1]


def test_split_backward_runs_I_and_W_apart():
    result = simulate(build_schedule("zb-h1", 4, 8), uniform(4, 1.0, 2.0))
    last = result.stage_events(3)
    kinds = [(e.kind, e.micro_batch, e.start_ms, e.end_ms) for e in last[:8]]
    # Stage 3 (3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 ...): F0 as soon as stages 0-2 ran F0.
    assert kinds[:2] == [("forward", 0, 3.0, 4.0), (BACKWARD_INPUT_KIND, 0, 4.0, 5.0)]
    assert [e.kind for e in last].count(BACKWARD_WEIGHT_KIND) == 8
    assert all(e.duration_ms == 1.0 for e in last if e.kind != "forward")
    # Its first W runs after the I of micro-batch 3: 4 micro-batches awaited W at once.
    first_w = next(i for i, e in enumerate(last) if e.kind == BACKWARD_WEIGHT_KIND)
    assert (last[first_w - 1].kind, last[first_w - 1].micro_batch) == (BACKWARD_INPUT_KIND, 3)
    assert [s.peak_awaiting_weight_micro_batches for s in result.stages] == [1, 2, 3, 4]


def test_held_bytes_count_what_W_still_reads():
    # ZB-H1, S = 2, M = 4; 10 bytes held per micro-batch, 4 from its I to its W. By hand:
    # stage 0: 0F0 0F1 (20) 0I0 (14) 0W0 (10) 0F2 (20) ... -> 20;
    # stage 1: 1F0 (10) 1I0 (4) 1F1 (14) 1I1 (8) 1W0 (4) 1F2 (14) ... -> 14.
    costs = uniform(2, 1.0, 2.0, activation_bytes=[10.0, 10.0],
                    weight_gradient_bytes=[4.0, 4.0])
    result = simulate(build_schedule("zb-h1", 2, 4), costs)
    assert [s.peak_held_bytes for s in result.stages] == [20.0, 14.0]
    # Without weight_gradient_bytes nothing is freed before W: stage 1 has two micro-batches
    # between forward and W at once (1F1 runs before 1W0): 20.
    plain = simulate(build_schedule("zb-h1", 2, 4), uniform(2, 1.0, 2.0,
                                                            activation_bytes=[10.0, 10.0]))
    assert [s.peak_held_bytes for s in plain.stages] == [20.0, 20.0]


def test_interleaved_transfers_wrap_from_the_last_position_to_the_first_by_hand():
    # S = 2, v = 2, M = 1: chunks 0 and 2 on position 0, 1 and 3 on position 1; F = 1, B = 2,
    # every boundary 0.5 each way. Position 0: 0F0 2F0 2B0 0B0; position 1: 1F0 3F0 3B0 1B0.
    # 0F0 [0,1) -> [1,1.5) -> 1F0 [1.5,2.5) -> [2.5,3) -> 2F0 [3,4) -> [4,4.5) -> 3F0
    # [4.5,5.5), 3B0 [5.5,7.5) -> [7.5,8) -> 2B0 [8,10) -> [10,10.5) -> 1B0 [10.5,12.5)
    # -> [12.5,13) -> 0B0 [13,15). Each position busy 6 of 15.
    result = simulate(build_schedule("interleaved", 2, 1, virtual_stages=2),
                      uniform(4, 1.0, 2.0, transfer=0.5))
    assert result.iteration_ms == 15.0
    sends = sorted((e.start_ms, e.kind, e.stage, e.position) for e in result.events
                   if e.kind in (SEND_FORWARD_KIND, SEND_BACKWARD_KIND))
    assert sends == [(1.0, SEND_FORWARD_KIND, 0, 0), (2.5, SEND_FORWARD_KIND, 1, 1),
                     (4.0, SEND_FORWARD_KIND, 2, 0), (7.5, SEND_BACKWARD_KIND, 2, 1),
                     (10.0, SEND_BACKWARD_KIND, 1, 0), (12.5, SEND_BACKWARD_KIND, 0, 1)]
    assert [(s.chunks, s.busy_ms, s.idle_ms) for s in result.stages] == [([0, 2], 6.0, 9.0),
                                                                         ([1, 3], 6.0, 9.0)]
    assert result.num_boundaries == 3


@pytest.mark.parametrize("name,v,S,M", [(n, v, S, M) for n, v in
                                        [("gpipe", None), ("1f1b", None), ("zb-h1", None),
                                         ("interleaved", 2), ("interleaved", 3)]
                                        for S, M in itertools.product([1, 2, 3, 5], [1, 3, 8])])
def test_timed_peaks_equal_the_peaks_of_the_lists(name, v, S, M):
    # Two implementations: the simulator's step functions over time, and the prefix maxima of
    # each list (planner.schedules.memory). Costs uneven on purpose.
    schedule = build_schedule(name, S, M, virtual_stages=v)
    C = schedule.num_chunks
    held_bytes = [3.0 + c for c in range(C)]
    weight_bytes = [1.0 + c % 2 for c in range(C)]
    costs = PipelineCosts([1.0 + (c % 3) / 2 for c in range(C)], [2.0 + c % 2 for c in range(C)],
                          [0.25] * (C - 1), [0.5] * (C - 1), [0.0] * C,
                          activation_bytes=held_bytes, weight_gradient_bytes=weight_bytes)
    result = simulate(schedule, costs)
    held, awaiting = peak_counts(schedule)
    assert [s.peak_held_micro_batches for s in result.stages] == held
    assert [s.peak_awaiting_weight_micro_batches for s in result.stages] == awaiting
    assert [s.peak_held_bytes for s in result.stages] == pytest.approx(
        peak_bytes(schedule, held_bytes, weight_bytes))
