"""The search against brute force: on random small instances (up to 8 layers, up to 2 hosts x 2
devices) plan_dapple's latency equals the minimum of `evaluate` over every plan of the same
space, enumerated here independently: every cut of the layers, every sequence of placements
(fresh / append / scatter) using all devices, every micro-batch count, memory respected. Both
plan spaces: "full" (any number of stages) and "paper" (one or two stages, or one device a
stage on every device; the full space when nothing there fits)."""
import dataclasses
import itertools
import json
import math
import random

import pytest

from planner.estimate import cost_model as cm
from planner.search.placement import POLICIES, assign_devices, place
from planner.formats.plan import Plan, Stage
from planner.formats.profile import parse_native_json
from planner.formats.plan import PlanError
from planner.search.baselines import best_data_parallel_plan
from planner.search.exact_search import SearchStats
from planner.search.plan_space import plan_dapple
from topology.model import Topology


def random_profile(rng, n, input_bytes=1e5):
    layers = []
    for i in range(n):
        layers.append({"name": f"l{i}", "type": "X",
                       "forward_ms": rng.uniform(0.1, 5), "backward_ms": rng.uniform(0.1, 10),
                       "output_bytes": rng.choice([1e5, 1e6, 2e7, 1e8]),
                       "parameter_bytes": rng.choice([0, 1e6, 5e7, 3e8]),
                       "inputs": sorted({i - 1, rng.randrange(-1, i)}) if i else [-1]})
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1,
                                         "name": "rand", "batch_size": rng.choice([1, 4, 8]),
                                         "input_bytes": input_bytes, "layers": layers}))


def random_topology(rng):
    hosts = rng.choice([(1,), (2,), (1, 1), (2, 2), (2, 1)])
    return Topology(devices_per_host=hosts, device_memory_bytes=rng.choice([2e9, 8e9, 64e9]),
                    intra_host_bandwidth=rng.choice([10e9, 100e9]),
                    inter_host_bandwidth=rng.choice([1e9, 3e9]),
                    intra_host_latency=1e-5, inter_host_latency=5e-5)


def placements(capacity, used, remaining_devices, stages_left):
    """Every sequence of host-count vectors for `stages_left` stages using all devices."""
    free = sum(capacity) - sum(used)
    if stages_left == 1:
        for policy in POLICIES:
            counts = place(policy, capacity, used, free)
            if counts is not None:
                yield [counts]
        return
    for m in range(1, free - stages_left + 2):
        for policy in POLICIES:
            counts = place(policy, capacity, used, m)
            if counts is None:
                continue
            new_used = tuple(u + c for u, c in zip(used, counts))
            for rest in placements(capacity, new_used, None, stages_left - 1):
                yield [counts] + rest


def in_paper_space(stages, num_devices):
    return stages <= 2 or stages == num_devices


def brute_force(profile, topo, gbs, even_slices=False, plan_space="full", transfers="async"):
    """The least latency over the plan space (None if no plan fits), its plans' transfers
    `transfers`; "paper" falls back to the full space when nothing in it fits, as plan_dapple
    does."""
    N, G = profile.num_layers, topo.num_devices
    # The plan space's micro-batch rule, restated: a replica's slice is at least the profile
    # batch, or gbs // G when the global batch cannot give every device that much.
    min_slice = max(1, min(math.ceil(profile.batch_size), gbs // G))
    best = None
    for M in [m for m in range(1, gbs + 1) if gbs % m == 0]:
        mb = gbs // M
        for S in range(1, min(N, G) + 1):
            if plan_space == "paper" and not in_paper_space(S, G):
                continue
            for cuts in itertools.combinations(range(1, N), S - 1):
                bounds = list(zip((0,) + cuts, [c - 1 for c in cuts] + [N - 1]))
                for seq in set(map(tuple, placements(tuple(topo.devices_per_host),
                                                     (0,) * topo.num_hosts, None, S))):
                    devices = assign_devices(topo, seq)
                    if any(mb // len(d) < min_slice for d in devices):
                        continue
                    if even_slices and any(mb % len(d) for d in devices):
                        continue
                    plan = Plan(stages=[Stage([a, b], d) for (a, b), d in zip(bounds, devices)],
                                micro_batches=M, global_batch_size=gbs, transfers=transfers)
                    model = cm.StageModel(profile, topo, gbs, M)
                    if any(model.max_in_flight(a, b, len(d)) < 1
                           for (a, b), d in zip(bounds, devices)):
                        continue
                    lat = cm.evaluate(plan, profile, topo).latency_ms
                    if best is None or lat < best:
                        best = lat
    if best is None and plan_space == "paper":
        return brute_force(profile, topo, gbs, even_slices, "full", transfers)
    return best


@pytest.mark.parametrize("plan_space", ["full", "paper"])
@pytest.mark.parametrize("seed", range(30))
def test_search_matches_brute_force(seed, plan_space):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(2, 8 if seed % 3 == 0 else 5))
    topo = random_topology(rng)
    gbs = rng.choice([4, 8, 12, 24])
    even = seed % 4 == 1
    expected = brute_force(profile, topo, gbs, even_slices=even, plan_space=plan_space)
    if expected is None:
        with pytest.raises(PlanError):
            plan_dapple(profile, topo, gbs, even_slices=even, plan_space=plan_space)
        return
    stats = SearchStats()
    plan = plan_dapple(profile, topo, gbs, max_candidates=None, stats=stats, even_slices=even,
                       plan_space=plan_space)
    assert stats.complete
    assert plan.estimate.latency_ms == pytest.approx(expected, rel=1e-9)
    if even:
        assert all(len(set(plan.slice_sizes(i))) == 1 for i in range(plan.num_stages))


@pytest.mark.parametrize("plan_space", ["full", "paper"])
@pytest.mark.parametrize("seed", range(30))
def test_search_on_a_tensorflow_cluster_matches_brute_force(seed, plan_space):
    """On a TensorFlow cluster a first stage's replicas off the chief wait for their rows
    (`cost_model.StageModel.fed_rows_ms`) and replicas exchange their gradients
    (`StageModel.allreduce_rate`): with rows large enough to change which plan wins, the
    search's plan is still the least of `evaluate` over the space."""
    rng = random.Random(500 + seed)
    profile = random_profile(rng, rng.randint(2, 5), input_bytes=rng.choice([1e6, 1e7, 1e8]))
    topo = random_topology(rng)
    gbs = rng.choice([4, 8, 12, 24])
    expected = brute_force(profile, topo, gbs, plan_space=plan_space, transfers="tensorflow")
    if expected is None:
        return
    stats = SearchStats()
    plan = plan_dapple(profile, topo, gbs, max_candidates=None, stats=stats,
                       plan_space=plan_space, transfers="tensorflow")
    assert stats.complete and plan.transfers == "tensorflow"
    assert plan.estimate.latency_ms == pytest.approx(expected, rel=1e-9)
    assert cm.evaluate(plan, profile, topo).latency_ms == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_search_on_cpu_hosts_matches_brute_force(seed):
    """On CPU hosts each end of a transfer takes compute (`Topology.transfer_cpu_*`), charged
    to the stage's F and B; the search's inlined stage costs must charge them alike, and its
    pruning must stay a bound: its plan is the least of `evaluate` over the space."""
    rng = random.Random(900 + seed)
    profile = random_profile(rng, rng.randint(2, 6))
    topo = dataclasses.replace(random_topology(rng),
                               transfer_cpu_latency=rng.choice([1e-5, 1e-3]),
                               transfer_cpu_bandwidth=rng.choice([0.0, 1e8, 1e10]))
    gbs = rng.choice([4, 8, 12, 24])
    transfers = rng.choice(["async", "tensorflow"])
    expected = brute_force(profile, topo, gbs, transfers=transfers)
    if expected is None:
        return
    stats = SearchStats()
    plan = plan_dapple(profile, topo, gbs, max_candidates=None, stats=stats,
                       transfers=transfers)
    assert stats.complete
    assert plan.estimate.latency_ms == pytest.approx(expected, rel=1e-9)
    assert cm.evaluate(plan, profile, topo).latency_ms == pytest.approx(expected, rel=1e-9)


def test_search_latency_equals_evaluate_and_beats_data_parallel():
    rng = random.Random(7)
    profile, topo = random_profile(rng, 6), Topology((2, 2), 64e9, 100e9, 1e9)
    plan = plan_dapple(profile, topo, 16)
    again = cm.evaluate(plan, profile, topo)
    assert again.latency_ms == pytest.approx(plan.estimate.latency_ms)
    dp = best_data_parallel_plan(profile, topo, 16)
    assert plan.estimate.latency_ms <= dp.estimate.latency_ms + 1e-9


def chain_profile(parameter_bytes, n):
    layers = [{"name": f"l{i}", "type": "X", "forward_ms": 1.0, "backward_ms": 2.0,
               "output_bytes": 1e6, "parameter_bytes": parameter_bytes,
               "inputs": [i - 1]} for i in range(n)]
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1,
                                         "name": "chain", "batch_size": 1, "input_bytes": 1e5,
                                         "layers": layers}))


def test_paper_space_goes_deeper_only_when_nothing_fits():
    # Three layers of 1 GB of weights (4 GB with gradients and Adam slots, plus the 1 GiB
    # reserve) on four 7 GB devices: no stage holds two layers and four devices cannot run
    # three layers straight, so only three-stage plans (one stage replicated) fit, and
    # "paper" must find one.
    profile = chain_profile(1e9, 3)
    topo = Topology((2, 2), 7e9, 100e9, 3e9)
    stats = SearchStats()
    plan = plan_dapple(profile, topo, 8, stats=stats)
    assert stats.plan_space == "full" and plan.num_stages == 3
    assert sorted(s.replicas for s in plan.stages) == [1, 1, 2]
    # With room for two layers a device, the paper's space has a plan, and it is used.
    stats = SearchStats()
    plan = plan_dapple(profile, Topology((2, 2), 64e9, 100e9, 3e9), 8, stats=stats)
    assert stats.plan_space == "paper" and plan.num_stages <= 2


def test_paper_space_holds_no_deep_replicated_pipeline():
    # Eight cheap layers with heavy weights on 2 x 2 devices: the full space's best is deeper
    # than two stages and not straight; the paper space must not return it.
    rng = random.Random(3)
    deep = 0
    for _ in range(20):
        profile = random_profile(rng, 8)
        topo = Topology((2, 2), 64e9, 100e9, 1e9)
        full = plan_dapple(profile, topo, 24, plan_space="full")
        paper = plan_dapple(profile, topo, 24)
        deep += not in_paper_space(full.num_stages, 4)
        assert in_paper_space(paper.num_stages, 4)
        assert paper.estimate.latency_ms >= full.estimate.latency_ms * (1 - 1e-9)
    assert deep >= 1        # else these instances would not tell the two spaces apart


def test_unknown_plan_space_is_an_error():
    with pytest.raises(PlanError, match="unknown plan space 'deep'.*paper, full"):
        plan_dapple(chain_profile(1e6, 3), Topology((2,), 64e9, 100e9, 3e9), 8,
                    plan_space="deep")
