"""A synchronous schedule's iteration timed straight from its compute lists: no lowering, no
numbered action graph, no timeline.

`planner.estimate.fixed_order` times every lowered action (sends, receives, allreduces
included) and builds the timeline. Choosing a schedule needs only the iteration, and a
simulated estimate (`cost_model.PlanCosts.estimate`) also position 0's first backward start
and last forward end. What lowering adds is implied by the compute lists
(`planner.schedules.lowering`): a receive before a forward or backward whose producer runs on
another position, a send after its producer, the chunk's allreduce after its M-th weight
gradient. So each compute action starts at max(when its position is free, what it reads: the
arrival of the transfer for a cross-position input, else the producer's end; a forward also
its chunk's `start_ms`), a transfer at
max(when its channel is free, its producer's end), with the same max and + of the same floats
as `fixed_order.run`, so the same iteration bit for bit (the latest end of any action,
`tests/planner/estimate/test_compute_pass.py` against the simulator).

Only what that covers: full-duplex transfers sent at once, one batch, no updates or weight
versions, compute actions only. Anything else, and any schedule that does not run to the end
or is not one F and one B (or I and W) of each micro-batch per chunk, gives None: the
simulator then runs and says what is wrong.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from planner.schedules.actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                                       Schedule)
from planner.estimate.fixed_order import duration_table
from planner.estimate.pipeline_costs import PipelineCosts


class PassTiming(NamedTuple):
    iteration_ms: float
    first_backward_ms: float    # position 0: the least start of a B, I, W or allreduce shown
    last_forward_ms: float      # position 0: the latest end of a forward


def iteration(schedule: Schedule, costs: PipelineCosts, link_duplex: str,
              rendezvous: bool) -> Optional[PassTiming]:
    """The timing of the unlowered `schedule` with durations `costs`, or None when this pass
    does not apply (the simulator's `simulate` does then)."""
    if link_duplex != "full" or rendezvous or schedule.batches != 1 or schedule.averaging or \
            schedule.has_updates:
        return None
    C, P, placement = schedule.num_chunks, schedule.num_positions, schedule.placement
    if C == 0 or costs.num_stages != C or len(costs.allreduce_ms) != C or \
            len(costs.send_forward_ms) != C - 1 or len(costs.send_backward_ms) != C - 1:
        return None
    for name in ("forward_ms", "backward_ms", "send_forward_ms", "send_backward_ms",
                 "allreduce_ms", "start_ms"):
        if not all(v >= 0 for v in getattr(costs, name)):
            return None                 # the simulator's error
    M = schedule.micro_batches
    table = duration_table(costs)
    forward, backward = table[1:1 + C], table[1 + C:1 + 2 * C]
    first_half, second_half = table[1 + 2 * C:1 + 3 * C], table[1 + 3 * C:1 + 4 * C]
    allreduce = table[1 + 4 * C:1 + 5 * C]
    send_forward, send_backward = list(costs.send_forward_ms), list(costs.send_backward_ms)
    floor = list(costs.start_ms) or [0.0] * C     # a forward's earliest start, per chunk
    split = schedule.split_chunks
    # A chunk's transfer channel (position to position, one direction; -1: no transfer).
    channels: dict = {}
    to_next = [channels.setdefault((placement[c], placement[c + 1]), len(channels))
               if c + 1 < C and placement[c + 1] != placement[c] else -1 for c in range(C)]
    to_previous = [channels.setdefault((placement[c], placement[c - 1]), len(channels))
                   if c > 0 and placement[c - 1] != placement[c] else -1 for c in range(C)]
    busy = [0.0] * len(channels)
    # done[slot + c * M + m]: forward end (slot 0), input-gradient end (B or I, CM), forward
    # arrival at chunk c + 1 (2CM), backward arrival at chunk c - 1 (3CM), W end (4CM).
    CM = C * M
    GRAD, ARRIVE_F, ARRIVE_B, WEIGHT = CM, 2 * CM, 3 * CM, 4 * CM
    done: list = [None] * (5 * CM)
    waiting: list = [None] * (5 * CM)
    gradients = [0] * C             # weight gradients (B or W) so far, per chunk
    head, free_at = [0] * P, [0.0] * P
    latest = 0.0
    first_backward = last_forward = None
    todo = list(range(P))
    while todo:
        p = todo.pop()
        lst, i, free = schedule.lists[p], head[p], free_at[p]
        n = len(lst)
        while i < n:
            a = lst[i]
            kind, c, m = a.kind, a.chunk, a.micro_batch
            if a.version is not None or not 0 <= c < C or placement[c] != p or \
                    m is None or not 0 <= m < M:
                return None
            k = c * M + m
            if kind == FORWARD:
                if c > 0:
                    need = (ARRIVE_F + k - M) if to_next[c - 1] >= 0 else k - M
                    d = done[need]
                    if d is None:
                        w = waiting[need]
                        if w is None:
                            waiting[need] = [p]
                        else:
                            w.append(p)
                        break
                    if floor[c] > d:
                        d = floor[c]
                    s = free if free > d else d
                else:
                    d = floor[c]
                    s = free if free > d else d
                if done[k] is not None:
                    return None             # twice
                end = done[k] = s + forward[c]
                free = end
                if p == 0 and (last_forward is None or end > last_forward):
                    last_forward = end
                ch = to_next[c]
                if ch >= 0:                 # the send: at once, its channel when free
                    b = busy[ch]
                    t = end if end > b else b
                    end = busy[ch] = done[ARRIVE_F + k] = t + send_forward[c]
                    w = waiting[ARRIVE_F + k]
                    if w is not None:
                        todo.extend(w)
                w = waiting[k]
                if w is not None:
                    todo.extend(w)
            elif kind == BACKWARD or kind == BACKWARD_INPUT:
                if (kind == BACKWARD_INPUT) != (c in split):
                    return None
                d = done[k]
                need = k
                if d is not None and c + 1 < C:
                    need = (ARRIVE_B + k + M) if to_previous[c + 1] >= 0 else (GRAD + k + M)
                    e = done[need]
                    d = None if e is None else (e if e > d else d)
                if d is None:
                    w = waiting[need]
                    if w is None:
                        waiting[need] = [p]
                    else:
                        w.append(p)
                    break
                s = free if free > d else d
                if done[GRAD + k] is not None:
                    return None
                end = done[GRAD + k] = s + (backward[c] if kind == BACKWARD else first_half[c])
                free = end
                if p == 0 and (first_backward is None or s < first_backward):
                    first_backward = s
                w = waiting[GRAD + k]
                if w is not None:
                    todo.extend(w)
                ch = to_previous[c]
                if ch >= 0:
                    b = busy[ch]
                    t = end if end > b else b
                    arrival = busy[ch] = done[ARRIVE_B + k] = t + send_backward[c - 1]
                    if arrival > latest:
                        latest = arrival
                    w = waiting[ARRIVE_B + k]
                    if w is not None:
                        todo.extend(w)
                    end = free
                if kind == BACKWARD:
                    gradients[c] += 1
            elif kind == BACKWARD_WEIGHT:
                if c not in split:
                    return None
                d = done[GRAD + k]
                if d is None:
                    w = waiting[GRAD + k]
                    if w is None:
                        waiting[GRAD + k] = [p]
                    else:
                        w.append(p)
                    break
                s = free if free > d else d
                if done[WEIGHT + k] is not None:
                    return None
                end = free = done[WEIGHT + k] = s + second_half[c]
                if p == 0 and (first_backward is None or s < first_backward):
                    first_backward = s
                gradients[c] += 1
            else:
                return None                 # data movement or updates: the simulator's
            if end > latest:
                latest = end
            if (kind == BACKWARD or kind == BACKWARD_WEIGHT) and gradients[c] == M:
                s = free                    # the allreduce, after the last weight gradient
                free = s + allreduce[c]
                if free > latest:
                    latest = free
                if p == 0 and free != s and (first_backward is None or s < first_backward):
                    first_backward = s
            i += 1
        head[p], free_at[p] = i, free
    if any(head[p] < len(schedule.lists[p]) for p in range(P)):
        return None                         # stuck: the simulator names what waits
    if None in done[:2 * CM] or any(None in done[WEIGHT + c * M:WEIGHT + (c + 1) * M]
                                    for c in split):
        return None                         # an action missing: the simulator's error
    return PassTiming(latest, 0.0 if first_backward is None else first_backward,
                      0.0 if last_forward is None else last_forward)
