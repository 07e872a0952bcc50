"""`two_stage_bound.two_stage_floor`, the lower bound that lets the paper space skip the
two-stage search when the straight pipeline's plan is faster: on random profiles and
topologies it is never above the latency of any plan of at most two stages, enumerated here
(every M, cut, replica count and placement, memory respected), and `plan_dapple` returns the
plan it returns with the straight search on its own (`bound_straight=False`, the former path)
on instances of the shared generator, where the straight search goes first."""
import collections
import itertools
import math
import random

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan, Stage
from planner.search import plan_space
from planner.search.placement import assign_devices
from planner.search.plan_finishing import micro_batch_choices
from planner.search.two_stage_bound import two_stage_floor
from tests.planner.search.random_plan_instances import plan_instances
from tests.planner.search.test_bounded_straight import plan_text
from tests.planner.search.test_search_optimal import placements, random_profile
from tests.planner.search.test_search_oracle import random_topology


def two_stage_latencies(profile, topo, gbs, even_slices, transfers="async"):
    """The latency of every plan of one or two stages that fits (`evaluate`)."""
    N, G = profile.num_layers, topo.num_devices
    min_slice = cm.minimum_slice(profile, topo, gbs)
    for M in micro_batch_choices(gbs):
        mb = gbs // M
        model = cm.StageModel(profile, topo, gbs, M)
        for S in (1, 2):
            for cuts in itertools.combinations(range(1, N), S - 1):
                bounds = list(zip((0,) + cuts, [c - 1 for c in cuts] + [N - 1]))
                for seq in set(map(tuple, placements(tuple(topo.devices_per_host),
                                                     (0,) * topo.num_hosts, None, S))):
                    devices = assign_devices(topo, seq)
                    if any(mb // len(d) < min_slice or (even_slices and mb % len(d))
                           for d in devices):
                        continue
                    if any(model.max_in_flight(a, b, len(d)) < 1
                           for (a, b), d in zip(bounds, devices)):
                        continue
                    plan = Plan(stages=[Stage([a, b], d) for (a, b), d in zip(bounds, devices)],
                                micro_batches=M, global_batch_size=gbs, transfers=transfers)
                    yield cm.evaluate(plan, profile, topo).latency_ms


@pytest.mark.parametrize("transfers", ["async", "tensorflow"])
def test_never_above_a_two_stage_plan(transfers):
    """Also on a TensorFlow cluster, whose exchange of replica gradients costs less on an
    uneven placement than on an even one (the ring's bound takes the even one)."""
    rng = random.Random(2930)
    checked = close = 0
    for _ in range(30):
        profile = random_profile(rng, rng.randrange(2, 9))
        topo = random_topology(rng, rng.choice([(2, 2), (4,), (2, 1, 1), (3,), (2, 2, 2),
                                                (1, 1, 1)]))
        gbs = rng.choice([16, 32, 64])
        even = rng.random() < 0.25
        latencies = list(two_stage_latencies(profile, topo, gbs, even, transfers))
        if not latencies:
            continue
        least = min(latencies)
        floor = two_stage_floor(profile, topo, gbs, micro_batch_choices(gbs),
                                cm.minimum_slice(profile, topo, gbs), even, transfers)
        assert floor <= least * (1 + 1e-9), (floor, least)
        checked += 1
        close += floor > 0.95 * least     # and it is not trivial
    assert checked >= 25 and close >= checked // 3, (checked, close)


def test_same_plans_with_the_straight_search_first(monkeypatch):
    ways, original = collections.Counter(), plan_space.two_stage_floor

    def spy(*args):
        out = original(*args)
        ways["floor"] += 1
        return out
    searched = []

    def search_spy(*args):
        searched.append((args[4], args[9] if len(args) > 9 else math.inf))
        return original_search(*args)
    original_search = plan_space._search
    monkeypatch.setattr(plan_space, "two_stage_floor", spy)
    monkeypatch.setattr(plan_space, "_search", search_spy)
    rng = random.Random(3030)
    for profile, topo, gbs, budget, even in plan_instances(rng, 60):
        searched.clear()
        first = plan_text(profile, topo, gbs, budget, even, True)
        if searched and searched[0][0] == [1]:
            two_stage = [below for sizes, below in searched if sizes != [1]]
            ways["straight first, two stages skipped" if not two_stage
                 else "straight first, two stages below it"] += 1
        assert first == plan_text(profile, topo, gbs, budget, even, False), (gbs, budget)
    assert ways["straight first, two stages skipped"] >= 3, ways
    assert ways["straight first, two stages below it"] >= 3, ways
