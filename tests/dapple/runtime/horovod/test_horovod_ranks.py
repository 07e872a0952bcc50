"""Rank layout and boundary transfers as plain data, checked without Horovod: simulating an
alltoall with the computed splits must hand every receiving replica exactly its even share of
the micro-batch (numpy's array_split is the reference), for split, concat, both, and equal
replica counts, including a hand-written plan whose devices are not in replica order."""
import numpy as np
import pytest

from dapple.runtime.horovod.ranks import RankLayout, WorldSizeError
from planner.formats.plan import Plan, Stage, straight_plan


def simulate_alltoall(layout, sender_stage, receiver_stage, rows):
    """Every sender replica's share of a micro-batch of `rows` rows, moved with the computed
    splits; returns what each receiver replica holds after reordering, by replica."""
    micro_batch = np.arange(rows)
    senders = layout.plan.stages[sender_stage]
    receivers = layout.plan.stages[receiver_stage]
    shares = np.array_split(micro_batch, senders.replicas)
    boundary = min(sender_stage, receiver_stage)
    set_ranks = layout.boundary_ranks(boundary)
    inbox = {r: [] for r in set_ranks}          # in sender-rank order, as alltoall delivers
    for rank in sorted(senders.devices):
        k = senders.devices.index(rank)
        splits = layout.send_splits(sender_stage, k, receiver_stage, rows)
        assert len(splits) == len(set_ranks) and sum(splits) == len(shares[k])
        ordered = np.concatenate([shares[k][lo:hi] for lo, hi in
                                  layout.send_row_order(sender_stage, k, receiver_stage, rows)])
        offset = 0
        for dest, n in zip(set_ranks, splits):
            inbox[dest].append(ordered[offset:offset + n])
            offset += n
    got = {}
    for j, rank in enumerate(receivers.devices):
        arrived = [p for p in inbox[rank] if len(p)]
        pieces = layout.received_pieces(sender_stage, receiver_stage, j, rows)
        assert [p.rows for p in pieces] == [len(a) for a in arrived]
        order = sorted(range(len(pieces)), key=lambda i: pieces[i].sender_replica)
        got[j] = np.concatenate([arrived[i] for i in order])
    return got


@pytest.mark.parametrize("replicas", [[1, 1], [2, 1], [1, 2], [2, 2], [2, 3], [3, 2], [4, 2],
                                      [1, 2, 1]])
def test_every_receiver_gets_its_even_share(replicas):
    plan = straight_plan(list(range(1, len(replicas))), len(replicas), 1, replicas=replicas)
    layout = RankLayout(plan, plan.num_devices)
    rows = 12
    for s in range(len(replicas) - 1):
        for a, b in ((s, s + 1), (s + 1, s)):           # activations, then gradients
            got = simulate_alltoall(layout, a, b, rows)
            want = np.array_split(np.arange(rows), replicas[b])
            for j in range(replicas[b]):
                np.testing.assert_array_equal(got[j], want[j])


def test_devices_out_of_replica_order():
    plan = Plan(stages=[Stage([0, 0], [2, 0]), Stage([1, 1], [1])], micro_batches=1).validate()
    layout = RankLayout(plan, 3)
    assert layout.unit(2) == (0, 0) and layout.unit(0) == (0, 1)
    got = simulate_alltoall(layout, 0, 1, 8)
    np.testing.assert_array_equal(got[0], np.arange(8))
    got = simulate_alltoall(layout, 1, 0, 8)
    np.testing.assert_array_equal(got[0], np.arange(4))
    np.testing.assert_array_equal(got[1], np.arange(4, 8))


def test_process_sets_once_each_and_never_the_global_one():
    layout = RankLayout(straight_plan([1, 2], 3, 1, replicas=[2, 2, 1]), 5)
    assert layout.process_sets() == [[0, 1], [2, 3], [0, 1, 2, 3], [2, 3, 4]]
    dp = RankLayout(straight_plan([], 1, 1, replicas=[4]), 4)
    assert dp.process_sets() == []            # the stage's set is the global set
    two = RankLayout(straight_plan([1], 2, 1, replicas=[1, 1]), 2)
    assert two.process_sets() == []           # the boundary's set is the global set


def test_world_size_must_match_the_plan():
    plan = straight_plan([1], 2, 1, replicas=[2, 2])
    with pytest.raises(WorldSizeError, match="plan uses 4 devices but Horovod runs 3 processes"):
        RankLayout(plan, 3)
    gap = Plan(stages=[Stage([0, 0], [0]), Stage([1, 1], [2])], micro_batches=1).validate()
    with pytest.raises(WorldSizeError, match=r"devices 0..1"):
        RankLayout(gap, 2)


def test_an_interleaved_group_rank_runs_all_its_chunks():
    """4 chunks on 2 groups of 2 and 1 devices: ranks 0 and 1 run chunks 0 and 2, rank 2
    runs chunks 1 and 3 (hand-listed); the world is 3 ranks, not the 6 chunk-device pairs."""
    from planner.search.chunking import interleaved_plan
    layout = RankLayout(interleaved_plan([1, 2, 3], 5, 2, 2, 24, [2, 1]), 3)
    assert [layout.units(r) for r in range(3)] == [[(0, 0), (2, 0)], [(0, 1), (2, 1)],
                                                   [(1, 0), (3, 0)]]
    assert [layout.unit(r) for r in range(3)] == [(0, 0), (0, 1), (1, 0)]
    assert layout.ranks_of_stages([0, 2]) == [0, 1]
    assert layout.boundary_ranks(1) == [0, 1, 2]     # chunk 1 (group 1) -> chunk 2 (group 0)
    single = RankLayout(interleaved_plan([2], 5, 2, 2, 24, [2]), 2)    # one group of 2
    assert single.boundary_ranks(0) == [0, 1] and single.process_sets() == []
    with pytest.raises(WorldSizeError, match="uses 3 devices but Horovod runs 6"):
        RankLayout(interleaved_plan([1, 2, 3], 5, 2, 2, 24, [2, 1]), 6)
