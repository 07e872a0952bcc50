"""Weight versions a schedule keeps, and how stale its gradients are, from its action lists.

Version v of a chunk's weights is what its first v updates made (0: the weights the run starts
with); `cUPDATEu` makes version u + 1 from version u. Forwards and backwards name the version
they read (`cFjvV`, `planner.schedules.relaxed_lists`); a list without versions reads version 0 throughout.

* Resident versions: after each action of a position's list, a chunk keeps its latest version
  and every older one that a later action of the list still reads (the in-flight micro-batches'
  stashed weights, and versions forwards still to come will read). The peak over the list is
  what the position must hold: 1 for 1F1B with a flush per batch, 2 for PipeDream-2BW, K_s (the
  micro-batches in flight) on stage s for PipeDream. An update writes its new version in place
  when nothing later reads the old one.
* Weight copies: the resident versions plus AvgPipe's reference copy z (one per chunk).
* Staleness of an update u: u - v for each gradient it applies computed on version v, i.e. how
  many updates the weights it changes are ahead of the weights its gradient saw. 0 for
  synchronous training, 1 for 2BW, K_s - 1 on PipeDream's stage s (the paper's
  W(t+1) = W(t) - lr grad f(W_1(t-p+1), ..., W_p(t))).
"""
from __future__ import annotations

from typing import Dict, List

from planner.schedules.actions import BACKWARD, BACKWARD_WEIGHT, UPDATE, WEIGHT_READERS, Schedule


def _chunk_peak(lst, chunk: int) -> int:
    """Peak resident versions of `chunk` over the list `lst` (see the module docstring): one
    sweep, a version live from the update making it to the last action reading it."""
    mine = [a for a in lst if a.chunk == chunk and (a.kind in WEIGHT_READERS or a.kind == UPDATE)]
    last_read: Dict[int, int] = {}
    for i, a in enumerate(mine):
        if a.kind != UPDATE:
            last_read[a.version or 0] = i
    expiring: Dict[int, List[int]] = {}
    for v, i in last_read.items():
        expiring.setdefault(i, []).append(v)
    latest, live, peak = 0, ({0} if 0 in last_read else set()), 1
    for i, a in enumerate(mine):
        if a.kind == UPDATE:
            latest = a.micro_batch + 1
            if last_read.get(latest, -1) > i:
                live.add(latest)
        for v in expiring.get(i, ()):
            live.discard(v)
        peak = max(peak, len(live) + (latest not in live))
    return peak


def resident_versions(schedule: Schedule) -> List[int]:
    """Per position, the peak number of weight versions it holds (summed over its chunks)."""
    if not schedule.has_updates:
        # No update makes a second version: each chunk holds the one it starts with.
        return [list(schedule.placement).count(p) for p in range(schedule.num_positions)]
    return [sum(_chunk_peak(lst, c) for c in range(schedule.num_chunks)
                if schedule.placement[c] == p)
            for p, lst in enumerate(schedule.lists)]


def weight_copies(schedule: Schedule) -> List[int]:
    """Per position, copies of its chunks' weights resident at once: the versions, and
    AvgPipe's reference copy of each chunk."""
    chunks = [list(schedule.placement).count(p) for p in range(schedule.num_positions)]
    extra = 1 if schedule.averaging else 0
    return [v + extra * n for v, n in zip(resident_versions(schedule), chunks)]


def extra_weight_copies(schedule: Schedule) -> List[int]:
    """Per position, the copies beyond one per chunk: what memory adds to the weights."""
    return [n - list(schedule.placement).count(p) for p, n in enumerate(weight_copies(schedule))]


def staleness(schedule: Schedule) -> List[int]:
    """Per position, the largest u - v over its updates u and the versions v their gradients
    were computed on (0 without updates)."""
    out = []
    for lst in schedule.lists:
        worst = 0
        for a in lst:
            if a.kind == UPDATE:
                for g in schedule.update_inputs[(a.chunk, a.micro_batch)]:
                    if g.kind in (BACKWARD, BACKWARD_WEIGHT):
                        worst = max(worst, a.micro_batch - (g.version or 0))
        out.append(worst)
    return out
