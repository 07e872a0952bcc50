"""The simulator's loop as it was before its event queue (one scan of every position and link
per committed event), kept only as the oracle `test_simulator_equivalence.py` compares the
event queue with: same timelines, same statistics, bit for bit. Input checks and the result's
statistics are the simulator's own (`check_inputs`, `timed_result`)."""
from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Tuple

from planner.schedules.actions import (ALLREDUCE, FORWARD, RECV_BACKWARD, RECV_FORWARD,
                                       SEND_BACKWARD, SEND_FORWARD, UPDATE, Action, Schedule)
from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate.event_loop import EVENT_KIND as _EVENT_KIND, action_duration
from planner.schedules.lowering import Located, needs
from planner.schedules.replay import replay
from planner.estimate.simulation_result import (SEND_BACKWARD_KIND, SEND_FORWARD_KIND,
                                       SimulationResult, TimelineEvent)
from planner.estimate.simulator import check_inputs, timed_result


def reference_simulate(schedule: Schedule, costs: PipelineCosts,
                       link_duplex: str = "full", rendezvous: bool = False) -> SimulationResult:
    """Run the lowered `schedule` (`planner.schedules.lowering.lower`) with the durations in `costs`
    (one entry per chunk)."""
    check_inputs(schedule, costs, link_duplex)
    lowered = replay(schedule).schedule      # checks every action once and no deadlock
    P, placement = lowered.num_positions, lowered.placement

    position = [0] * P
    position_free = [0.0] * P
    finished: Dict[Located, float] = {}
    busy_until: Dict[Tuple, float] = {}     # per channel, or per position when "serial"
    # Per link channel: heap of (ready_ms, sequence, send action, position).
    link_queue: Dict[Tuple, List] = {}
    events: List[TimelineEvent] = []
    sequence = 0

    def channel(sender: int, receiver: int) -> Tuple:
        return (min(sender, receiver), max(sender, receiver)) if link_duplex == "half" \
            else (sender, receiver)

    def occupied(ch: Tuple) -> Tuple:
        """What a transfer on channel `ch` keeps busy: the channel, or both its positions."""
        return tuple((p,) for p in ch) if link_duplex == "serial" else (ch,)

    ready_known: Dict[int, float] = {}    # position -> when its next action's inputs are done

    def ready_at(p: int, action: Action) -> Optional[float]:
        """When `action` may start as far as its inputs go; None while one is not done (a
        known time never changes, so it is kept until the position moves on)."""
        if p in ready_known:
            return ready_known[p]
        times = [finished.get(n) for n in needs(lowered, p, action)]
        if any(t is None for t in times):
            return None
        if action.kind == FORWARD and costs.start_ms:     # not before what it is fed arrives
            times.append(costs.start_ms[action.chunk])
        ready_known[p] = max(times, default=0.0)
        return ready_known[p]

    while True:
        best = None   # (key, payload)
        for p in range(P):
            if position[p] >= len(lowered.lists[p]):
                continue
            action = lowered.lists[p][position[p]]
            ready = ready_at(p, action)
            if ready is None:
                continue
            key = (max(position_free[p], ready), ready, 0, p)
            if best is None or key < best[0]:
                best = (key, ("action", p, action))
        for ch, queue in link_queue.items():
            if queue:
                ready, seq, send, _ = queue[0]
                if rendezvous:
                    posted = _receive_posted(lowered, placement, position, position_free, send)
                    if posted is None:
                        continue
                    ready = max(ready, posted)
                free = max(busy_until.get(r, 0.0) for r in occupied(ch))
                key = (max(free, ready), ready, 1, seq)
                if best is None or key < best[0]:
                    best = (key, ("transfer", ch))
        if best is None:
            break
        start = best[0][0]
        if best[1][0] == "action":
            _, p, action = best[1]
            c, m = action.chunk, action.micro_batch
            end = start + action_duration(action, costs)
            position[p] += 1
            ready_known.pop(p, None)
            if action.kind in (SEND_FORWARD, SEND_BACKWARD):
                # The sender goes on at once; the link carries the data when it is free.
                receiver = placement[c + 1 if action.kind == SEND_FORWARD else c - 1]
                heapq.heappush(link_queue.setdefault(channel(p, receiver), []),
                               (start, sequence, action, p))
                sequence += 1
                position_free[p] = start
                continue
            if action.kind not in (RECV_FORWARD, RECV_BACKWARD, UPDATE) and not (
                    action.kind == ALLREDUCE and end == start):
                events.append(TimelineEvent(_EVENT_KIND[action.kind], c, m, start, end, p))
            finished[(p, action)] = end
            position_free[p] = end
        else:
            ch = best[1][1]
            _, _, send, p = heapq.heappop(link_queue[ch])
            forward = send.kind == SEND_FORWARD
            boundary = send.chunk if forward else send.chunk - 1
            duration = (costs.send_forward_ms[boundary] if forward
                        else costs.send_backward_ms[boundary])
            end = start + duration
            for r in occupied(ch):
                busy_until[r] = end
            events.append(TimelineEvent(SEND_FORWARD_KIND if forward else SEND_BACKWARD_KIND,
                                        boundary, send.micro_batch, start, end, p))
            finished[(p, send)] = end           # the receiver's data has arrived

    return timed_result(schedule, lowered, costs, events, position_free, position,
                        link_duplex, rendezvous)


def _receive_posted(lowered: Schedule, placement, position, position_free,
                    send: Action) -> Optional[float]:
    """When the receiver of `send` reached its receive, or None if it has not yet."""
    forward = send.kind == SEND_FORWARD
    chunk = send.chunk + 1 if forward else send.chunk - 1
    want = Action(chunk, RECV_FORWARD if forward else RECV_BACKWARD, send.micro_batch)
    p = placement[chunk]
    if position[p] < len(lowered.lists[p]) and lowered.lists[p][position[p]] == want:
        return position_free[p]
    return None

