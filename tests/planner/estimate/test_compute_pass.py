"""The iteration from the compute lists alone (`compute_pass`) against the simulator
(`simulate`: lowering, the numbered graph, the timeline): on every synchronous schedule
kind at several S and M, on random orders and placements (several chunks on a position,
channels shared), with random durations full of ties, the same iteration and position 0's
first backward start and last forward end, bit for bit; None wherever it does not apply or
the simulator refuses the schedule; and `choose_schedule` choosing and estimating the same
with it as without it."""
import random

import pytest

from planner.estimate import compute_pass
from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate.simulator import simulate
from planner.formats.plan import PlanError
from planner.schedules.actions import ScheduleError, Schedule
from planner.schedules.by_name import build_schedule
from planner.search.schedule_choice import choose_schedule
from tests.planner.estimate.test_simulator_equivalence import (generated, random_costs,
                                                               random_order)
from tests.planner.search.test_schedule_choice_pruning import random_choice_case


def reference(schedule, costs, duplex="full", rendezvous=False):
    """(iteration, first backward start, last forward end on position 0) from the simulator,
    or None when it refuses the schedule."""
    try:
        result = simulate(schedule, costs, link_duplex=duplex, rendezvous=rendezvous)
    except ScheduleError:
        return None
    first = result.stage_events(0)
    return (result.iteration_ms,
            min((e.start_ms for e in first if e.kind != "forward"), default=0.0),
            max((e.end_ms for e in first if e.kind == "forward"), default=0.0))


def exact(timing):
    return None if timing is None else tuple(float(v).hex() for v in timing)


def check(schedule, costs):
    """The pass gives the simulator's numbers, or None; whether it gave them."""
    mine = compute_pass.iteration(schedule, costs, "full", False)
    if mine is None:
        return False
    assert exact(mine) == exact(reference(schedule, costs)), str(schedule)
    return True


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize("S,M", [(1, 1), (2, 3), (3, 8), (4, 4), (5, 16), (8, 32), (16, 64)])
def test_every_synchronous_schedule_at_several_sizes(name, S, M):
    rng = random.Random(hash((name, S, M)) % 1000)
    for _ in range(3):
        if name == "interleaved":
            schedule = build_schedule(name, S, max(M, S), virtual_stages=rng.randint(2, 3))
        else:
            schedule = build_schedule(name, S, M)
        assert check(schedule, random_costs(rng, schedule.num_chunks))


@pytest.mark.parametrize("seed", range(40))
def test_generated_schedules(seed):
    rng = random.Random(9100 + seed)
    for _ in range(5):
        schedule = generated(rng)
        costs = random_costs(rng, schedule.num_chunks)
        ran = check(schedule, costs)
        # Only multi-batch (relaxed) schedules are left to the simulator.
        assert ran == (schedule.batches == 1 and not schedule.averaging and
                       not any(a.kind == "UPDATE" for lst in schedule.lists for a in lst))


@pytest.mark.parametrize("seed", range(60))
def test_random_orders_and_placements(seed):
    """Random placements (positions holding several chunks, links carrying both directions)
    and list orders, some that deadlock: the simulator's numbers, or None where it fails."""
    rng = random.Random(9300 + seed)
    chunks = rng.randint(1, 6)
    schedule = random_order(rng, chunks, rng.randint(min(2, chunks), chunks),
                            rng.randint(1, 5), deadlock_free=seed % 3 != 2)
    costs = random_costs(rng, chunks)
    ran = check(schedule, costs)
    assert ran == (reference(schedule, costs) is not None)


def broken(schedule, rng):
    """`schedule` with one compute action dropped, repeated, or moved to the wrong position."""
    lists = [list(lst) for lst in schedule.lists]
    p = rng.choice([p for p, lst in enumerate(lists) if lst])
    how = rng.choice(("drop", "repeat", "move")) if len(lists) > 1 else \
        rng.choice(("drop", "repeat"))
    i = rng.randrange(len(lists[p]))
    a = lists[p].pop(i)
    if how == "repeat":
        lists[p][i:i] = [a, a]
    elif how == "move":
        lists[(p + 1) % len(lists)].append(a)
    return Schedule(schedule.name, schedule.placement, tuple(tuple(lst) for lst in lists))


@pytest.mark.parametrize("seed", range(30))
def test_schedules_the_simulator_refuses_give_none(seed):
    rng = random.Random(9500 + seed)
    schedule = broken(generated(rng) if seed % 2 else
                      random_order(rng, 4, rng.randint(2, 4), rng.randint(1, 4)), rng)
    costs = random_costs(rng, schedule.num_chunks)
    if reference(schedule, costs) is None:
        assert compute_pass.iteration(schedule, costs, "full", False) is None
    else:           # a drop that leaves a valid schedule (e.g. an M-th micro-batch gone)
        assert check(schedule, costs)


def test_where_it_does_not_apply():
    """Link models where times decide the order, rendezvous, relaxed schedules, bad costs."""
    rng = random.Random(2)
    schedule = build_schedule("1f1b", 4, 8)
    costs = random_costs(rng, 4)
    assert check(schedule, costs)
    for duplex, rendezvous in (("half", False), ("serial", False), ("full", True)):
        assert compute_pass.iteration(schedule, costs, duplex, rendezvous) is None
    assert compute_pass.iteration(build_schedule("2bw", 4, 8, batches=2), costs, "full",
                                  False) is None
    costs.forward_ms[1] = -1.0
    assert compute_pass.iteration(schedule, costs, "full", False) is None
    assert compute_pass.iteration(schedule, random_costs(rng, 3), "full", False) is None


def test_a_hand_timed_gpipe():
    """GPipe, 2 stages, 4 micro-batches, F = 1 ms, a 5 ms link: the forwards end at 1..4, their
    transfers queue on the link and arrive at 6, 11, 16, 21; stage 1's forwards end at 22,
    its four 2 ms backwards at 30, each feeding stage 0's (free, 2 ms) at once: 32. A pass
    that let a link's transfers overlap would say 24."""
    costs = PipelineCosts(forward_ms=[1.0, 1.0], backward_ms=[2.0, 2.0], send_forward_ms=[5.0],
                          send_backward_ms=[0.0], allreduce_ms=[0.0, 0.0])
    timing = compute_pass.iteration(build_schedule("gpipe", 2, 4), costs, "full", False)
    assert timing == (32.0, 24.0, 4.0)


@pytest.mark.parametrize("seed", range(12))
def test_choose_schedule_the_same_without_it(seed, monkeypatch):
    """The plan `auto` chooses, its estimate, and every option's iteration, with the pass and
    with the simulator alone."""
    plan, profile, topology = random_choice_case(seed)

    def choice():
        try:
            chosen, options = choose_schedule(plan, profile, topology, "auto")
        except PlanError as e:
            return str(e)
        return chosen.to_json(), [(o.name, o.simulated, o.simulated and o.iteration_ms)
                                  for o in options]
    fast = choice()
    with monkeypatch.context() as m:
        m.setattr(compute_pass, "iteration", lambda *args: None)
        slow = choice()
    assert fast == slow
    # With `timeline` (a report's), the simulator alone, the same choice.
    with monkeypatch.context() as m:
        m.setattr(compute_pass, "iteration", lambda *args: pytest.fail("pass used"))
        try:
            chosen, options = choose_schedule(plan, profile, topology, "auto", timeline=True)
        except PlanError as e:
            assert str(e) == fast
        else:
            assert (chosen.to_json(), [(o.name, o.simulated, o.simulated and o.iteration_ms)
                                       for o in options]) == fast
