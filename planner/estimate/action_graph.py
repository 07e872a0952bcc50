"""A lowered schedule as numbers: every action numbered, position by position in list order,
with the numbers of the actions it reads (`planner.schedules.lowering.needs`) and, for a send, of the
receive it feeds. The simulator's inner loop runs on these instead of building and hashing
`Action`s for every input it checks. Built once per lowered schedule: the planner simulates
one schedule with several sets of durations, and `planner.schedules.by_name.build_schedule` returns
the same schedule for the same parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from planner.schedules.actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                                       RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD,
                                       Action, Schedule)
from planner.schedules.identity_cache import cached_by_identity
from planner.schedules.lowering import backward_kinds, needs

MISSING = -1            # an input that no list holds (the schedule cannot finish)


@dataclass(frozen=True, eq=False)
class ActionGraph:
    schedule: Schedule                      # lowered
    first: Tuple[int, ...]                  # per position, its first action's number; then the count
    actions: Tuple[Action, ...]             # by number
    inputs: Tuple[Tuple[int, ...], ...]     # by number: what it reads, in `needs` order
    receiver: Tuple[int, ...]               # by number: a send's receiving position, else -1
    receive: Tuple[int, ...]                # by number: the receive a send feeds, else -1


@cached_by_identity(64)
def action_graph(lowered: Schedule) -> ActionGraph:
    """The numbered graph of `lowered`, remembered for the last few schedules."""
    # Keyed by plain tuples: hashing them is cheaper than hashing (position, Action).
    first, actions, number = [], [], {}
    for p, lst in enumerate(lowered.lists):
        first.append(len(actions))
        for a in lst:
            number[(p, a.chunk, a.kind, a.micro_batch)] = len(actions)
            actions.append(a)
    first.append(len(actions))
    C, placement, get = lowered.num_chunks, lowered.placement, number.get
    last = C - 1
    backward = backward_kinds(lowered)
    inputs, receiver, receive = [], [], []
    for p, lst in enumerate(lowered.lists):
        for a in lst:
            kind, c, m = a.kind, a.chunk, a.micro_batch
            to = -1
            # `needs`, as numbers, for the kinds every schedule is made of (tested against it)
            if kind == FORWARD and not a.version:
                reads = ((get((p, c - 1, FORWARD, m) if placement[c - 1] == p else
                              (p, c, RECV_FORWARD, m), MISSING),) if c > 0 else ())
            elif kind == BACKWARD or kind == BACKWARD_INPUT:
                reads = ((get((p, c, FORWARD, m), MISSING),
                          get((p, c + 1, backward[c + 1], m) if placement[c + 1] == p else
                              (p, c, RECV_BACKWARD, m), MISSING)) if c < last else
                         (get((p, c, FORWARD, m), MISSING),))
            elif kind == BACKWARD_WEIGHT:
                reads = (get((p, c, BACKWARD_INPUT, m), MISSING),)
            elif kind == SEND_FORWARD:
                reads = (get((p, c, FORWARD, m), MISSING),)
                to = placement[c + 1]
                receive.append(get((to, c + 1, RECV_FORWARD, m), MISSING))
            elif kind == SEND_BACKWARD:
                reads = (get((p, c, backward[c], m), MISSING),)
                to = placement[c - 1]
                receive.append(get((to, c - 1, RECV_BACKWARD, m), MISSING))
            elif kind == RECV_FORWARD:
                reads = (get((placement[c - 1], c - 1, SEND_FORWARD, m), MISSING),)
            elif kind == RECV_BACKWARD:
                reads = (get((placement[c + 1], c + 1, SEND_BACKWARD, m), MISSING),)
            else:
                reads = tuple([get((q, n.chunk, n.kind, n.micro_batch), MISSING)
                               for q, n in needs(lowered, p, a)])
            inputs.append(reads)
            receiver.append(to)
            if to < 0:
                receive.append(MISSING)
    return ActionGraph(lowered, tuple(first), tuple(actions), tuple(inputs), tuple(receiver),
                       tuple(receive))
