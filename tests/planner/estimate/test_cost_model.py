"""Cost model against hand-computed values: eq. 1 phases under our Te reading (and how the
literal Te differs), pivot choice, transfers, allreduce, memory, and bad plans."""
import json

import pytest

from planner.estimate import cost_model as cm
from tests.planner.estimate import reference_formulas as ref
from planner.estimate.latency import round_trip_phases
from planner.formats.plan import Plan, PlanError, Stage, straight_plan
from planner.formats.profile import parse_native_json
from topology import parse_topology


def test_phases_by_hand_last_stage_pivot():
    # Two computation stages and a transfer: F = [2, 1, 3], B = [4, 1, 6], AR = [5, 0, 0], M=4.
    F, B, AR = [2, 1, 3], [4, 1, 6], [5, 0, 0]
    Tw, Ts, Te, Q = ref.phases(F, B, AR, 4)
    assert Q == 2
    assert Tw == 6 and Ts == 3 * 9
    # Te: stage 0 finishes after B2 + B1 + B0 + AR0 = 6 + 1 + 4 + 5 = 16.
    assert Te == 16
    # Literal eq. 1 for s = Q would give AR_Q - B_Q = -6 for the pivot, and for s < Q the
    # same 16: here they agree on the max; for a pivot with a large allreduce they do not.
    assert ref.te_literal(B, AR, 2) == 16
    assert ref.te_literal(B, [0, 0, 10], 2) == 11        # 10 - 6 + ... vs ours 10 + 6
    assert ref.phases(F, B, [0, 0, 10], 4)[2] == 16


def test_pivot_moves_to_the_long_stage():
    F, B, AR = [10, 1, 1], [20, 1, 2], [0, 0, 0]
    Tw, Ts, Te, Q = ref.phases(F, B, AR, 8)
    assert Q == 0 and ref.pivot_stage_eq3(F, B, 8) == 0
    assert (Tw, Ts) == (10, 7 * 30)
    # Stage 2 after the pivot: its last backward ended before the pivot's: term AR2 + B0 - B1.
    assert Te == max(20, 0 + 20 - 1, 0 + 20 - 1 - 2)


def _profile():
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": 1.0 * (i + 1),
               "backward_ms": 2.0 * (i + 1), "output_bytes": 1e6, "parameter_bytes": 4e6,
               "inputs": [i - 1]} for i in range(4)]
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1, "name": "toy",
                                         "batch_size": 8, "layers": layers}))


def test_stage_times_with_overheads_by_hand():
    p, t = _profile(), parse_topology("1x2,mem=16GB")
    plan = straight_plan([2], 4, micro_batches=2, global_batch_size=16)
    c = cm.pipeline_costs(plan, p, t)
    H, TO = cm.SMALL_BATCH_HALF_SAMPLES, cm.TASK_OVERHEAD_MS
    scale = (8 + H) / (8 + H)              # micro-batch 8 = the profile batch
    assert c.forward_ms == pytest.approx([3 * scale + TO, 7 * scale + TO])
    assert c.backward_ms == pytest.approx([6 * scale + TO, 14 * scale + TO])
    # One host: the cut after layer 1 (1 MB at batch 8) moves at the in-host rate + latency.
    bw, lat = t.intra_host_bandwidth, t.intra_host_latency
    assert c.send_forward_ms[0] == pytest.approx(1e6 / bw * 1e3 + lat * 1e3)
    assert c.allreduce_ms == [0.0, 0.0]


def test_replicated_slices_and_allreduce_by_hand():
    p, t = _profile(), parse_topology("2x1,net=8Gbps,net_latency=0us")
    plan = Plan(stages=[Stage([0, 3], [0, 1])], micro_batches=1, global_batch_size=6)
    c = cm.pipeline_costs(plan, p, t)
    H, TO = cm.SMALL_BATCH_HALF_SAMPLES, cm.TASK_OVERHEAD_MS
    scale = (3 + H) / (8 + H)              # slice of 3 samples
    assert c.forward_ms[0] == pytest.approx(10 * scale + TO)
    # Ring over 2 hosts: 2 (1/2) 16 MB at 1 GB/s = 16 ms, all after the last backward (the
    # runtime's backward is one call per stage: nothing overlaps it).
    assert c.allreduce_ms[0] == pytest.approx(16.0)


def test_transfer_split_concat_host_nic():
    p, t = _profile(), parse_topology("2x2,net=8Gbps,net_latency=0us,nvlink=1000GB/s")
    model = cm.StageModel(p, t, 8, 1)
    # 2 senders on host 0 -> 1 receiver on host 1: all 8 MB leave host 0's NIC at 1 GB/s.
    assert model.transfer_ms(8e6, (2, 0), (0, 1)) == pytest.approx(8.0, rel=1e-3)
    # 1 sender on host 0 -> receivers one per host: half crosses.
    assert model.transfer_ms(8e6, (1, 0), (1, 1)) == pytest.approx(4.0, rel=1e-2)


def test_memory_per_device_by_hand():
    p, t = _profile(), parse_topology("1x2")
    plan = straight_plan([2], 4, micro_batches=2, global_batch_size=16)
    mem = cm.memory_per_device(plan, p, t, warmup=[2, 1])
    act = cm.ACTIVATION_MEMORY_FACTOR * 2e6      # two layers of 1 MB outputs at batch 8
    assert mem[0] == pytest.approx(cm.BYTES_PER_PARAMETER_FACTOR * 8e6
                                   + cm.DEVICE_RESERVED_BYTES + 2 * act)


def test_evaluate_rejects_bad_plans():
    p, t = _profile(), parse_topology("1x2")
    twice = Plan(stages=[Stage([0, 1], [0]), Stage([2, 3], [0])], micro_batches=1,
                 global_batch_size=4)
    with pytest.raises(PlanError, match="device 0 is used by stage 0 and stage 1"):
        cm.evaluate(twice, p, t)
    gap = Plan(stages=[Stage([0, 1], [0]), Stage([3, 3], [1])], micro_batches=1,
               global_batch_size=4)
    with pytest.raises(PlanError, match="leaves out layers 2..2"):
        cm.evaluate(gap, p, t)
    short = Plan(stages=[Stage([0, 2], [0]), Stage([3, 3], [1])], micro_batches=1,
                 global_batch_size=4)
    cm.evaluate(short, p, t)
    too_small = Plan(stages=[Stage([0, 3], [0, 1])], micro_batches=1, global_batch_size=1)
    with pytest.raises(PlanError, match="at least one sample"):
        cm.evaluate(too_small, p, t)


def test_round_trip_wait_by_hand():
    # Two stages, free transfers, F = [4, 1], B = [8, 2], M = 3, K = [1, 1] (memory allows one
    # micro-batch on stage 0): every micro-batch runs alone, F0 F1 B1 B0 = 15 ms, 45 ms in all.
    F, B, AR = [4, 0, 1], [8, 0, 2], [0, 0, 0]
    Tw, Ts, Te, Q = round_trip_phases(F, B, AR, 3, [1, 1])
    assert Q == 0 and Tw + Ts + Te == pytest.approx(45)
    assert Tw == 4 + 3                      # F0, then the wait for stage 1's F + B
    # Eq. 1 alone says 4 + 2 x 12 + 8 = 36: it assumes stage 0 never idles.
    assert sum(ref.phases(F, B, AR, 3)[:3]) == pytest.approx(36)
    # With K = [2, 1] stage 0 runs a second forward while the first goes round: the wait
    # shrinks to max(0, 3 - 4) = 0 and the period to max(12, 15 / 2) = 12: eq. 1 again.
    assert sum(round_trip_phases(F, B, AR, 3, [2, 1])[:3]) == pytest.approx(36)


def test_warmup_for_caps_by_memory_and_keeps_depths_non_increasing():
    from planner.estimate.pipeline_costs import PipelineCosts
    costs = PipelineCosts([1.0] * 3, [2.0] * 3, [0.0] * 2, [0.0] * 2, [0.0] * 3)
    assert cm.warmup_for(costs, [8, 8, 8], 8) == ("A", [3, 2, 1])     # ACR 0: policy A
    assert cm.warmup_for(costs, [1, 8, 0], 8) == ("A", [1, 1, 1])
    busy = PipelineCosts([1.0] * 3, [2.0] * 3, [1.0] * 2, [1.0] * 2, [0.0] * 3)
    assert cm.warmup_for(busy, [8, 8, 8], 8) == ("B", [5, 3, 1])      # ACR 2/3: policy B


def test_all_pivots_equals_the_direct_sums_for_every_pivot():
    """The O(S) prefix/suffix form of Te equals eq. 1's sums written out term by term."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        S = rng.randint(1, 25)
        F = [rng.random() * 5 for _ in range(S)]
        B = [rng.random() * 5 for _ in range(S)]
        AR = [rng.choice([0.0, rng.random() * 20]) for _ in range(S)]
        M = rng.randint(1, 16)
        for q, (tw, ts, te) in enumerate(ref.all_pivots(F, B, AR, M)):
            terms = [AR[s] + sum(B[s:q + 1]) for s in range(q + 1)]
            terms += [AR[s] + B[q] - sum(B[q + 1:s]) for s in range(q + 1, S)]
            assert tw == pytest.approx(sum(F[:q + 1]))
            assert ts == pytest.approx((M - 1) * (F[q] + B[q]))
            assert te == pytest.approx(max(terms))


def test_round_trip_phases_equals_the_per_pivot_definition():
    """The one-pass round-trip phases equal the definition pivot by pivot: eq. 1's terms of
    `latency_with_pivot`, plus the wait max(0, R_q - (K_q - 1) F_q) and the steady period
    max(F_q + B_q, (F_q + B_q + R_q) / K_q), maximized over q."""
    import random
    rng = random.Random(11)
    for _ in range(300):
        stages = rng.randint(1, 12)
        S = 2 * stages - 1
        F = [rng.random() * 5 for _ in range(S)]
        B = [rng.random() * 5 for _ in range(S)]
        AR = [0.0 if s % 2 else rng.choice([0.0, rng.random() * 20]) for s in range(S)]
        M = rng.randint(1, 16)
        K = [rng.randint(0, M) for _ in range(stages)]
        options = []
        for q in range(S):
            tw, ts, te = ref.latency_with_pivot(F, B, AR, M, q)
            k = max(1, K[q // 2])
            trip = sum(F[q + 1:]) + sum(B[q + 1:])
            tw += max(0.0, trip - (k - 1) * F[q])
            ts = (M - 1) * max(F[q] + B[q], (F[q] + B[q] + trip) / k)
            options.append((tw + ts + te, tw, ts, te, q))
        # Ties (common: with M = 1 several pivots lie on the same critical path) go to the
        # later stage, as eq. 3 moves the pivot only on a strict excess.
        top = max(o[0] for o in options)
        total, tw, ts, te, q = max((o for o in options if o[0] >= top - 1e-9 * max(1.0, top)),
                                   key=lambda o: o[4])
        Tw, Ts, Te, Q = round_trip_phases(F, B, AR, M, K)
        assert Tw + Ts + Te == pytest.approx(total)
        assert (Tw, Ts, Te, Q) == pytest.approx((tw, ts, te, q))
