"""The lower bound schedule choice prunes with: never above the simulated iteration (random
schedules, durations and link models), and equal to it where the pipeline has no slack (by
hand)."""
import random

import pytest

from planner.schedules.actions import ScheduleError
from planner.estimate.pipeline_costs import PipelineCosts
from planner.schedules.by_name import build_schedule
from planner.search.schedule_bounds import iteration_lower_bound
from planner.estimate.simulator import simulate
from tests.planner.estimate.test_simulator_equivalence import TRANSFERS, random_costs, random_order


def bound_of(schedule, costs):
    return iteration_lower_bound(costs, schedule.placement, schedule.micro_batches,
                                 split_backward=bool(schedule.split_chunks))


@pytest.mark.parametrize("seed", range(60))
def test_the_bound_never_exceeds_the_simulation(seed):
    rng = random.Random(seed)
    S, M = rng.randint(1, 5), rng.randint(1, 9)
    name = rng.choice(("gpipe", "1f1b", "B", "zb-h1", "interleaved", "custom"))
    if name == "interleaved":
        schedule = build_schedule(name, S, max(M, S), virtual_stages=rng.randint(1, 3))
    elif name == "custom":
        chunks = rng.randint(1, 6)
        schedule = random_order(rng, chunks, rng.randint(min(2, chunks), chunks), M)
    else:
        schedule = build_schedule(name, S, M)
    costs = random_costs(rng, schedule.num_chunks)
    bound = bound_of(schedule, costs)
    for duplex, rendezvous in TRANSFERS:
        try:
            result = simulate(schedule, costs, duplex, rendezvous)
        except ScheduleError:       # a rendezvous that never comes: no iteration to bound
            continue
        assert bound <= result.iteration_ms


def test_the_bound_is_the_iteration_of_uniform_1f1b_and_gpipe():
    # (M + S - 1)(F + B) then stage 0's allreduce, by hand: S = 4, M = 8, F = 1, B = 2,
    # allreduce 2: 11 * 3 + 2 = 35. Neither schedule leaves the last stage idle once started.
    costs = PipelineCosts(forward_ms=[1.0] * 4, backward_ms=[2.0] * 4, send_forward_ms=[0.0] * 3,
                          send_backward_ms=[0.0] * 3, allreduce_ms=[2.0] * 4)
    for name in ("1f1b", "gpipe"):
        schedule = build_schedule(name, 4, 8)
        assert bound_of(schedule, costs) == 35.0
        assert simulate(schedule, costs).iteration_ms == 35.0
