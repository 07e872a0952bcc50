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

from planner.schedules.actions import (RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD, Action,
                             Schedule)
from planner.schedules.identity_cache import cached_by_identity
from planner.schedules.lowering import needs

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
    inputs, receiver, receive = [], [], []
    for p in range(lowered.num_positions):
        for a in lowered.lists[p]:
            inputs.append(tuple([number.get((q, n.chunk, n.kind, n.micro_batch), MISSING)
                                 for q, n in needs(lowered, p, a)]))
            if a.kind in (SEND_FORWARD, SEND_BACKWARD):
                forward = a.kind == SEND_FORWARD
                chunk = a.chunk + 1 if forward else a.chunk - 1
                to = lowered.placement[chunk]
                receiver.append(to)
                receive.append(number.get((to, chunk, RECV_FORWARD if forward else RECV_BACKWARD,
                                           a.micro_batch), MISSING))
            else:
                receiver.append(-1)
                receive.append(MISSING)
    return ActionGraph(lowered, tuple(first), tuple(actions), tuple(inputs), tuple(receiver),
                       tuple(receive))
