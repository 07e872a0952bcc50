"""Schedules over k consecutive global batches with the weight updates in the lists: where each
stage updates, and which weight version every forward and backward reads (the specs in
`planner.schedules` name and parameterize them).

Micro-batches are numbered over the run: global batch t holds micro-batches t M .. t M + M - 1.
`cUPDATEu` applies chunk c's gradients since its previous update and makes weight version
u + 1; `cFjvV` and `cBjvV` read version V (`planner.schedules.actions`). `planner.schedules.by_name` makes the
order of forwards and backwards; this module puts the updates and versions in:

* `flushed`: each batch's lists as they are, then `UPDATE t` on every stage; batch t reads
  version t. 1F1B this way is PipeDream-Flush/DAPPLE over k steps: a flush per batch, since a
  stage's next forward waits for its update, which waits for its last backward. AvgPipe's
  pipelines run this way (`planner.schedules.avgpipe_pipelines`).
* "2bw", PipeDream-2BW (Narayanan's dissertation, §3.2.1): 1F1B over all k M micro-batches, no
  flush; `UPDATE t` right after the backward of batch t's last micro-batch, so gradients are
  accumulated over each global batch; batch t reads version max(t - 1, 0) ("input k uses
  max(floor((k - 1)/m) - 1, 0)"), hence W(t+1) = W(t) - lr grad f(W(t-1)). Two versions at
  most, as the version batch t reads exists when batch t starts if the warm-up K_s <= M + 1.
* "pipedream", PipeDream with weight stashing (SOSP'19 §3.3; dissertation §2.4.3): 1F1B over
  all k M micro-batches, no flush. A PipeDream "minibatch" is what enters the pipeline, a
  micro-batch here (the dissertation: "inputs (called microbatches in GPipe)"), and "each
  backward pass results in weight updates": `UPDATE j` follows every backward B j, per
  micro-batch, not per global batch. Each forward reads the latest version on its stage and
  stashes it for its backward. With vertical sync every stage reads the version stage 0 read.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from planner.schedules.actions import (BACKWARD, BACKWARD_WEIGHT, FORWARD, UPDATE, WEIGHT_READERS, Action,
                             Schedule, ScheduleError)

DEFAULT_BATCHES = 4            # global batches one run covers (Keras's steps_per_execution)


def check_batches(batches) -> None:
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise ScheduleError(f"batches (consecutive global batches in one run) must be a "
                            f"positive integer, got {batches!r}")


def _stamped(a: Action, micro_batch: int, version: Optional[int]) -> Action:
    return Action(a.chunk, a.kind, micro_batch, version if a.kind in WEIGHT_READERS else None)


def _chunks_of(schedule: Schedule, position: int) -> List[int]:
    return [c for c, p in enumerate(schedule.placement) if p == position]


def flushed(batch: Schedule, batches: int, name: Optional[str] = None,
            averaging: bool = False) -> Schedule:
    """`batch`'s compute lists run `batches` times, each time on the next M micro-batches and
    followed by an update of every chunk; batch t reads version t."""
    check_batches(batches)
    M = batch.micro_batches
    lists = []
    for p, lst in enumerate(batch.lists):
        out: List[Action] = []
        for t in range(batches):
            out += [_stamped(a, a.micro_batch + t * M, t) for a in lst]
            out += [Action(c, UPDATE, t) for c in _chunks_of(batch, p)]
        lists.append(tuple(out))
    return dataclasses.replace(batch, name=name or batch.name, lists=tuple(lists),
                               batches=batches, averaging=averaging)


def _backwards_in_order(order: Schedule) -> None:
    for p, lst in enumerate(order.lists):
        seen: Dict[int, int] = {}
        for a in lst:
            if a.kind in (BACKWARD, BACKWARD_WEIGHT):
                if a.micro_batch < seen.get(a.chunk, -1):
                    raise ScheduleError(f"position {p}: {a} comes after a later micro-batch's "
                                        f"backward; updates need each chunk's backwards in order")
                seen[a.chunk] = a.micro_batch


def two_bw(order: Schedule, micro_batches: int, batches: int,
           name: str = "custom") -> Schedule:
    """PipeDream-2BW over `order`, 1F1B's lists over `batches` x `micro_batches` micro-batches
    (one chunk's backwards in micro-batch order); `name`: the schedule's, as its spec gives it."""
    check_batches(batches)
    M = micro_batches
    if order.micro_batches != M * batches:
        raise ScheduleError(f"{name}: the order runs {order.micro_batches} micro-batches, not "
                            f"{batches} batches of {M}")
    _backwards_in_order(order)
    lists = []
    for lst in order.lists:
        out: List[Action] = []
        for a in lst:
            t = a.micro_batch // M
            out.append(_stamped(a, a.micro_batch, max(t - 1, 0)))
            if a.kind in (BACKWARD, BACKWARD_WEIGHT) and a.micro_batch % M == M - 1:
                out.append(Action(a.chunk, UPDATE, t))
        lists.append(tuple(out))
    return _checked(dataclasses.replace(order, name=name, lists=tuple(lists), batches=batches),
                    "a stage's warm-up may exceed the micro-batches per batch by one at most")


def pipedream(order: Schedule, batches: int, vertical_sync: bool = False,
              name: str = "custom") -> Schedule:
    """PipeDream with weight stashing over `order`, 1F1B's lists over all micro-batches of
    `batches` global batches; `vertical_sync`: every stage reads stage 0's version; `name`: the
    schedule's, as its spec gives it."""
    check_batches(batches)
    _backwards_in_order(order)
    with_updates = []
    for lst in order.lists:
        out: List[Action] = []
        for a in lst:
            out.append(a)
            if a.kind in (BACKWARD, BACKWARD_WEIGHT):
                out.append(Action(a.chunk, UPDATE, a.micro_batch))
        with_updates.append(out)
    latest = [_latest_read(lst) for lst in with_updates]
    first = latest[order.placement[0]]
    lists = []
    for p, lst in enumerate(with_updates):
        read = first if vertical_sync else latest[p]
        lists.append(tuple(_stamped(a, a.micro_batch, read[(0 if vertical_sync else a.chunk,
                                                             a.micro_batch)])
                           if a.kind in WEIGHT_READERS else a for a in lst))
    return _checked(dataclasses.replace(order, name=name, lists=tuple(lists),
                                        batches=batches), "")


def _latest_read(lst) -> Dict[tuple, int]:
    """(chunk, micro-batch) -> updates the chunk applied before that micro-batch's forward."""
    done: Dict[int, int] = {}
    read = {}
    for a in lst:
        if a.kind == UPDATE:
            done[a.chunk] = a.micro_batch + 1
        elif a.kind == FORWARD:
            read[(a.chunk, a.micro_batch)] = done.get(a.chunk, 0)
    return read


def _checked(schedule: Schedule, hint: str) -> Schedule:
    """`schedule`, when every forward's version is made earlier in its list; else a clear
    error (the replay would report it as a deadlock)."""
    for p, lst in enumerate(schedule.lists):
        made: Dict[int, int] = {}
        for a in lst:
            if a.kind == UPDATE:
                made[a.chunk] = a.micro_batch + 1
            elif a.kind == FORWARD and (a.version or 0) > made.get(a.chunk, 0):
                raise ScheduleError(
                    f"{schedule.name}: position {p} runs {a} before its UPDATE{a.version - 1} "
                    f"makes weight version {a.version}" + (f"; {hint}" if hint else ""))
    return schedule
