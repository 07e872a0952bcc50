"""The straight search (one device a stage on every device, `Search(stage_sizes=[1])`, which
the paper space runs) against brute force, one M at a time: on random profiles and
topologies of up to 6 devices, with and without seeds, the complete search's latency at each
M equals the least `evaluate` over every straight plan at that M, enumerated here: every cut of
the layers into G stages and every sequence of one-device placements (fresh / append /
scatter), memory respected. So none of the search's pruning (the stage-end skip, the stage
break, the eq. 1 and remaining-work bounds, the round-trip bound) rules out the optimum."""
import itertools
import random

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan, Stage
from planner.search.exact_search import Search
from planner.search.placement import assign_devices
from planner.search.plan_finishing import micro_batch_choices
from planner.search.seed_plans import seed_search
from tests.planner.search.test_search_optimal import placements, random_profile
from tests.planner.search.test_search_oracle import random_topology

HOSTS = [(2, 2), (4,), (2, 1, 1), (3,), (2, 2, 2), (3, 3), (1, 1)]


def brute_force_straight(profile, topo, gbs, M):
    """The least latency of a straight plan at M (None if none fits)."""
    N, G = profile.num_layers, topo.num_devices
    model = cm.StageModel(profile, topo, gbs, M)
    sequences = {tuple(seq) for seq in placements(tuple(topo.devices_per_host),
                                                  (0,) * topo.num_hosts, None, G)
                 if all(sum(counts) == 1 for counts in seq)}
    best = None
    for cuts in itertools.combinations(range(1, N), G - 1):
        bounds = list(zip((0,) + cuts, [c - 1 for c in cuts] + [N - 1]))
        if any(model.max_in_flight(a, b, 1) < 1 for a, b in bounds):
            continue
        for seq in sequences:
            plan = Plan(stages=[Stage([a, b], d) for (a, b), d
                                in zip(bounds, assign_devices(topo, seq))],
                        micro_batches=M, global_batch_size=gbs)
            latency = cm.evaluate(plan, profile, topo).latency_ms
            if best is None or latency < best:
                best = latency
    return best


@pytest.mark.parametrize("seed", range(12))
def test_straight_search_finds_the_brute_force_optimum_at_every_m(seed):
    rng = random.Random(1000 + seed)
    checked = 0
    while checked < 4:
        profile = random_profile(rng, rng.randrange(4, 12))
        topo = random_topology(rng, rng.choice(HOSTS))
        if topo.num_devices > profile.num_layers:
            continue
        gbs = rng.choice([8, 16, 32])
        min_slice = cm.minimum_slice(profile, topo, gbs)
        for M in micro_batch_choices(gbs):
            if gbs // M < min_slice:
                continue
            expected = brute_force_straight(profile, topo, gbs, M)
            search = Search(profile, topo, gbs, stage_sizes=[1])
            if rng.random() < 0.5:
                seed_search(search, [M])        # a good incumbent from the start prunes more
            search.run_micro_batches(M)
            assert search.stats.complete
            if expected is None:
                assert search.best is None, M
                continue
            assert search.best is not None and search.best[0] == M
            assert search.best_value == pytest.approx(expected, rel=1e-9), (M, topo)
            checked += 1
