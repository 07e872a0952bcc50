"""`plan_space.remembering_searches`: inside it, a search asked again with the same arguments is
not run again, and what the planner returns is what it returns outside it (searching afresh).
The text report plans with the straight search on its own (`bound_straight=False`), which its
"best straight" alternative reuses; a bounded straight search reuses it too."""
import contextlib
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
    alone = dict(bound_straight=False)
    fresh = (plan_space.plan_dapple(profile, topo, 64, **alone),
             best_straight_plan(profile, topo, 64))
    runs = counting_searches(monkeypatch)
    plan_space.plan_dapple(profile, topo, 64, **alone)
    searched = len(runs)
    best_straight_plan(profile, topo, 64)
    assert len(runs) > searched        # outside: the straight search runs again
    runs.clear()
    with plan_space.remembering_searches():
        remembered = (plan_space.plan_dapple(profile, topo, 64, **alone),
                      best_straight_plan(profile, topo, 64))
        assert len(runs) == searched   # inside: the alternative reuses the straight search
        again = (plan_space.plan_dapple(profile, topo, 64, **alone),
                 plan_space.plan_dapple(profile, topo, 64))    # bounded: it reuses it too
        assert len(runs) == searched
    assert [p.to_json() for p in remembered] == [p.to_json() for p in fresh]
    assert [p.to_json() for p in again] == [fresh[0].to_json()] * 2
    plan_space.plan_dapple(profile, topo, 64, **alone)
    assert len(runs) > searched        # forgotten after it


def test_a_bounded_straight_search_then_the_alternative(monkeypatch):
    """On A the two-stage plan wins and the bounded straight search finds nothing below it;
    on B a straight seed beats it, so the search is the one on its own. Either way the plan
    is the one planned without the bound, and once the alternative has run, planning again
    runs nothing."""
    profile = load_profile(os.path.join(PROFILES, "dapple", "bert-48-pbs-2.txt"))
    for config, shape in (("A", "8:8"), ("B", "straight")):
        topo = parse_topology(config)
        fresh = (plan_space.plan_dapple(profile, topo, 64, bound_straight=False),
                 best_straight_plan(profile, topo, 64))
        assert fresh[0].shape() == shape
        runs = counting_searches(monkeypatch)
        with plan_space.remembering_searches():
            remembered = (plan_space.plan_dapple(profile, topo, 64),
                          best_straight_plan(profile, topo, 64))
            searched = len(runs)
            again = (plan_space.plan_dapple(profile, topo, 64),
                     best_straight_plan(profile, topo, 64))
            assert len(runs) == searched
        assert [p.to_json() for p in remembered + again] == [p.to_json() for p in fresh * 2]


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


def test_the_seed_shapes_are_made_once_per_plan(monkeypatch):
    """`plan_dapple` seeds its searches with shapes made once
    (`seed_plans.remembering_shapes`), and returns what it returns when each search makes
    them (outside the context, the former path). GNMT-16 on C with `bound_straight=False`
    runs two (by default only the straight search runs there: `two_stage_bound`)."""
    from planner.search import seed_plans
    profile = load_profile(os.path.join(PROFILES, "dapple", "gnmt-16-pbs-64.txt"))
    topo = parse_topology("C")
    made, original = [], seed_plans.pipedream_partition

    def counting(*args):
        made.append(1)
        return original(*args)
    monkeypatch.setattr(seed_plans, "pipedream_partition", counting)
    once = plan_space.plan_dapple(profile, topo, 1024, bound_straight=False).to_json()
    assert len(made) == 1
    made.clear()
    monkeypatch.setattr(plan_space, "remembering_shapes", contextlib.nullcontext)
    assert plan_space.plan_dapple(profile, topo, 1024, bound_straight=False).to_json() == once
    assert len(made) == 2       # the two-stage search, the straight search


def test_pipedream_partition_made_once_within_remembering_shapes(monkeypatch):
    """`dapple plan`'s report runs under `remembering_shapes`: its searches and its PipeDream
    baseline share one PipeDream partition, and the plans are those made afresh."""
    from planner.search import pipedream, seed_plans
    from reports.comparison import Alternative, plan_alternative
    profile = load_profile(os.path.join(PROFILES, "dapple", "xlnet-36-pbs-1.txt"))
    topo = parse_topology("C")
    fresh = [plan_space.plan_dapple(profile, topo, 128).to_json(),
             plan_alternative(Alternative.PIPEDREAM, profile, topo, 128).to_json()]
    made, original = [], pipedream._pipedream_partition

    def counting(*args):
        made.append(1)
        return original(*args)
    monkeypatch.setattr(pipedream, "_pipedream_partition", counting)
    with seed_plans.remembering_shapes():
        again = [plan_space.plan_dapple(profile, topo, 128).to_json(),
                 plan_alternative(Alternative.PIPEDREAM, profile, topo, 128).to_json()]
    assert again == fresh and len(made) == 1
