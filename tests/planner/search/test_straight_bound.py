"""`straight_bound.straight_may_beat`, the lower bound that lets the paper space skip the
straight search: on random profiles and topologies it never rules out a straight plan the
complete search finds (at every M, the optimum's latency is not ruled out), and `plan_dapple`
returns the plan it returns with the straight search on its own on instances where the
straight search is skipped. Both of its bounds (the greedy without transfers, the one with them)
are checked this way."""
import math
import random

from planner.estimate import cost_model as cm
from planner.search import plan_space
from planner.search.exact_search import Search
from planner.search.plan_finishing import micro_batch_choices
from planner.search.seed_plans import seed_search
from planner.search import straight_bound
from planner.search.straight_bound import straight_may_beat
from tests.planner.search.random_plan_instances import plan_instances
from tests.planner.search.test_bounded_straight import plan_text
from tests.planner.search.test_search_optimal import random_profile
from tests.planner.search.test_search_oracle import random_topology


def test_never_rules_out_the_best_straight_plan():
    rng = random.Random(2929)
    checked = tight = with_transfers = 0
    for _ in range(40):
        profile = random_profile(rng, rng.randrange(4, 11))
        topo = random_topology(rng, rng.choice([(2, 2), (4,), (2, 1, 1), (3,), (2, 2, 2)]))
        if topo.num_devices > profile.num_layers:
            continue
        gbs = rng.choice([16, 32, 64])
        min_slice = cm.minimum_slice(profile, topo, gbs)
        for M in micro_batch_choices(gbs):
            if gbs // M < min_slice:
                continue
            search = Search(profile, topo, gbs, stage_sizes=[1])
            seed_search(search, [M])
            search.run_micro_batches(M)
            assert search.stats.complete
            if search.best is None:
                continue
            value = search.best_value
            assert straight_may_beat(profile, topo, gbs, M, value * (1 + 1e-6)), (gbs, M)
            checked += 1
            # and the bound is not trivial: it rules out something below the optimum
            tight += not straight_may_beat(profile, topo, gbs, M, value / 2)
            # the transfers' bound alone (the first is exact without transfers)
            with_transfers += not straight_bound._may_beat_with_transfers(
                profile, topo, cm.StageModel(profile, topo, gbs, M),
                [l.forward_ms + l.backward_ms for l in profile.layers],
                cm.StageModel(profile, topo, gbs, M).time_scale(1), 2 * cm.TASK_OVERHEAD_MS,
                M, value / 1.5)
    assert checked >= 50 and tight >= checked // 2, (checked, tight)
    assert with_transfers >= 10, with_transfers


def test_same_plans_where_the_straight_search_is_skipped(monkeypatch):
    skipped, original = [], plan_space.straight_may_beat_any

    def spy(*args):
        out = original(*args)
        skipped.append(not out)
        return out
    monkeypatch.setattr(plan_space, "straight_may_beat_any", spy)
    rng = random.Random(3029)
    for profile, topo, gbs, budget, even in plan_instances(rng, 40):
        bounded = plan_text(profile, topo, gbs, budget, even, True)
        assert bounded == plan_text(profile, topo, gbs, budget, even, False), (gbs, budget)
    assert sum(skipped) >= 10 and not all(skipped), skipped
