"""Random `plan_dapple` arguments for the tests that compare two ways of planning on the same
instances (`test_bounded_straight.py`, `test_straight_bound.py`): one generator, so both
draw their instances alike."""
from tests.planner.search.test_search_optimal import random_profile
from tests.planner.search.test_search_oracle import random_topology

# Host shapes: one host, equal hosts, unequal hosts, up to 16 devices.
HOSTS = [(2, 2), (4,), (2, 1, 1), (3, 3), (4, 4), (2, 2, 2, 2), (8,)]
# Candidate budgets: ones that stop the searches early, and none.
BUDGETS = [30, 200, 1000, None]


def plan_instances(rng, count):
    """`count` tuples (profile, topology, global batch, candidate budget, even slices) drawn
    from `rng` (a `random.Random`): 8 to 16 layers, a quarter with even slices."""
    for _ in range(count):
        profile = random_profile(rng, rng.randrange(8, 17))
        topo = random_topology(rng, rng.choice(HOSTS))
        gbs = rng.choice([16, 32, 64, 128])
        budget = rng.choice(BUDGETS)
        even = rng.random() < 0.25
        yield profile, topo, gbs, budget, even
