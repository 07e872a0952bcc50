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
from tests.planner.search.random_plan_instances import plan_instances


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
    for profile, topo, gbs, budget, even in plan_instances(rng, 60):
        bounded = plan_text(profile, topo, gbs, budget, even, True)
        assert bounded == plan_text(profile, topo, gbs, budget, even, False), (gbs, budget)
    assert min(ways.values()) >= 3 and len(ways) == 3, ways
