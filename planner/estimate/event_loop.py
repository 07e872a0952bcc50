"""The simulator's clock (`planner.estimate.simulator` states the model): when each action of a lowered
schedule starts and ends.

Each step commits the candidate that can start first, as (start, ready, action before
transfer, position or send order): a position's next action once everything it reads is done,
or a link's next transfer. The candidates wait in one heap. A key changes only when its
position, its link or what the link shares moves, so only those are re-keyed; superseded
entries are skipped when they surface. A position whose next action waits for a result is
woken when that result is done. So an action costs a few heap operations, not a scan of every
position and link: the run grows with the number of actions alone.
"""
from __future__ import annotations

import heapq
from typing import Dict, Hashable, List, Optional, Set, Tuple

from planner.schedules.actions import (ALLREDUCE, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                             RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD, UPDATE,
                             Action)
from planner.estimate.action_graph import MISSING, ActionGraph
from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate.simulation_result import (ALLREDUCE_KIND, BACKWARD_INPUT_KIND, BACKWARD_KIND,
                                       BACKWARD_WEIGHT_KIND, FORWARD_KIND, SEND_BACKWARD_KIND,
                                       SEND_FORWARD_KIND, TimelineEvent)

EVENT_KIND = {FORWARD: FORWARD_KIND, BACKWARD: BACKWARD_KIND, BACKWARD_INPUT: BACKWARD_INPUT_KIND,
              BACKWARD_WEIGHT: BACKWARD_WEIGHT_KIND, ALLREDUCE: ALLREDUCE_KIND}


class CandidateQueue:
    """Candidates by least key; setting a candidate's key again supersedes the old one."""

    def __init__(self):
        self._heap: List[Tuple] = []
        self._live: Dict[Hashable, int] = {}      # candidate -> stamp of its current entry
        self._stamp = 0

    def set(self, candidate: Hashable, key: Tuple) -> None:
        self._stamp += 1
        self._live[candidate] = self._stamp
        heapq.heappush(self._heap, (key, self._stamp, candidate))

    def drop(self, candidate: Hashable) -> None:
        self._live.pop(candidate, None)

    def pop(self) -> Optional[Tuple[Tuple, Hashable]]:
        """(key, candidate) of the least live key, removed; None when none is left."""
        while self._heap:
            key, stamp, candidate = heapq.heappop(self._heap)
            if self._live.get(candidate) == stamp:
                del self._live[candidate]
                return key, candidate
        return None


def run(graph: ActionGraph, costs: PipelineCosts, link_duplex: str, rendezvous: bool
        ) -> Tuple[List[TimelineEvent], List[float], List[int]]:
    """(timeline events in commit order, when each position is done, how far each position
    got in its list) of the lowered schedule numbered in `graph`."""
    P, first = graph.schedule.num_positions, graph.first
    actions, inputs, receiver, receive = graph.actions, graph.inputs, graph.receiver, graph.receive
    duration = [action_duration(a, costs) for a in actions]
    floor = start_floors(actions, costs)
    head = list(first[:P])                  # per position, the number of its next action
    position_free = [0.0] * P
    finished: List[Optional[float]] = [None] * len(actions)
    waiting: Dict[int, List[int]] = {}      # an action not done yet -> positions reading it next
    busy_until: Dict[Tuple, float] = {}     # per channel, or per position when "serial"
    # Per link channel: heap of (ready_ms, sequence, number of the send, position).
    link_queue: Dict[Tuple, List] = {}
    channels_of: List[Set[Tuple]] = [set() for _ in range(P)]   # the channels a position uses
    events: List[TimelineEvent] = []
    candidates = CandidateQueue()
    sequence = 0

    def channel(sender: int, to: int) -> Tuple:
        return (min(sender, to), max(sender, to)) if link_duplex == "half" else (sender, to)

    def occupied(ch: Tuple) -> Tuple:
        """What a transfer on channel `ch` keeps busy: the channel, or both its positions."""
        return tuple((p,) for p in ch) if link_duplex == "serial" else (ch,)

    def offer_action(p: int) -> None:
        """Queue position p's next action once its inputs are done, else wait for one."""
        i = head[p]
        if i >= first[p + 1]:
            return
        ready = floor[i]
        for n in inputs[i]:
            done = finished[n] if n != MISSING else None
            if done is None:
                waiting.setdefault(n, []).append(p)
                return
            if done > ready:
                ready = done
        free = position_free[p]
        candidates.set(p, (free if free > ready else ready, ready, 0, p))

    def offer_transfer(ch: Tuple) -> None:
        """Queue (or re-key) the next transfer on channel `ch`, if it may go."""
        queue = link_queue.get(ch)
        if not queue:
            return candidates.drop(ch)
        ready, seq, send, _ = queue[0]
        if rendezvous:      # it waits until its receiver has reached the receive
            to = receiver[send]
            if head[to] != receive[send]:
                return candidates.drop(ch)
            ready = max(ready, position_free[to])
        free = max(busy_until.get(r, 0.0) for r in occupied(ch))
        candidates.set(ch, (max(free, ready), ready, 1, seq))

    def finish(i: int, end: float) -> None:
        finished[i] = end
        for p in waiting.pop(i, ()):
            offer_action(p)

    for p in range(P):
        offer_action(p)
    while True:
        best = candidates.pop()
        if best is None:
            break
        (start, *_), which = best
        if isinstance(which, int):
            p = which
            i = head[p]
            action = actions[i]
            kind, c, m = action.kind, action.chunk, action.micro_batch
            end = start + duration[i]
            head[p] += 1
            if kind in (SEND_FORWARD, SEND_BACKWARD):
                # The sender goes on at once; the link carries the data when it is free.
                ch = channel(p, receiver[i])
                heapq.heappush(link_queue.setdefault(ch, []), (start, sequence, i, p))
                channels_of[p].add(ch)
                channels_of[receiver[i]].add(ch)
                sequence += 1
                position_free[p] = start
                offer_transfer(ch)
            else:
                if kind not in (RECV_FORWARD, RECV_BACKWARD, UPDATE) and not (
                        kind == ALLREDUCE and end == start):
                    events.append(TimelineEvent(EVENT_KIND[kind], c, m, start, end, p))
                position_free[p] = end
                finish(i, end)
            offer_action(p)
            if rendezvous:          # a transfer to p may wait for p to reach its receive
                for ch in channels_of[p]:
                    offer_transfer(ch)
        else:
            ch = which
            _, _, i, p = heapq.heappop(link_queue[ch])
            send = actions[i]
            forward = send.kind == SEND_FORWARD
            boundary = send.chunk if forward else send.chunk - 1
            end = start + (costs.send_forward_ms[boundary] if forward
                           else costs.send_backward_ms[boundary])
            for r in occupied(ch):
                busy_until[r] = end
            events.append(TimelineEvent(SEND_FORWARD_KIND if forward else SEND_BACKWARD_KIND,
                                        boundary, send.micro_batch, start, end, p))
            finish(i, end)              # the receiver's data has arrived
            # The next transfer here, and with "serial" those sharing one of its positions.
            for other in (set.union(*(channels_of[q] for q in ch)) if link_duplex == "serial"
                          else (ch,)):
                offer_transfer(other)
    return events, position_free, [head[p] - first[p] for p in range(P)]


def start_floors(actions: List[Action], costs: PipelineCosts) -> List[float]:
    """Per action, the earliest it may start whatever it reads: a forward's chunk's
    `start_ms`, else 0."""
    start = costs.start_ms
    if not start or not any(start):
        return [0.0] * len(actions)
    return [start[a.chunk] if a.kind == FORWARD else 0.0 for a in actions]


def action_duration(action: Action, costs: PipelineCosts) -> float:
    """How long `action` keeps its position busy under `costs`."""
    c = action.chunk
    if action.kind == FORWARD:
        return costs.forward_ms[c]
    if action.kind == BACKWARD:
        return costs.backward_ms[c]
    if action.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):
        # I as the profile measured it (`input_gradient_ms`), else half of B; W the rest.
        i = costs.input_gradient_ms[c] if costs.input_gradient_ms else costs.backward_ms[c] / 2
        return i if action.kind == BACKWARD_INPUT else costs.backward_ms[c] - i
    if action.kind == ALLREDUCE:
        return costs.allreduce_ms[c]
    return 0.0                              # sends and receives: the link's time is the transfer
