"""Lowering: a schedule's compute actions + where chunks run -> the same lists with data movement.

The one place that knows how data moves between chunks (the runtime and the simulator both run
its output, neither derives transfers on its own):

* chunk c's forward reads chunk c-1's outputs of the same micro-batch: when the two chunks run
  on different positions, `c-1 SEND_F m` follows the producing forward and `c RECV_F m` precedes
  the consuming one;
* chunk c's backward (B, or I of a split backward) reads the gradients of its outputs from chunk
  c+1's backward: `c+1 SEND_B m` follows that one, `c RECV_B m` precedes this one;
* `c ALLREDUCE` follows chunk c's last weight-gradient action (B or W): the chunk's gradients,
  accumulated over micro-batches, are summed over its replicas. A schedule with weight updates
  in its lists (`planner.schedules.relaxed_lists`) has one `c ALLREDUCE u` per `c UPDATE u` instead: just
  before it (the gradients it applies), or just after it for AvgPipe (the pipelines' updates);
* a forward reading weight version v > 0 waits for the update that makes it, `c UPDATE v-1`.

Sends never wait for their receiver (a sender's next action starts when its own work is done);
a receive waits for its send. `needs` states every action's inputs for the replay and the
simulator.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Dict, List, Tuple

from planner.schedules.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                             RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD, UPDATE,
                             Action, Schedule, ScheduleError, shared_action)

Located = Tuple[int, Action]            # (position, action)


def check_compute(schedule: Schedule) -> None:
    """Every chunk runs, on its position, F of every micro-batch once and either B or I and W
    of each once; with weight updates, UPDATE 0, 1, ... in order, every gradient applied by
    one, and each backward reading the version its forward read."""
    C, placement = schedule.num_chunks, schedule.placement
    M = schedule.micro_batches
    updates = _updates(schedule)
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
        mine = [a for a in lst if a.chunk == c and a.kind != UPDATE]
        split = any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for a in mine)
        kinds = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (FORWARD, BACKWARD)
        # Actions are equal when (chunk, kind, micro-batch) are: compared as tuples first,
        # which hash faster; the Actions only to say what is wrong.
        expected_keys = {(c, k, m) for k in kinds for m in range(M)}
        if len(mine) != len(expected_keys) or \
                {(a.chunk, a.kind, a.micro_batch) for a in mine} != expected_keys:
            _refuse_chunk(placement[c], c, M, kinds, mine)
        _check_updates(schedule, c, lst, mine, updates)


def _refuse_chunk(p: int, c: int, M: int, kinds, mine) -> None:
    """The ScheduleError for chunk c, whose compute actions `mine` are not one of each of
    `kinds` for each micro-batch: what is missing, repeated and unexpected."""
    expected = {shared_action(c, k, m) for k in kinds for m in range(M)}
    missing = sorted(expected - set(mine))
    repeated = sorted(a for a, n in Counter(mine).items() if n > 1)
    stray = sorted(set(mine) - expected)
    raise ScheduleError(
        f"position {p}: chunk {c} must run {'F, I and W' if len(kinds) == 3 else 'F and B'}"
        f" of micro-batches 0..{M - 1} once each; missing {[str(a) for a in missing]}, "
        f"repeated {[str(a) for a in repeated]}, unexpected {[str(a) for a in stray]}")


def _check_updates(schedule: Schedule, c: int, lst, mine, any_updates: bool) -> None:
    """Chunk c's updates, as `check_compute` states; `any_updates`: whether any chunk has one."""
    updates = [a.micro_batch for a in lst if a.chunk == c and a.kind == UPDATE]
    if updates != list(range(len(updates))) or (not updates and any_updates):
        raise ScheduleError(f"position {schedule.placement[c]}: chunk {c} must run UPDATE "
                            f"0, 1, 2, ... in this order (every chunk updates, or none); it "
                            f"runs {updates}")
    if updates:
        applied = {a for u in updates for a in schedule.update_inputs[(c, u)]}
        left = [str(a) for a in mine if a.kind in (BACKWARD, BACKWARD_WEIGHT) and a not in applied]
        if left:
            raise ScheduleError(f"position {schedule.placement[c]}: chunk {c}'s gradients of "
                                f"{left} are never applied: put an UPDATE after them")
    read = {a.micro_batch: a.version for a in mine if a.kind == FORWARD}
    wrong = [str(a) for a in mine if a.kind != FORWARD and a.version != read[a.micro_batch]]
    if wrong:
        raise ScheduleError(f"position {schedule.placement[c]}: {wrong} must read the weight "
                            f"version their forwards read (weight stashing)")


def _updates(schedule: Schedule) -> bool:
    """Whether any list applies weight updates (a multi-batch schedule)."""
    return any(a.kind == UPDATE for lst in schedule.lists for a in lst)


def _backward_kind(schedule: Schedule, chunk: int) -> str:
    """The action that computes `chunk`'s input gradients: B, or I when its backward is split."""
    return BACKWARD_INPUT if chunk in schedule.split_chunks else BACKWARD


def backward_kinds(schedule: Schedule) -> List[str]:
    """`_backward_kind` of every chunk, in chunk order."""
    return [_backward_kind(schedule, c) for c in range(schedule.num_chunks)]


def lower(schedule: Schedule) -> Schedule:
    """Add the sends, receives and allreduces to `schedule`'s compute lists."""
    check_compute(schedule)
    C, placement = schedule.num_chunks, schedule.placement

    def crosses(a: int, b: int) -> bool:
        return placement[a] != placement[b]

    lists = []
    for lst in schedule.lists:
        last_gradient: Dict[int, int] = {}
        updating = {a.chunk for a in lst if a.kind == UPDATE}
        for i, a in enumerate(lst):
            if a.kind in (BACKWARD, BACKWARD_WEIGHT) and a.chunk not in updating:
                last_gradient[a.chunk] = i
        out: List[Action] = []
        for i, a in enumerate(lst):
            c, m = a.chunk, a.micro_batch
            backward = a.kind in (BACKWARD, BACKWARD_INPUT)
            if a.kind == FORWARD and c > 0 and crosses(c - 1, c):
                out.append(shared_action(c, RECV_FORWARD, m))
            if backward and c < C - 1 and crosses(c, c + 1):
                out.append(shared_action(c, RECV_BACKWARD, m))
            if a.kind == UPDATE and not schedule.averaging:
                out.append(shared_action(c, ALLREDUCE, m))
            out.append(a)
            if a.kind == UPDATE and schedule.averaging:
                out.append(shared_action(c, ALLREDUCE, m))
            if a.kind == FORWARD and c < C - 1 and crosses(c, c + 1):
                out.append(shared_action(c, SEND_FORWARD, m))
            if backward and c > 0 and crosses(c - 1, c):
                out.append(shared_action(c, SEND_BACKWARD, m))
            if last_gradient.get(c) == i:
                out.append(shared_action(c, ALLREDUCE))
        lists.append(tuple(out))
    return dataclasses.replace(schedule, lists=tuple(lists))


def peer(action: Action) -> Action:
    """The send a receive waits for."""
    if action.kind == RECV_FORWARD:
        return shared_action(action.chunk - 1, SEND_FORWARD, action.micro_batch)
    if action.kind == RECV_BACKWARD:
        return shared_action(action.chunk + 1, SEND_BACKWARD, action.micro_batch)
    raise ValueError(f"{action} is not a receive")


def needs(schedule: Schedule, position: int, action: Action) -> List[Located]:
    """The actions whose results `action` (on `position` of the lowered `schedule`) reads."""
    C, placement = schedule.num_chunks, schedule.placement
    c, m, kind = action.chunk, action.micro_batch, action.kind

    def produced(chunk: int, produce: Action, receive_kind: str) -> Located:
        # Read locally when the producing chunk runs here, else through this position's receive.
        if placement[chunk] == position:
            return (position, produce)
        return (position, shared_action(c, receive_kind, m))

    if kind in (RECV_FORWARD, RECV_BACKWARD):
        sender = peer(action)
        return [(placement[sender.chunk], sender)]
    if kind == FORWARD:
        out = [produced(c - 1, shared_action(c - 1, FORWARD, m), RECV_FORWARD)] if c > 0 else []
        if action.version:                  # the update that makes the version it reads
            out.append((position, shared_action(c, UPDATE, action.version - 1)))
        return out
    if kind in (BACKWARD, BACKWARD_INPUT):
        out = [(position, shared_action(c, FORWARD, m))]
        if c < C - 1:
            out.append(produced(c + 1, shared_action(c + 1, _backward_kind(schedule, c + 1), m),
                                RECV_BACKWARD))
        return out
    if kind == BACKWARD_WEIGHT:
        return [(position, shared_action(c, BACKWARD_INPUT, m))]
    if kind == SEND_FORWARD:
        return [(position, shared_action(c, FORWARD, m))]
    if kind == SEND_BACKWARD:
        return [(position, shared_action(c, _backward_kind(schedule, c), m))]
    if kind == UPDATE:
        out = [(position, g) for g in schedule.update_inputs[(c, m)]]
        if not schedule.averaging:
            out.append((position, shared_action(c, ALLREDUCE, m)))
        elif m > 0:                         # z after the previous step's updates
            out.append((position, shared_action(c, ALLREDUCE, m - 1)))
        return out
    if m is not None:                       # ALLREDUCE of update m
        if schedule.averaging:
            return [(position, shared_action(c, UPDATE, m))]
        return [(position, g) for g in schedule.update_inputs[(c, m)]]
    # ALLREDUCE: every weight gradient of the chunk
    gradient = BACKWARD if _backward_kind(schedule, c) == BACKWARD else BACKWARD_WEIGHT
    return [(position, shared_action(c, gradient, mb)) for mb in range(schedule.micro_batches)]
