"""The search against its former self (tests/planner/search/search_oracle.py, the search as it was
before #29's pass on its speed): on random profiles and topologies, in each of plan_dapple's
restrictions (two stages, one device a stage, the full space), seeded alike, at every M, with
candidate budgets that stop it early and without one, both return the same plan, the same
value and the same statistics (nodes, candidates, pruned, seeds, complete). A search that
visited other candidates, in another order, or valued one differently, differs in one of
them; with a budget, that would change the plan it settles for."""
import math
import random

import pytest

from planner.search.exact_search import Search, SearchStats
from planner.search.plan_finishing import micro_batch_choices
from planner.search.seed_plans import seed_search
from planner.estimate import cost_model as cm
from tests.planner.search.search_oracle import OracleSearch, oracle_seed_search
from tests.planner.search.test_search_optimal import random_profile
from topology.model import Topology

RESTRICTIONS = [(None, 2), ([1], None), (None, None)]      # (stage sizes, most stages)
BUDGETS = [20, 300, math.inf]


def random_topology(rng, hosts):
    return Topology(devices_per_host=hosts, device_memory_bytes=rng.choice([8e9, 64e9, 1e12]),
                    intra_host_bandwidth=rng.choice([10e9, 100e9]),
                    inter_host_bandwidth=rng.choice([1e9, 3e9]),
                    intra_host_latency=1e-5, inter_host_latency=5e-5)


def run(cls, seeder, profile, topo, gbs, sizes, max_stages, budget):
    stats = SearchStats()
    search = cls(profile, topo, gbs, stage_sizes=sizes, stats=stats, max_stages=max_stages,
                 max_candidates=budget)
    min_slice = cm.minimum_slice(profile, topo, gbs)
    ms = [M for M in micro_batch_choices(gbs) if min_slice <= gbs // M]
    seeder(search, ms)
    for M in ms:
        search.run_micro_batches(M)
    return (search.best, search.best_value,
            (stats.nodes, stats.candidates, stats.pruned, stats.seeds, stats.complete))


@pytest.mark.parametrize("seed", range(12))
def test_same_search_as_before(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randrange(4, 13))
    hosts = rng.choice([(2, 2), (4,), (2, 1, 1), (3, 3), (4, 4), (2, 2, 2, 2), (8,)])
    topo = random_topology(rng, hosts)
    gbs = rng.choice([16, 32, 64])
    compared = 0
    for sizes, max_stages in RESTRICTIONS:
        if sizes == [1] and topo.num_devices > profile.num_layers:
            continue
        for budget in BUDGETS:
            new = run(Search, seed_search, profile, topo, gbs, sizes, max_stages, budget)
            old = run(OracleSearch, oracle_seed_search, profile, topo, gbs, sizes, max_stages,
                      budget)
            assert new == old, (sizes, max_stages, budget)
            compared += new[0] is not None
    assert compared          # some restriction found a plan


def test_same_search_on_a_large_topology():
    """More than LARGE_TOPOLOGY_DEVICES devices: stage sizes by whole hosts, tens of
    two-stage seeds per cut (the seeding's shortcut), a budget that stops the search."""
    rng = random.Random(7)
    profile = random_profile(rng, 10)
    topo = random_topology(rng, (8,) * 9)
    for budget in (200, 2000):
        new = run(Search, seed_search, profile, topo, 576, None, 2, budget)
        old = run(OracleSearch, oracle_seed_search, profile, topo, 576, None, 2, budget)
        assert new == old
        assert new[0] is not None
