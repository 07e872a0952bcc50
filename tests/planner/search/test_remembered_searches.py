"""`plan_space.remembering_searches`: inside it, a search asked again with the same arguments is
not run again, and what the planner returns is what it returns outside it (searching afresh)."""
import os

from planner.search import plan_space
from planner.search.baselines import best_straight_plan
from planner.formats.profile_readers import load_profile
from tests.paths import PROFILES
from topology import parse_topology


def counting_searches(monkeypatch):
    runs = []
    original = plan_space.Search.run_micro_batches

    def run(self, M):
        runs.append(M)
        return original(self, M)
    monkeypatch.setattr(plan_space.Search, "run_micro_batches", run)
    return runs


def test_the_straight_pipeline_is_searched_once_for_plan_and_alternative(monkeypatch):
    profile = load_profile(os.path.join(PROFILES, "dapple", "bert-48-pbs-2.txt"))
    topo = parse_topology("B")
    fresh = (plan_space.plan_dapple(profile, topo, 64), best_straight_plan(profile, topo, 64))
    runs = counting_searches(monkeypatch)
    plan_space.plan_dapple(profile, topo, 64)
    searched = len(runs)
    best_straight_plan(profile, topo, 64)
    assert len(runs) > searched        # outside: the straight search runs again
    runs.clear()
    with plan_space.remembering_searches():
        remembered = (plan_space.plan_dapple(profile, topo, 64),
                      best_straight_plan(profile, topo, 64))
        assert len(runs) == searched   # inside: the alternative reuses the straight search
        again = plan_space.plan_dapple(profile, topo, 64)
        assert len(runs) == searched
    assert [p.to_json() for p in remembered] == [p.to_json() for p in fresh]
    assert again.to_json() == fresh[0].to_json()
    plan_space.plan_dapple(profile, topo, 64)
    assert len(runs) > searched        # forgotten after it


def test_other_arguments_search_again(monkeypatch):
    profile = load_profile(os.path.join(PROFILES, "dapple", "bert-48-pbs-2.txt"))
    runs = counting_searches(monkeypatch)
    with plan_space.remembering_searches():
        a = plan_space.plan_dapple(profile, parse_topology("B"), 64)
        n = len(runs)
        b = plan_space.plan_dapple(profile, parse_topology("C"), 64)
        assert len(runs) > n
        c = plan_space.plan_dapple(profile, parse_topology("B"), 128)
    fresh = [plan_space.plan_dapple(profile, parse_topology(t), g)
             for t, g in (("B", 64), ("C", 64), ("B", 128))]
    assert [p.to_json() for p in (a, b, c)] == [p.to_json() for p in fresh]
