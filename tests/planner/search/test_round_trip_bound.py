"""The exact search's round-trip bound (`round_trip_bound`, built on a trail of prefix terms)
against the bound computed from the stage costs directly (`search_oracle.round_trip_reference`,
the oracle search's own): bit for bit on random paths; with `stop_at`, the same
bound when it is below `stop_at`, else a value from `stop_at` up to the bound (the search
prunes the candidate either way). The trail's entries hold each stage's K bound for one count
of stages (`usual_stages`): the pass reads them where the plan may have that many stages and
recomputes them otherwise; both bit for bit."""
import math
import random

import pytest

from planner.search.round_trip_bound import round_trip_bound, trail_entry
from tests.planner.search.search_oracle import round_trip_reference


def random_cost(rng):
    return (rng.choice((0.0, rng.random())), rng.choice((0.0, rng.random())),
            rng.random() * 5, rng.random() * 5, rng.choice((0.0, rng.random() * 3)),
            rng.choice((0, 1, 2, 3, 5, 100)))


@pytest.mark.parametrize("seed", range(10))
def test_the_bound_is_the_reference_and_stops_where_it_prunes(seed):
    rng = random.Random(seed)
    stopped = 0
    usual_paths = [0, 0]        # calls (not at, at) the entries' count of stages
    for _ in range(2000):
        M = rng.choice((1, 2, 3, 4, 8, 16, 32, 128))
        costs = [random_cost(rng) for _ in range(rng.randint(1, 12))]
        more, trip_rest = rng.randint(0, 10), rng.choice((0.0, rng.random() * 10))
        # the entries' K for the plan's most stages (their fast path) or for another count
        usual = len(costs) + more + rng.choice((0, 0, -1, 1, 5))
        usual_paths[usual == len(costs) + more] += 1
        trail = []
        for cost in costs[:-1]:
            trail.append(trail_entry(trail, cost, M, usual))
        want = round_trip_reference(costs, M, more, trip_rest)
        bound, entry = round_trip_bound(trail, costs[-1], M, more, trip_rest,
                                        usual_stages=usual)
        assert bound.hex() == want.hex()
        assert entry == trail_entry(trail, costs[-1], M, usual)
        stop_at = rng.choice((want * 0.9, want, want * 1.1, math.nextafter(want, math.inf)))
        stopped_bound, stopped_entry = round_trip_bound(trail, costs[-1], M, more, trip_rest,
                                                        stop_at, usual)
        assert stopped_entry == entry
        if want >= stop_at:
            assert stop_at <= stopped_bound <= want
            stopped += stopped_bound < want
        else:
            assert stopped_bound.hex() == want.hex()
    assert stopped > 0          # the pass did stop early, below the full bound
    assert min(usual_paths) > 200     # both passes ran
