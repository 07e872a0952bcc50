"""`auto` with pruning chooses what simulating every schedule chooses: on every Table V cell
and on random toy plans, the plan (schedule, warm-up, estimate) is the brute force's, while
fewer schedules are simulated."""
import random

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import PlanError, straight_plan
from planner.search.schedule_choice import TIE_ORDER, choose_schedule, schedule_options
from tests.planner.search.test_schedule_choice import toy_profile
from tests.planner.search.test_table_v import CELLS, planned
from topology import parse_topology


def brute_force(plan, profile, topology):
    """Every synchronous schedule sized and simulated; the least iteration that fits."""
    fitting = [o for o in schedule_options(plan, profile, topology)
               if not o.relaxed and o.fits]
    best = min(o.iteration_ms for o in fitting)
    tied = [o for o in fitting if o.iteration_ms <= best * (1 + 1e-9)]
    return min(tied, key=lambda o: TIE_ORDER.index(o.name)).plan


@pytest.fixture
def simulations(monkeypatch):
    """The schedules simulated, in order."""
    seen = []
    simulate_plan = cm.simulate_plan

    def counted(plan, costs, *args, **kwargs):
        seen.append(plan.schedule)
        return simulate_plan(plan, costs, *args, **kwargs)
    monkeypatch.setattr(cm, "simulate_plan", counted)
    return seen


def test_auto_chooses_as_brute_force_on_table_v_simulating_less(simulations):
    simulated = 0
    for f, gbs, cfg, _ in CELLS:
        profile, topology, plan = planned(f, gbs, cfg)
        simulations.clear()
        chosen, _ = choose_schedule(plan, profile, topology, "auto")
        simulated += len(simulations)
        assert chosen.to_json() == brute_force(plan, profile, topology).to_json(), (f, cfg)
    assert simulated < 2 * len(CELLS)           # of 4 synchronous schedules each


def random_choice_case(seed):
    """(plan, profile, topology): a straight plan of 2-4 stages over 4-10 toy layers at
    M = 1-16, on one server or across servers, drawn from `seed`."""
    rng = random.Random(seed)
    layers = rng.randint(4, 10)
    profile = toy_profile(tuple(rng.choice((0.5, 1.0, 2.0, 3.0)) for _ in range(layers)))
    stages = rng.randint(2, min(4, layers))
    cuts = sorted(rng.sample(range(1, layers), stages - 1))
    M = rng.choice((1, 2, 4, 8, 16))
    plan = straight_plan(cuts, layers, micro_batches=M, global_batch_size=8 * M)
    topology = parse_topology(rng.choice((f"1x{stages}", f"1x{stages},net=1Gbps",
                                          f"{stages}x1,net=10Gbps")))
    return plan, profile, topology


@pytest.mark.parametrize("seed", range(20))
def test_auto_chooses_as_brute_force_on_random_plans(seed):
    plan, profile, topology = random_choice_case(seed)
    try:
        want = brute_force(plan, profile, topology)
    except PlanError:
        with pytest.raises(PlanError, match="no schedule fits"):
            choose_schedule(plan, profile, topology, "auto")
        return
    assert choose_schedule(plan, profile, topology, "auto")[0].to_json() == want.to_json()
