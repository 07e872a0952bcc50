"""The simulator against hand-computed timelines (DAPPLE Fig. 3/4 style), never against itself.

Reference values: a uniform pipeline of p stages and m micro-batches without communication
takes (m+p-1)(F+B) under GPipe and under early backward (the paper's claim that early backward
adds no bubbles, §III-B); peak held micro-batches are m (GPipe) and min(p-s, m) (policy A);
small pipelines with transfers and allreduce are worked out by hand in the comments.
"""
import json

import pytest

from planner.estimate.pipeline_costs import PipelineCosts
from planner.formats.plan import Plan, straight_plan
from planner.schedules.actions import Action, Schedule, ScheduleError
from planner.schedules.replay import replay
from planner.schedules.by_name import pipeline_schedule
from planner.estimate.simulator import (ALLREDUCE_KIND, BACKWARD_KIND, FORWARD_KIND, SEND_BACKWARD_KIND,
                               SEND_FORWARD_KIND, simulate, simulate_plan)


def uniform_costs(p, forward=1.0, backward=2.0, send_forward=0.0, send_backward=0.0,
                  allreduce=None, activation_bytes=100.0):
    return PipelineCosts(forward_ms=[forward] * p, backward_ms=[backward] * p,
                         send_forward_ms=[send_forward] * (p - 1),
                         send_backward_ms=[send_backward] * (p - 1),
                         allreduce_ms=list(allreduce) if allreduce else [0.0] * p,
                         activation_bytes=[activation_bytes] * p)


def timeline(result, stage, kinds=(FORWARD_KIND, BACKWARD_KIND)):
    return [(e.kind[0].upper(), e.micro_batch, e.start_ms, e.end_ms)
            for e in result.events if e.stage == stage and e.kind in kinds]


# ---- uniform stages, no communication -------------------------------------------------------
@pytest.mark.parametrize("policy", ["gpipe", "A", "B"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (5, 3),
                                 (8, 16)])
def test_uniform_pipeline_takes_m_plus_p_minus_1_times_f_plus_b(policy, p, m):
    F, B = 1.5, 2.5
    result = simulate(pipeline_schedule(p, m, policy), uniform_costs(p, F, B))
    assert result.iteration_ms == pytest.approx((m + p - 1) * (F + B))
    for s in result.stages:
        assert s.busy_ms == pytest.approx(m * (F + B))
        assert s.idle_ms == pytest.approx((p - 1) * (F + B))
        assert s.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (4, 4), (4, 2), (4, 9), (6, 3)])
def test_peak_held_micro_batches_gpipe_holds_all(p, m):
    result = simulate(pipeline_schedule(p, m, "gpipe"), uniform_costs(p, activation_bytes=7.0))
    assert [s.peak_held_micro_batches for s in result.stages] == [m] * p
    assert [s.peak_held_bytes for s in result.stages] == [7.0 * m] * p


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (4, 4), (4, 2), (4, 9), (6, 3)])
def test_peak_held_micro_batches_policy_a_is_min_p_minus_s_and_m(p, m):
    result = simulate(pipeline_schedule(p, m, "A"), uniform_costs(p))
    assert [s.peak_held_micro_batches for s in result.stages] == [min(p - s, m) for s in range(p)]


def test_held_activations_over_time_on_first_stage():
    # p=2, m=3, F=1, B=2, policy A: stage 0 runs F0[0,1] F1[1,2] B0[4,6] F2[6,7] B1[7,9]
    # (stage 1: F0[1,2] B0[2,4] F1[4,5] B1[5,7] F2[7,8] B2[8,10]), B2[10,12].
    result = simulate(pipeline_schedule(2, 3, "A"), uniform_costs(2))
    assert timeline(result, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6),
                                   ("F", 2, 6, 7), ("B", 1, 7, 9), ("B", 2, 10, 12)]
    # held: 1 from 0, 2 from 1, B0 ends at 6 and F2 starts at 6 (stays 2), 1 at 9, 0 at 12.
    assert result.held_over_time(0) == [(0.0, 1), (1.0, 2), (6.0, 2), (9.0, 1), (12.0, 0)]
    gpipe = simulate(pipeline_schedule(2, 3, "gpipe"), uniform_costs(2))
    assert max(c for _, c in gpipe.held_over_time(0)) == 3


# ---- against the unit-time replay of planner.schedules.by_name (an independent implementation) -------
@pytest.mark.parametrize("policy", ["gpipe", "A", "B"])
@pytest.mark.parametrize("p,m", [(3, 5), (4, 2), (5, 8)])
def test_unit_durations_reproduce_the_unit_time_replay(policy, p, m):
    schedule = pipeline_schedule(p, m, policy)
    order = [(s, a) for s, a in replay(schedule).order if a.is_compute]
    result = simulate(schedule, uniform_costs(p, 1.0, 1.0))
    starts = {(e.stage, Action(e.stage, e.kind[0].upper(), e.micro_batch)): e.start_ms
              for e in result.events if e.kind in (FORWARD_KIND, BACKWARD_KIND)}
    # replay runs every ready task of a step together, in stage order; with unit durations
    # and free transfers, step k is time k here, so start order must equal replay order.
    sim_order = sorted(starts, key=lambda k: (starts[k], k[0]))
    assert sim_order == order


# ---- hand-computed pipelines with transfers and allreduce -----------------------------------
def test_two_stages_with_transfers_and_allreduce_by_hand():
    # F=1, B=2 on both stages; sends 0.5 ms each way; M=2, policy A (K = [2, 1]);
    # allreduce 3 ms on stage 0, 1 ms on stage 1.
    # stage 0: F0[0,1] F1[1,2];         send F0 [1,1.5], send F1 [2,2.5]
    # stage 1: F0[1.5,2.5] B0[2.5,4.5] F1[4.5,5.5] B1[5.5,7.5]; send B0 [4.5,5], B1 [7.5,8]
    # stage 0: B0[5,7] B1[8,10], allreduce [10,13];  stage 1 allreduce [7.5,8.5]
    costs = uniform_costs(2, 1.0, 2.0, 0.5, 0.5, allreduce=[3.0, 1.0])
    result = simulate(pipeline_schedule(2, 2, "A"), costs)
    assert timeline(result, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 5, 7),
                                   ("B", 1, 8, 10)]
    assert timeline(result, 1) == [("F", 0, 1.5, 2.5), ("B", 0, 2.5, 4.5), ("F", 1, 4.5, 5.5),
                                   ("B", 1, 5.5, 7.5)]
    sends = [(e.kind, e.micro_batch, e.start_ms, e.end_ms) for e in result.link_events(0)]
    assert sends == [(SEND_FORWARD_KIND, 0, 1, 1.5), (SEND_FORWARD_KIND, 1, 2, 2.5),
                     (SEND_BACKWARD_KIND, 0, 4.5, 5), (SEND_BACKWARD_KIND, 1, 7.5, 8)]
    allreduces = [(e.stage, e.start_ms, e.end_ms) for e in result.events
                  if e.kind == ALLREDUCE_KIND]
    assert sorted(allreduces) == [(0, 10, 13), (1, 7.5, 8.5)]
    assert result.iteration_ms == 13
    assert [s.busy_ms for s in result.stages] == [6, 6]
    assert [s.idle_ms for s in result.stages] == [13 - 6 - 3, 13 - 6 - 1]
    assert [s.end_ms for s in result.stages] == [13, 8.5]


def test_transfers_on_one_link_run_one_at_a_time():
    # GPipe, 2 stages, M=2, F=1, B=1, send forward 2 ms: stage 0 F0[0,1] F1[1,2];
    # send F0 [1,3], send F1 ready at 2 but the link is busy until 3 -> [3,5].
    costs = uniform_costs(2, 1.0, 1.0, send_forward=2.0)
    result = simulate(pipeline_schedule(2, 2, "gpipe"), costs)
    forward_sends = [(e.micro_batch, e.start_ms, e.end_ms) for e in result.link_events(0)
                     if e.kind == SEND_FORWARD_KIND]
    assert forward_sends == [(0, 1, 3), (1, 3, 5)]
    assert timeline(result, 1)[:2] == [("F", 0, 3, 4), ("F", 1, 5, 6)]


def test_half_duplex_link_shares_one_channel_between_directions():
    # 2 stages, M=3, policy A (K=[2,1]), F=B=1, send forward 1 ms, send backward 3 ms.
    # Full duplex: sF0[1,2] sF1[2,3]; s1 F0[2,3] B0[3,4] F1[4,5] B1[5,6]; sB0[4,7];
    #   s0 B0[7,8] F2[8,9]; sB1 ready 6, channel busy to 7 -> [7,10]; sF2[9,10];
    #   s1 F2[10,11] B2[11,12]; sB2[12,15]; s0 B1[10,11] B2[15,16] -> 16 ms.
    # Half duplex: sF2 ready at 9 waits for sB1 to free the link at 10 -> [10,11];
    #   s1 F2[11,12] B2[12,13]; sB2[13,16]; s0 B2[16,17] -> 17 ms.
    costs = uniform_costs(2, 1.0, 1.0, send_forward=1.0, send_backward=3.0)
    schedule = pipeline_schedule(2, 3, "A")
    full = simulate(schedule, costs, link_duplex="full")
    half = simulate(schedule, costs, link_duplex="half")
    assert full.iteration_ms == 16
    assert half.iteration_ms == 17
    assert [(e.kind, e.micro_batch, e.start_ms) for e in half.link_events(0)] == [
        (SEND_FORWARD_KIND, 0, 1), (SEND_FORWARD_KIND, 1, 2), (SEND_BACKWARD_KIND, 0, 4),
        (SEND_BACKWARD_KIND, 1, 7), (SEND_FORWARD_KIND, 2, 10), (SEND_BACKWARD_KIND, 2, 13)]


def test_serial_links_give_a_position_one_transfer_at_a_time():
    # 3 stages, M=2, policy A, F=B=1, send forward 2 ms, send backward 1 ms.
    # Full duplex: s0 F0[0,1] F1[1,2]; sF0 0->1 [1,3], sF1 [3,5]; s1 F0[3,4] F1[5,6];
    #   sF0 1->2 [4,6], sF1 [6,8]; s2 F0[6,7] B0[7,8] F1[8,9] B1[9,10]; sB0 2->1 [8,9],
    #   sB1 [10,11]; s1 B0[9,10] B1[11,12]; sB0 1->0 [10,11], sB1 [12,13];
    #   s0 B0[11,12] B1[13,14] -> 14 ms.
    # Serial: stage 1 is receiving sF1 until 5, so its sF0 1->2 waits: [5,7]; sF1 1->2 [7,9];
    #   s2 F0[7,8] B0[8,9] F1[9,10] B1[10,11]; sB0 2->1 [9,10]; s1 B0[10,11]; at 11 both
    #   sB0 1->0 and sB1 2->1 are ready: stage 1's (sent first) [11,12], then sB1 [12,13];
    #   s1 B1[13,14]; sB1 1->0 [14,15]; s0 B0[12,13] B1[15,16] -> 16 ms.
    costs = uniform_costs(3, 1.0, 1.0, send_forward=2.0, send_backward=1.0)
    schedule = pipeline_schedule(3, 2, "A")
    assert simulate(schedule, costs, link_duplex="full").iteration_ms == 14
    serial = simulate(schedule, costs, link_duplex="serial")
    assert serial.iteration_ms == 16
    assert [(e.kind, e.micro_batch, e.start_ms) for e in serial.link_events(1)] == [
        (SEND_FORWARD_KIND, 0, 5), (SEND_FORWARD_KIND, 1, 7), (SEND_BACKWARD_KIND, 0, 9),
        (SEND_BACKWARD_KIND, 1, 12)]
    assert timeline(serial, 0)[-1] == ("B", 1, 15, 16)


def test_horovod_transfers_are_serial_and_rendezvous():
    # The serial example above with rendezvous too (a transfer starts when its receiver has
    # posted the receive, i.e. finished the action before it):
    #   sF0 0->1 [1,3]; s1 F0[3,4], posts RECV_F1 at 4; at 4 sF1 0->1 (sent at 2) goes first,
    #   [4,6], then sF0 1->2 [6,8]; s1 F1[6,7], posts RECV_B0 at 7; s2 F0[8,9] B0[9,10],
    #   posts RECV_F1 at 10; at 10 sF1 1->2 (sent at 7) [10,12], then sB0 2->1 [12,13];
    #   s2 F1[12,13] B1[13,14]; s1 B0[13,14]; at 14 sB0 1->0 (stage 1 sends first) [14,15],
    #   sB1 2->1 [15,16]; s1 B1[16,17]; sB1 1->0 [17,18]; s0 B0[15,16] B1[18,19] -> 19 ms.
    costs = uniform_costs(3, 1.0, 1.0, send_forward=2.0, send_backward=1.0)
    result = simulate(pipeline_schedule(3, 2, "A"), costs, link_duplex="serial",
                      rendezvous=True)
    assert result.iteration_ms == 19
    assert timeline(result, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 15, 16),
                                   ("B", 1, 18, 19)]
    assert timeline(result, 1) == [("F", 0, 3, 4), ("F", 1, 6, 7), ("B", 0, 13, 14),
                                   ("B", 1, 16, 17)]
    # A plan made for horovodrun is simulated so by default; others as before.
    plan = straight_plan([1, 2], num_layers=3, micro_batches=2)
    assert simulate_plan(plan, costs).iteration_ms == 14
    plan.transfers = "horovod"
    assert simulate_plan(plan, costs).iteration_ms == 19
    assert simulate_plan(plan, costs, link_duplex="full", rendezvous=False).iteration_ms == 14
    # TensorFlow's Send/Recv between processes is buffered and full duplex: 14, as computed
    # by hand in the example above; the plan keeps its transfers through JSON.
    plan.transfers = "tensorflow"
    assert simulate_plan(Plan.from_json(plan.to_json()), costs).iteration_ms == 14


def test_allreduce_of_last_stage_overlaps_the_drain_of_earlier_stages():
    # p=3, m=2, F=1, B=1, no transfers. Compute ends at (m+p-1)(F+B) = 8 on stage 0; the last
    # stage's last backward ends (p-1)*B = 2 earlier, at 6. Its 1.5 ms allreduce ends at 7.5,
    # hidden; a 4 ms allreduce ends at 10.
    schedule = pipeline_schedule(3, 2, "A")
    hidden = simulate(schedule, uniform_costs(3, 1.0, 1.0, allreduce=[0, 0, 1.5]))
    assert hidden.iteration_ms == 8
    assert hidden.stages[2].end_ms == 7.5
    exposed = simulate(schedule, uniform_costs(3, 1.0, 1.0, allreduce=[0, 0, 4.0]))
    assert exposed.iteration_ms == 10
    first = simulate(schedule, uniform_costs(3, 1.0, 1.0, allreduce=[1.5, 0, 0]))
    assert first.iteration_ms == 9.5


def test_unbalanced_stages_show_bubbles_inside_the_slow_stage():
    # Stage 1 is the bottleneck (F=2, B=4); stage 0 has F=1, B=2. M=3, GPipe, no transfers.
    # stage 0: F0[0,1] F1[1,2] F2[2,3]; stage 1: F0[1,3] F1[3,5] F2[5,7] B2? no: GPipe runs
    # B0 first: B0[7,11] B1[11,15] B2[15,19]; stage 0: B0[11,13] B1[15,17] B2[19,21].
    costs = PipelineCosts([1.0, 2.0], [2.0, 4.0], [0.0], [0.0], [0.0, 0.0])
    result = simulate(pipeline_schedule(2, 3, "gpipe"), costs)
    assert timeline(result, 1) == [("F", 0, 1, 3), ("F", 1, 3, 5), ("F", 2, 5, 7),
                                   ("B", 0, 7, 11), ("B", 1, 11, 15), ("B", 2, 15, 19)]
    assert result.iteration_ms == 21
    assert result.stages[1].idle_ms == 21 - 18
    assert result.stages[0].idle_ms == 21 - 9


# ---- deadlocks are reported, naming the actions ---------------------------------------------
def test_missing_action_is_refused_naming_it():
    schedule = Schedule.parse("""
        0: 0F0 0F1 0B0 0F2 0B1 0B2
        1: 1F0 1B0 1F1 1F2 1B2""")
    with pytest.raises(ScheduleError, match=r"chunk 1 must run F and B.*missing \['1B1'\]"):
        simulate(schedule, uniform_costs(2))


def test_wait_cycle_is_reported_as_deadlock_naming_both_actions():
    # Stage 0 warms up 1 deep but stage 1 two deep (K_0 < K_1): stage 0 waits at B0 for
    # stage 1's B0, which waits behind F1, which needs stage 0's F1, queued after B0.
    schedule = Schedule.parse("""
        0: 0F0 0B0 0F1 0B1
        1: 1F0 1F1 1B0 1B1""")
    with pytest.raises(ScheduleError) as info:
        simulate(schedule, uniform_costs(2))
    message = str(info.value)
    assert "position 0 at 0RECV_B0 waits for 1SEND_B0 on position 1 (stuck at 1RECV_F1)" \
        in message
    assert "position 1 at 1RECV_F1 waits for 0SEND_F1 on position 0 (stuck at 0RECV_B0)" \
        in message


def test_backward_before_own_forward_is_a_deadlock():
    with pytest.raises(ScheduleError, match="its own 0F0, which comes later"):
        simulate(Schedule.parse("0: 0B0 0F0"), uniform_costs(1))


def test_repeated_action_is_refused():
    schedule = Schedule.parse("""
        0: 0F0 0F1 0B0 0B1
        1: 1F0 1B0 1F1 1B1 1F0""")
    with pytest.raises(ScheduleError, match=r"repeated \['1F0'\]"):
        simulate(schedule, uniform_costs(2))


def test_bad_costs_are_refused_clearly():
    with pytest.raises(ValueError, match="2 stages"):
        simulate(pipeline_schedule(3, 2, "A"), uniform_costs(2))
    bad = uniform_costs(2)
    bad.forward_ms[1] = -1.0
    with pytest.raises(ValueError, match=r"forward_ms\[1\] = -1.0"):
        simulate(pipeline_schedule(2, 2, "A"), bad)
    with pytest.raises(ValueError, match="link_duplex"):
        simulate(pipeline_schedule(2, 2, "A"), uniform_costs(2), link_duplex="simplex")


# ---- plans, determinism, JSON ---------------------------------------------------------------
def test_simulate_plan_uses_the_plans_schedule_and_warmup():
    plan = straight_plan([2, 4], num_layers=6, micro_batches=4, schedule="A")
    plan.warmup = [2, 2, 1]   # a memory limit D = 2 caps stage 0
    result = simulate_plan(plan, uniform_costs(3))
    assert [s.peak_held_micro_batches for s in result.stages] == [2, 2, 1]
    with pytest.raises(ValueError, match="plan has 3"):
        simulate_plan(plan, uniform_costs(2))


def test_simulation_is_deterministic_and_json_ready():
    costs = PipelineCosts([1.1, 0.7, 1.3], [2.2, 1.9, 2.1], [0.3, 0.4], [0.2, 0.5],
                          [0.9, 0.0, 2.0], [5.0, 6.0, 7.0])
    a = simulate(pipeline_schedule(3, 7, "B"), costs)
    b = simulate(pipeline_schedule(3, 7, "B"), costs)
    assert a.events == b.events and a.to_dict() == b.to_dict()
    d = json.loads(json.dumps(a.to_dict(with_timeline=True)))
    assert set(d["stages"][0]) >= {"busy_ms", "idle_ms", "bubble_fraction",
                                   "peak_held_micro_batches"}
    assert len(d["timeline"]) == 3 * 7 * 2 + 2 * 7 * 2 + 2


def test_rendezvous_transfers_wait_for_the_receive_to_be_posted():
    # The hand example above (F=1, B=2, sends 0.5, M=2, policy A) with rendezvous transfers:
    # stage 1 posts RECV_F1 only after SEND_B0, at 4.5, so send F1 runs [4.5,5], not [2,2.5];
    # stage 1: F0[1.5,2.5] B0[2.5,4.5] F1[5,6] B1[6,8]; send B0 [4.5,5] (posted at 2),
    # send B1 [8,8.5] (stage 0 posts RECV_B1 after B0, at 7); stage 0: B0[5,7] B1[8.5,10.5],
    # allreduce [10.5,13.5]; stage 1 allreduce [8,9].
    costs = uniform_costs(2, 1.0, 2.0, 0.5, 0.5, allreduce=[3.0, 1.0])
    result = simulate(pipeline_schedule(2, 2, "A"), costs, rendezvous=True)
    assert timeline(result, 1) == [("F", 0, 1.5, 2.5), ("B", 0, 2.5, 4.5), ("F", 1, 5, 6),
                                   ("B", 1, 6, 8)]
    assert timeline(result, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 5, 7),
                                   ("B", 1, 8.5, 10.5)]
    sends = [(e.kind, e.micro_batch, e.start_ms, e.end_ms) for e in result.link_events(0)]
    assert sends == [(SEND_FORWARD_KIND, 0, 1, 1.5), (SEND_FORWARD_KIND, 1, 4.5, 5),
                     (SEND_BACKWARD_KIND, 0, 4.5, 5), (SEND_BACKWARD_KIND, 1, 8, 8.5)]
    assert result.iteration_ms == 13.5
    assert simulate(pipeline_schedule(2, 2, "A"), costs).iteration_ms == 13   # not by default


@pytest.mark.parametrize("enabled", [True, False])
def test_no_cycle_collection_runs_during_a_simulation_and_the_collector_is_left_as_found(enabled):
    """A long schedule allocates tens of thousands of objects: collections then would traverse
    every live object for nothing (no event is in a cycle), a cost per action growing with M
    (before, 26 collections here)."""
    import gc
    collections = []

    def record(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    schedule = pipeline_schedule(8, 64, "B")
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    gc.collect()        # allocations before the call would not trigger one inside it
    gc.callbacks.append(record)
    try:
        result = simulate(schedule, uniform_costs(8))
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(record)
        (gc.enable if was else gc.disable)()
    assert len(result.events) > 1000
    # at most the one young collection its allocations trigger once the collector is back on
    assert collections in ([], [0])
