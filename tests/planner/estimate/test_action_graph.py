"""The numbered action graph against `needs`, the lowering's statement of what each action
reads: `action_graph` numbers the common kinds without building their inputs as `Action`s;
on schedules of every kind, random orders (deadlocking ones too) and hand-lowered lists with
stray actions, the inputs, receivers and receives are those `needs` gives."""
import random

import pytest

from planner.estimate.action_graph import MISSING, action_graph
from planner.schedules.actions import (RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD,
                                       Schedule, actions)
from planner.schedules.lowering import needs
from planner.schedules.replay import checked_lowering
from tests.planner.estimate.test_fixed_order import larger
from tests.planner.estimate.test_simulator_equivalence import generated, random_order


def from_needs(lowered):
    """(inputs, receiver, receive) by number, built from `needs` and a dictionary."""
    number, n = {}, 0
    for p, lst in enumerate(lowered.lists):
        for a in lst:
            number[(p, a.chunk, a.kind, a.micro_batch)] = n
            n += 1
    inputs, receiver, receive = [], [], []
    for p, lst in enumerate(lowered.lists):
        for a in lst:
            inputs.append(tuple(number.get((q, b.chunk, b.kind, b.micro_batch), MISSING)
                                for q, b in needs(lowered, p, a)))
            if a.kind in (SEND_FORWARD, SEND_BACKWARD):
                chunk = a.chunk + 1 if a.kind == SEND_FORWARD else a.chunk - 1
                to = lowered.placement[chunk]
                receiver.append(to)
                receive.append(number.get((to, chunk, RECV_FORWARD if a.kind == SEND_FORWARD
                                           else RECV_BACKWARD, a.micro_batch), MISSING))
            else:
                receiver.append(-1)
                receive.append(MISSING)
    return tuple(inputs), tuple(receiver), tuple(receive)


def check(lowered):
    graph = action_graph(lowered)
    assert (graph.inputs, graph.receiver, graph.receive) == from_needs(lowered)


@pytest.mark.parametrize("seed", range(40))
def test_graph_reads_what_needs_says(seed):
    rng = random.Random(9000 + seed)
    check(checked_lowering(generated(rng)))
    check(checked_lowering(larger(rng)))
    chunks = rng.randint(1, 6)
    check(checked_lowering(random_order(rng, chunks, rng.randint(min(2, chunks), chunks),
                                        rng.randint(1, 4), deadlock_free=seed % 2 == 0)))


def test_inputs_no_list_holds_are_missing():
    """A hand-lowered schedule whose receives and sends have no partner."""
    lowered = Schedule("custom", (0, 1), (tuple(actions("0F0 0SEND_F0 0RECV_B1 0B0")),
                                           tuple(actions("1RECV_F0 1F0 1B0 1SEND_B0"))))
    check(lowered)
    assert MISSING in action_graph(lowered).receive or \
        any(MISSING in i for i in action_graph(lowered).inputs)
