"""The paper space searches the straight pipeline below the latency of the two-stage search's
plan (`plan_space._search`'s `below`): on random profiles and topologies, with candidate
budgets that stop the searches and without, `plan_dapple` returns the plan and estimate it
returns with the straight search on its own (`bound_straight=False`, the former path). The
statistics differ (the bounded search prunes at once what cannot win); the plan may not. The
instances cover the three ways it goes: nothing found below the bound, a straight seed already
below it, and a bounded search that finds a plan below it (then the search on its own runs)."""
import collections
import math
import random

from planner.search import plan_space
from planner.search.plan_finishing import NoPlanFits
from planner.formats.plan import PlanError
from tests.planner.search.test_search_optimal import random_profile
from tests.planner.search.test_search_oracle import random_topology

HOSTS = [(2, 2), (4,), (2, 1, 1), (3, 3), (4, 4), (2, 2, 2, 2), (8,)]


def plan_text(profile, topo, gbs, budget, even, bound):
    try:
        return plan_space.plan_dapple(profile, topo, gbs, max_candidates=budget,
                                      even_slices=even, bound_straight=bound).to_json()
    except (NoPlanFits, PlanError) as e:
        return f"{type(e).__name__}: {e}"


def test_same_plans_as_the_straight_search_on_its_own(monkeypatch):
    ways, within = collections.Counter(), []
    original = plan_space._search

    def spy(*args):
        below = args[9] if len(args) > 9 else math.inf
        if within and below == math.inf:
            ways["the search on its own after a bounded one"] += 1
        within.append(below)
        try:
            own, found = original(*args)
        finally:
            within.pop()
        if below < math.inf:
            ways["nothing below" if found.best is None else "below"] += 1
        return own, found
    monkeypatch.setattr(plan_space, "_search", spy)
    rng = random.Random(29)
    for _ in range(60):
        profile = random_profile(rng, rng.randrange(8, 17))
        topo = random_topology(rng, rng.choice(HOSTS))
        gbs = rng.choice([16, 32, 64, 128])
        budget = rng.choice([30, 200, 1000, None])
        even = rng.random() < 0.25
        bounded = plan_text(profile, topo, gbs, budget, even, True)
        assert bounded == plan_text(profile, topo, gbs, budget, even, False), (gbs, budget)
    assert min(ways.values()) >= 3 and len(ways) == 3, ways
