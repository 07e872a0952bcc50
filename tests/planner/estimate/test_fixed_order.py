"""The simulator's one-pass clock (`fixed_order`, full-duplex transfers without rendezvous)
against its event queue (`event_loop`): on random schedules of every kind and random
durations full of ties, the same events, the same times and the same statistics, bit for bit
(floats compared with ==); the event queue wherever the order is not fixed."""
import random

import pytest

from planner.estimate import event_loop, fixed_order
from planner.estimate.action_graph import action_graph
from planner.estimate.simulation_result import KIND_ORDER, peak_held, peaks
from planner.estimate.simulator import simulate
from planner.schedules.actions import ScheduleError
from planner.schedules.by_name import build_schedule
from planner.schedules.replay import checked_lowering
from tests.planner.estimate.test_simulator_equivalence import (generated, random_costs,
                                                               random_order)


def larger(rng):
    """A schedule of one of the planner's kinds, deeper and longer than `generated`'s."""
    name = rng.choice(("gpipe", "1f1b", "zb-h1", "interleaved", "pipedream", "2bw", "avgpipe"))
    S, M = rng.randint(2, 8), rng.randint(4, 24)
    if name == "interleaved":
        return build_schedule(name, S, max(M, S), virtual_stages=rng.randint(2, 3))
    if name in ("pipedream", "2bw", "avgpipe"):
        return build_schedule(name, S, M, batches=rng.randint(2, 4))
    return build_schedule(name, S, M)


def sorted_events(events):
    return sorted(events, key=lambda e: (e.start_ms, KIND_ORDER[e.kind], e.stage,
                                         -1 if e.micro_batch is None else e.micro_batch))


def with_event_queue(monkeypatch, run):
    """run() with the simulator's one-pass clock switched off."""
    with monkeypatch.context() as m:
        m.setattr(fixed_order, "run", lambda *args: None)
        return run()


def outcome(schedule, costs, duplex="full", rendezvous=False):
    try:
        result = simulate(schedule, costs, link_duplex=duplex, rendezvous=rendezvous)
    except ScheduleError as e:
        return ("error", str(e))
    return (result.to_dict(with_timeline=True), result.iteration_ms, result.bubble_fraction,
            [(s.end_ms, s.peak_held_bytes, s.busy_ms, s.idle_ms) for s in result.stages],
            [result.held_over_time(p) for p in range(result.num_stages)])


def check_same(schedule, rng, monkeypatch):
    """The two clocks agree on `schedule`; whether the one-pass clock ran it."""
    costs = random_costs(rng, schedule.num_chunks)
    graph = action_graph(checked_lowering(schedule))
    fast = fixed_order.run(graph, costs, "full", False)
    queue = event_loop.run(graph, costs, "full", False)
    if fast is not None:
        assert sorted_events(fast[0]) == sorted_events(queue[0])
        assert fast[1:] == queue[1:]
        # Compared as floats with ==, and as their exact bits (== takes -0.0 for 0.0).
        assert [(e.start_ms.hex(), e.end_ms.hex()) for e in sorted_events(fast[0])] == \
            [(e.start_ms.hex(), e.end_ms.hex()) for e in sorted_events(queue[0])]
    assert outcome(schedule, costs) == with_event_queue(monkeypatch,
                                                        lambda: outcome(schedule, costs))
    return fast is not None


@pytest.mark.parametrize("seed", range(30))
def test_one_pass_equals_event_queue_on_generated_schedules(seed, monkeypatch):
    rng = random.Random(5000 + seed)
    for _ in range(4):
        assert check_same(generated(rng), rng, monkeypatch)   # every one finishes
    assert check_same(larger(rng), rng, monkeypatch)


@pytest.mark.parametrize("seed", range(30))
def test_one_pass_equals_event_queue_on_random_orders(seed, monkeypatch):
    rng = random.Random(6000 + seed)
    chunks = rng.randint(1, 6)
    schedule = random_order(rng, chunks, rng.randint(min(2, chunks), chunks),
                            rng.randint(1, 5), deadlock_free=seed % 3 != 2)
    ran = check_same(schedule, rng, monkeypatch)
    if seed % 3 != 2:
        assert ran


def test_the_event_queue_where_the_order_is_not_fixed():
    """Shared links, a rank's one transfer thread, rendezvous: left to the event queue; and a
    schedule that cannot finish, whose errors the event queue's run leads to."""
    rng = random.Random(3)
    schedule = build_schedule("1f1b", 4, 8)
    costs = random_costs(rng, 4)
    graph = action_graph(checked_lowering(schedule))
    assert fixed_order.run(graph, costs, "full", False) is not None
    for duplex, rendezvous in (("half", False), ("serial", False), ("full", True),
                               ("serial", True)):
        assert fixed_order.run(graph, costs, duplex, rendezvous) is None
    stuck = next(s for s in (random_order(rng, 4, 2, 3, deadlock_free=False)
                             for _ in range(200))
                 if isinstance(outcome(s, random_costs(rng, 4)), tuple) and
                 outcome(s, random_costs(rng, 4))[0] == "error")
    assert fixed_order.run(action_graph(checked_lowering(stuck)), random_costs(rng, 4),
                           "full", False) is None


def test_the_comparison_can_tell_a_different_clock(monkeypatch):
    """A one-pass clock that ignores a busy channel (each send on a channel of its own) is
    caught: GPipe's forward transfers queue on a link slower than the forwards."""
    schedule = build_schedule("gpipe", 2, 4)
    costs = random_costs(random.Random(1), 2)
    costs.forward_ms, costs.send_forward_ms = [1.0, 1.0], [5.0]
    graph = action_graph(checked_lowering(schedule))
    right = fixed_order.run(graph, costs, "full", False)
    fixed = fixed_order.fixed_order(graph)
    own = tuple(i if ch >= 0 else -1 for i, ch in enumerate(fixed.channel))
    monkeypatch.setattr(fixed_order, "fixed_order", lambda g: fixed_order.FixedOrder(
        fixed.duration_key, own, fixed.send_key, len(own), fixed.events))
    wrong = fixed_order.run(graph, costs, "full", False)
    assert sorted_events(wrong[0]) != sorted_events(right[0])
    assert sorted_events(right[0]) == sorted_events(event_loop.run(graph, costs, "full",
                                                                   False)[0])


@pytest.mark.parametrize("seed", range(20))
def test_peaks_are_peak_held_three_times(seed):
    """`peaks` (one sort) gives what three `peak_held` calls give, bit for bit."""
    rng = random.Random(7000 + seed)
    schedule = generated(rng)
    C = schedule.num_chunks
    result = simulate(schedule, random_costs(rng, C))
    held = [rng.choice((0.1, 0.2, 0.3, 1.0, 1e-3)) for _ in range(C)]
    awaiting = [rng.choice((0.1, 0.7, 0.3)) for _ in range(C)]
    for p in range(result.num_stages):
        mine = [e for e in result.stage_events(p) if e.kind != "allreduce"]
        assert peaks(mine, held, awaiting) == (
            peak_held(mine, p, [1.0] * C, [0.0] * C), peak_held(mine, p, held, awaiting),
            peak_held(mine, p, [0.0] * C, [1.0] * C))
