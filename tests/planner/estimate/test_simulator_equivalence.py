"""The simulator against the one it replaced (`simulator_oracle`, which scans every position
and link for each event): on every schedule generator and on random schedules, random
durations full of ties, each link model with and without rendezvous, the two give the same
result bit for bit: timeline, statistics and errors."""
import random

import pytest

from planner.schedules.actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action,
                             Schedule, ScheduleError)
from planner.estimate.pipeline_costs import PipelineCosts
from planner.schedules.by_name import build_schedule
from planner.estimate.simulator import LINK_DUPLEX_MODES, simulate
from tests.planner.estimate.simulator_oracle import reference_simulate

TRANSFERS = [(duplex, rendezvous) for duplex in LINK_DUPLEX_MODES for rendezvous in (False, True)]


def random_costs(rng, chunks):
    def some(n, zero_share=0.2):
        # Small integers (and halves) make equal times, so the tie-breaks are exercised.
        return [0.0 if rng.random() < zero_share else rng.choice((0.5, 1.0, 1.0, 2.0, 3.0))
                for _ in range(n)]
    backward = [b + 1.0 for b in some(chunks, 0.0)]
    return PipelineCosts(
        forward_ms=some(chunks), backward_ms=backward, send_forward_ms=some(chunks - 1, 0.4),
        send_backward_ms=some(chunks - 1, 0.4), allreduce_ms=some(chunks, 0.5),
        activation_bytes=[rng.choice((1.0, 2.0, 5.0)) for _ in range(chunks)],
        weight_gradient_bytes=[rng.choice((0.5, 1.0)) for _ in range(chunks)] if rng.random() < 0.5
        else [],
        input_gradient_ms=[b * rng.choice((0.25, 0.5, 0.75)) for b in backward]
        if rng.random() < 0.5 else [],
        start_ms=some(chunks, 0.5) if rng.random() < 0.5 else [])


def random_warmup(rng, S, M):
    return sorted((rng.randint(1, M) for _ in range(S)), reverse=True)


def generated(rng):
    """A schedule from one of the generators, with random sizes and parameters."""
    name = rng.choice(("gpipe", "1f1b", "A", "B", "zb-h1", "interleaved", "pipedream", "2bw",
                       "avgpipe", "1f1b-batches"))
    S, M = rng.randint(1, 5), rng.randint(1, 9)
    if name == "interleaved":
        return build_schedule(name, S, max(M, S), virtual_stages=rng.randint(1, 3))
    if name == "avgpipe":
        return build_schedule(name, S, M, batches=rng.randint(1, 3), advance=rng.randint(0, 3))
    if name == "1f1b-batches":
        return build_schedule("1f1b", S, M, batches=rng.randint(1, 3))
    warmup = random_warmup(rng, S, M) if rng.random() < 0.5 and name != "gpipe" else None
    if name in ("pipedream", "2bw"):
        return build_schedule(name, S, M, warmup, batches=rng.randint(1, 3),
                              vertical_sync=name == "pipedream" and rng.random() < 0.5)
    return build_schedule(name, S, M, warmup)


def random_order(rng, chunks, positions, M, deadlock_free=True):
    """Chunks placed at random on positions; each position's list is a random order of its
    compute actions: one that some global order respects (never deadlocks), or any."""
    placement = [rng.randrange(positions) for _ in range(chunks)]
    placement[rng.randrange(chunks)] = positions - 1           # every position in use...
    for p in range(positions):
        if p not in placement:
            placement[placement.index(max(set(placement), key=placement.count))] = p
    split = {c for c in range(chunks) if rng.random() < 0.4}
    done, lists = set(), [[] for _ in range(positions)]
    todo = [Action(c, k, m) for c in range(chunks) for m in range(M)
            for k in ((FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if c in split
                      else (FORWARD, BACKWARD))]

    def ready(a):
        c, m = a.chunk, a.micro_batch
        if a.kind == FORWARD:
            return c == 0 or Action(c - 1, FORWARD, m) in done
        if a.kind == BACKWARD_WEIGHT:
            return Action(c, BACKWARD_INPUT, m) in done
        after = BACKWARD_INPUT if c + 1 in split else BACKWARD
        return Action(c, FORWARD, m) in done and (c == chunks - 1 or
                                                   Action(c + 1, after, m) in done)
    while todo:
        candidates = [a for a in todo if ready(a)] if deadlock_free else todo
        a = rng.choice(candidates)
        todo.remove(a)
        done.add(a)
        lists[placement[a.chunk]].append(a)
    return Schedule("custom", tuple(placement), tuple(tuple(lst) for lst in lists))


def outcome(run, schedule, costs, duplex, rendezvous):
    try:
        result = run(schedule, costs, link_duplex=duplex, rendezvous=rendezvous)
    except ScheduleError as e:
        return ("error", str(e))
    return (result.to_dict(with_timeline=True), result.schedule,
            [(s.end_ms, s.chunks) for s in result.stages],
            [result.held_over_time(p) for p in range(result.num_stages)])


def check_same(schedule, rng):
    costs = random_costs(rng, schedule.num_chunks)
    for duplex, rendezvous in TRANSFERS:
        assert outcome(simulate, schedule, costs, duplex, rendezvous) == \
            outcome(reference_simulate, schedule, costs, duplex, rendezvous), \
            (str(schedule), costs, duplex, rendezvous)


@pytest.mark.parametrize("seed", range(40))
def test_generated_schedules_simulate_as_before(seed):
    rng = random.Random(seed)
    for _ in range(5):
        check_same(generated(rng), rng)


@pytest.mark.parametrize("seed", range(40))
def test_random_schedules_simulate_as_before(seed):
    rng = random.Random(1000 + seed)
    chunks = rng.randint(1, 6)
    schedule = random_order(rng, chunks, rng.randint(min(2, chunks), chunks), rng.randint(1, 5),
                            deadlock_free=seed % 4 != 3)
    check_same(schedule, rng)


def test_the_oracle_can_tell_a_different_result():
    """The comparison fails on a result that differs in one event's time."""
    schedule, costs = build_schedule("1f1b", 3, 4), random_costs(random.Random(7), 3)
    slower = PipelineCosts(**{**costs.__dict__, "forward_ms": [f + 0.5 for f in costs.forward_ms]})
    assert outcome(simulate, schedule, slower, "full", False) != \
        outcome(reference_simulate, schedule, costs, "full", False)
