"""Lowering: a schedule's compute actions + where chunks run -> the same lists with data movement.

The one place that knows how data moves between chunks (the runtime and the simulator both run
its output, neither derives transfers on its own):

* chunk c's forward reads chunk c-1's outputs of the same micro-batch: when the two chunks run
  on different positions, `c-1 SEND_F m` follows the producing forward and `c RECV_F m` precedes
  the consuming one;
* chunk c's backward (B, or I of a split backward) reads the gradients of its outputs from chunk
  c+1's backward: `c+1 SEND_B m` follows that one, `c RECV_B m` precedes this one;
* `c ALLREDUCE` follows chunk c's last weight-gradient action (B or W): the chunk's gradients,
  accumulated over micro-batches, are summed over its replicas.

Sends never wait for their receiver (a sender's next action starts when its own work is done);
a receive waits for its send. `needs` states every action's inputs for the replay and the
simulator.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Tuple

from planner.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                             RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD, Action,
                             Schedule, ScheduleError)

Located = Tuple[int, Action]            # (position, action)


def check_compute(schedule: Schedule) -> None:
    """Every chunk runs, on its position, F of every micro-batch once and either B or I and W
    of each once."""
    C, placement = schedule.num_chunks, schedule.placement
    M = schedule.micro_batches
    for p, lst in enumerate(schedule.lists):
        for a in lst:
            if not a.is_compute:
                raise ScheduleError(f"position {p}: {a} moves data; give compute actions only "
                                    f"(the lowering adds data movement)")
            if not 0 <= a.chunk < C or placement[a.chunk] != p:
                raise ScheduleError(f"position {p}: {a} computes chunk {a.chunk}, which runs on "
                                    f"position {placement[a.chunk] if 0 <= a.chunk < C else '?'}")
    for c in range(C):
        lst = schedule.lists[placement[c]]
        mine = [a for a in lst if a.chunk == c]
        split = any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for a in mine)
        kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (FORWARD, BACKWARD)
        expected = {Action(c, k, m) for k in kinds for m in range(M)}
        missing = sorted(expected - set(mine))
        repeated = sorted(a for a, n in Counter(mine).items() if n > 1)
        stray = sorted(set(mine) - expected)
        if missing or repeated or stray:
            raise ScheduleError(
                f"position {placement[c]}: chunk {c} must run {'F, I and W' if split else 'F and B'}"
                f" of micro-batches 0..{M - 1} once each; missing {[str(a) for a in missing]}, "
                f"repeated {[str(a) for a in repeated]}, unexpected {[str(a) for a in stray]}")


def _backward_kind(schedule: Schedule, chunk: int) -> str:
    """The action that computes `chunk`'s input gradients: B, or I when its backward is split."""
    return BACKWARD_INPUT if chunk in schedule.split_chunks else BACKWARD


def lower(schedule: Schedule) -> Schedule:
    """Add the sends, receives and allreduces to `schedule`'s compute lists."""
    check_compute(schedule)
    C, placement = schedule.num_chunks, schedule.placement

    def crosses(a: int, b: int) -> bool:
        return placement[a] != placement[b]

    lists = []
    for lst in schedule.lists:
        last_gradient: Dict[int, int] = {}
        for i, a in enumerate(lst):
            if a.kind in (BACKWARD, BACKWARD_WEIGHT):
                last_gradient[a.chunk] = i
        out: List[Action] = []
        for i, a in enumerate(lst):
            c, m = a.chunk, a.micro_batch
            backward = a.kind in (BACKWARD, BACKWARD_INPUT)
            if a.kind == FORWARD and c > 0 and crosses(c - 1, c):
                out.append(Action(c, RECV_FORWARD, m))
            if backward and c < C - 1 and crosses(c, c + 1):
                out.append(Action(c, RECV_BACKWARD, m))
            out.append(a)
            if a.kind == FORWARD and c < C - 1 and crosses(c, c + 1):
                out.append(Action(c, SEND_FORWARD, m))
            if backward and c > 0 and crosses(c - 1, c):
                out.append(Action(c, SEND_BACKWARD, m))
            if last_gradient.get(c) == i:
                out.append(Action(c, ALLREDUCE))
        lists.append(tuple(out))
    return Schedule(schedule.name, placement, tuple(lists))


def peer(action: Action) -> Action:
    """The send a receive waits for."""
    if action.kind == RECV_FORWARD:
        return Action(action.chunk - 1, SEND_FORWARD, action.micro_batch)
    if action.kind == RECV_BACKWARD:
        return Action(action.chunk + 1, SEND_BACKWARD, action.micro_batch)
    raise ValueError(f"{action} is not a receive")


def needs(schedule: Schedule, position: int, action: Action) -> List[Located]:
    """The actions whose results `action` (on `position` of the lowered `schedule`) reads."""
    C, placement = schedule.num_chunks, schedule.placement
    c, m, kind = action.chunk, action.micro_batch, action.kind

    def produced(chunk: int, produce: Action, receive_kind: str) -> Located:
        # Read locally when the producing chunk runs here, else through this position's receive.
        if placement[chunk] == position:
            return (position, produce)
        return (position, Action(c, receive_kind, m))

    if kind in (RECV_FORWARD, RECV_BACKWARD):
        sender = peer(action)
        return [(placement[sender.chunk], sender)]
    if kind == FORWARD:
        return [produced(c - 1, Action(c - 1, FORWARD, m), RECV_FORWARD)] if c > 0 else []
    if kind in (BACKWARD, BACKWARD_INPUT):
        out = [(position, Action(c, FORWARD, m))]
        if c < C - 1:
            out.append(produced(c + 1, Action(c + 1, _backward_kind(schedule, c + 1), m),
                                RECV_BACKWARD))
        return out
    if kind == BACKWARD_WEIGHT:
        return [(position, Action(c, BACKWARD_INPUT, m))]
    if kind == SEND_FORWARD:
        return [(position, Action(c, FORWARD, m))]
    if kind == SEND_BACKWARD:
        return [(position, Action(c, _backward_kind(schedule, c), m))]
    # ALLREDUCE: every weight gradient of the chunk
    gradient = BACKWARD if _backward_kind(schedule, c) == BACKWARD else BACKWARD_WEIGHT
    return [(position, Action(c, gradient, mb)) for mb in range(schedule.micro_batches)]
