"""Replaying a lowered schedule: does it run to the end, in what order, holding how much.

All positions run their lists together in unit time steps; each runs its next action as soon as
everything that action reads (`planner.schedules.lowering.needs`) is done. Compute takes one step; data
movement takes none (a send or receive that can run, runs at once). The replay checks what the
runtime relies on:

* every action appears exactly once (`planner.schedules.lowering.check_compute`, and each transfer and
  allreduce once);
* the lists run to the end when all positions run together: otherwise `ScheduleError` names
  every stuck action and what it waits for;
* each position's peak number of held micro-batches (full activations, kept from a forward
  until its B, or I of a split backward) and of micro-batches awaiting W
  (`planner.schedules.memory`).

The order it returns respects every data dependency; the runtime builds its graph in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Set

from planner.schedules.actions import Schedule, ScheduleError
from planner.schedules.identity_cache import cached_by_identity
from planner.schedules.lowering import Located, check_compute, lower, needs
from planner.schedules.memory import peak_counts


@dataclass
class Replay:
    schedule: Schedule                  # lowered
    order: List[Located]                # completion order, one step's actions by position
    peak_held: List[int]                # per position: micro-batches whose activations it holds
    peak_awaiting_weight: List[int]     # per position: micro-batches past I, before W


def replay(schedule: Schedule) -> Replay:
    """Lower `schedule` (unless it is lowered already) and run all positions together."""
    lowered = checked_lowering(schedule)
    done: Set[Located] = set()
    position = [0] * lowered.num_positions
    order: List[Located] = []

    def next_ready(p: int, compute: bool):
        lst = lowered.lists[p]
        if position[p] < len(lst):
            a = lst[position[p]]
            if a.is_compute == compute and all(n in done for n in needs(lowered, p, a)):
                return a
        return None

    while True:
        moved = True
        while moved:                       # data movement: no time
            moved = False
            for p in range(lowered.num_positions):
                a = next_ready(p, compute=False)
                if a is not None:
                    done.add((p, a))
                    position[p] += 1
                    order.append((p, a))
                    moved = True
        if all(position[p] >= len(lst) for p, lst in enumerate(lowered.lists)):
            break
        ready = [(p, a) for p in range(lowered.num_positions)
                 for a in [next_ready(p, compute=True)] if a is not None]
        if not ready:
            raise ScheduleError("schedule deadlocks; " + _stuck(lowered, position, done))
        for p, a in ready:
            done.add((p, a))
            position[p] += 1
            order.append((p, a))
    return Replay(lowered, order, *peak_counts(lowered))


@cached_by_identity(64)
def checked_lowering(schedule: Schedule) -> Schedule:
    """`schedule` lowered (unless it is lowered already), each action once in its list; whether
    it runs to the end is `replay`'s to say."""
    if schedule.lowered:
        check_compute(schedule.compute())
        lowered = schedule
    else:
        lowered = lower(schedule)
    for p, lst in enumerate(lowered.lists):
        if len({(a.chunk, a.kind, a.micro_batch) for a in lst}) != len(lst):   # Action equality
            seen: Set = set()
            twice = next(a for a in lst if a in seen or seen.add(a))
            raise ScheduleError(f"position {p}: {twice} appears twice")
    return lowered


def _stuck(schedule: Schedule, position: List[int], done: Set[Located]) -> str:
    lines = []
    where: Dict = {(p, a): i for p, lst in enumerate(schedule.lists) for i, a in enumerate(lst)}
    for p, lst in enumerate(schedule.lists):
        if position[p] >= len(lst):
            continue
        a = lst[position[p]]
        waits = []
        for q, n in needs(schedule, p, a):
            if (q, n) in done:
                continue
            if (q, n) not in where:
                waits.append(f"{n} on position {q}, which no list holds")
            elif q == p:
                waits.append(f"its own {n}, which comes later in its list")
            else:
                at = schedule.lists[q][position[q]] if position[q] < len(schedule.lists[q]) \
                    else None
                waits.append(f"{n} on position {q} (stuck at {at})")
        lines.append(f"position {p} at {a} waits for " + " and ".join(waits))
    return "waiting actions: " + "; ".join(lines)
