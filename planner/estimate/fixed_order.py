"""The simulator's clock when the order of everything is fixed in advance: one pass, no queue.

With full-duplex transfers sent as soon as they are sent ("full", no rendezvous; the default,
a plan's "async"), nothing is decided by time:

* a position runs its list in order;
* a channel (one direction of one link) carries the sends of one position, to one other, in
  that position's list order: they enter its queue in list order, at non-decreasing times
  (each send starts no earlier than the action before it), so first ready first served,
  ties first produced, is list order; and no other channel shares what it occupies.

So every start is the longest path to it (`planner.estimate.simulator` states the model):
an action starts at max(when its position is free, when each input is done, its floor: a
forward's `start_ms`), a transfer at max(when its channel's previous transfer ends, when its
send starts), with the event queue's own comparisons (`planner.estimate.event_loop`), so the
same floats. The actions are visited
in an order that respects these dependencies: each position runs down its list until an input
is not done yet, and is resumed when that input is done. Nothing here depends on the order in
which positions are visited, only on each value's inputs.

Other link models ("half": two directions share a link; "serial": a position's transfers one
at a time; rendezvous) let times decide which transfer goes first; `run` returns None for
them, and for a schedule that cannot finish (whose errors `event_loop.run` and the simulator
report), and the simulator runs the event queue.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from planner.schedules.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT,
                                       FORWARD, SEND_FORWARD)
from planner.schedules.identity_cache import cached_by_identity
from planner.estimate.action_graph import ActionGraph
from planner.estimate.event_loop import EVENT_KIND, start_floors
from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate.simulation_result import (SEND_BACKWARD_KIND, SEND_FORWARD_KIND,
                                                TimelineEvent)

# Durations by kind: an action's entry in `duration_table` is 1 + KIND_ROW[kind] x C + chunk;
# entry 0 (no time on the position) is every other action's.
KIND_ROW = {FORWARD: 0, BACKWARD: 1, BACKWARD_INPUT: 2, BACKWARD_WEIGHT: 3, ALLREDUCE: 4}


@dataclass(frozen=True, eq=False)
class FixedOrder:
    """What a run needs of a numbered schedule that does not depend on durations."""
    duration_key: Tuple[int, ...]       # by number: its entry in `duration_table`
    channel: Tuple[int, ...]            # by number: a send's channel, numbered; else -1
    send_key: Tuple[int, ...]           # by number: a send's entry in the send times; else -1
    channels: int
    # Timeline events, in action number order: (number, kind, stage, micro-batch, position,
    # whether it is a send, whether it is an allreduce: not shown when it takes no time).
    events: Tuple[Tuple, ...]


@cached_by_identity(64)
def fixed_order(graph: ActionGraph) -> FixedOrder:
    """The durations' entries, channels and timeline events of `graph`'s actions."""
    C, first = graph.schedule.num_chunks, graph.first
    duration_key, channel, send_key, events = [], [], [], []
    numbered = {}
    row_of, event_kind = KIND_ROW.get, EVENT_KIND.get
    positions = [p for p in range(len(first) - 1) for _ in range(first[p + 1] - first[p])]
    for i, (a, p, to) in enumerate(zip(graph.actions, positions, graph.receiver)):
        kind, c = a.kind, a.chunk
        row = row_of(kind)
        duration_key.append(0 if row is None else 1 + row * C + c)
        if to >= 0:                         # a send
            forward = kind == SEND_FORWARD
            channel.append(numbered.setdefault((p, to), len(numbered)))
            send_key.append(c if forward else C - 1 + c - 1)
            events.append((i, SEND_FORWARD_KIND if forward else SEND_BACKWARD_KIND,
                           c if forward else c - 1, a.micro_batch, p, True, False))
        else:
            channel.append(-1)
            send_key.append(-1)
            shown = event_kind(kind)
            if shown is not None:
                events.append((i, shown, c, a.micro_batch, p, False, kind == ALLREDUCE))
    return FixedOrder(tuple(duration_key), tuple(channel), tuple(send_key), len(numbered),
                      tuple(events))


def duration_table(costs: PipelineCosts) -> List[float]:
    """[0.0] + per kind of `KIND_ROW`, per chunk: `event_loop.action_duration`'s values."""
    C = costs.num_stages
    backward = costs.backward_ms
    first = (list(costs.input_gradient_ms) if costs.input_gradient_ms
             else [backward[c] / 2 for c in range(C)])
    return ([0.0] + list(costs.forward_ms) + list(backward) + first +
            [backward[c] - first[c] for c in range(C)] + list(costs.allreduce_ms))


def new_event(kind, stage, micro_batch, start_ms, end_ms, position,
              _new=object.__new__, _cls=TimelineEvent) -> TimelineEvent:
    """TimelineEvent(kind, stage, micro_batch, start_ms, end_ms, position), made without its
    frozen dataclass __init__ (which sets each field through object.__setattr__): less than
    half the time, the same object."""
    e = _new(_cls)
    e.__dict__.update(kind=kind, stage=stage, micro_batch=micro_batch, start_ms=start_ms,
                      end_ms=end_ms, position=position)
    return e


def run(graph: ActionGraph, costs: PipelineCosts, link_duplex: str, rendezvous: bool
        ) -> Optional[Tuple[List[TimelineEvent], List[float], List[int]]]:
    """`event_loop.run`'s result (its events in another order, the same once the simulator
    sorts them), or None when the order is not fixed or the schedule does not finish."""
    if link_duplex != "full" or rendezvous:
        return None
    fixed = fixed_order(graph)
    P, first, inputs = graph.schedule.num_positions, graph.first, graph.inputs
    N = first[P]
    table = duration_table(costs)
    duration = [table[k] for k in fixed.duration_key]
    floor = start_floors(graph.actions, costs)
    send_times = list(costs.send_forward_ms) + list(costs.send_backward_ms)
    channel, send_key = fixed.channel, fixed.send_key
    # done[i]: when action i's result is there (a send's: its transfer's end); done[-1] (an
    # input no list holds, MISSING) stays None.
    done: List[Optional[float]] = [None] * (N + 1)
    start = [0.0] * N
    transfer_start = [0.0] * N
    busy = [0.0] * fixed.channels           # when each channel's last transfer ends
    waiting: List[Optional[List[int]]] = [None] * (N + 1)   # positions stopped at an input
    head = list(first[:P])
    free_at = [0.0] * P
    todo = list(range(P))
    while todo:
        p = todo.pop()
        i, last, free = head[p], first[p + 1], free_at[p]
        while i < last:
            ready = floor[i]
            for n in inputs[i]:
                d = done[n]
                if d is None:
                    w = waiting[n]
                    if w is None:
                        waiting[n] = [p]
                    else:
                        w.append(p)
                    break
                if d > ready:
                    ready = d
            else:
                s = free if free > ready else ready
                start[i] = s
                ch = channel[i]
                if ch < 0:
                    free = done[i] = s + duration[i]
                else:               # the sender goes on at once; its channel when free
                    b = busy[ch]
                    t = s if s > b else b           # max(b, s), as the event queue
                    transfer_start[i] = t
                    busy[ch] = done[i] = t + send_times[send_key[i]]
                    free = s
                w = waiting[i]
                if w is not None:
                    todo.extend(w)
                i += 1
                continue
            break
        head[p], free_at[p] = i, free
    if any(head[p] < first[p + 1] for p in range(P)):
        return None                 # stuck: the event queue names what waits for what
    events = []
    new, cls = object.__new__, TimelineEvent      # `new_event`, inlined
    for i, kind, stage, m, p, send, allreduce in fixed.events:
        if send:
            s = transfer_start[i]
        else:
            s = start[i]
            if allreduce and done[i] == s:
                continue
        e = new(cls)
        e.__dict__.update(kind=kind, stage=stage, micro_batch=m, start_ms=s, end_ms=done[i],
                          position=p)
        events.append(e)
    return events, free_at, [first[p + 1] - first[p] for p in range(P)]
