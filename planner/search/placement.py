"""Device placement policies for a new stage (DAPPLE §IV-B, Fig. 5).

The search works on host-count vectors: how many devices a stage takes on each host. Devices
inside a host are interchangeable (same memory, same links), so a stage's costs depend only on
that vector; device ids are assigned at the end, lowest free ids first (`assign_devices`).

* fresh:   take whole fresh hosts first (host order), then partially used hosts.
* append:  take partially used hosts first, then fresh ones.
* scatter: spread evenly (round robin) over the partially used hosts, or over all fresh hosts
           when none is partially used; what is still missing is spread over fresh hosts.

`canonical_state` sorts hosts by (capacity, used, devices of the previous stage, devices of the
new stage): hosts equal in those are interchangeable for everything that follows, so the search
tries symmetric placements once.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

POLICIES = ("fresh", "append", "scatter")


def _fill(order: Sequence[int], free: List[int], counts: List[int], need: int) -> int:
    for h in order:
        take = min(free[h], need)
        counts[h] += take
        free[h] -= take
        need -= take
        if not need:
            break
    return need


def _round_robin(hosts: Sequence[int], free: List[int], counts: List[int], need: int) -> int:
    hosts = [h for h in hosts if free[h] > 0]
    while need and hosts:
        for h in list(hosts):
            if not need:
                break
            counts[h] += 1
            free[h] -= 1
            need -= 1
            if not free[h]:
                hosts.remove(h)
    return need


def place(policy: str, capacity: Sequence[int], used: Sequence[int], m: int
          ) -> Optional[Tuple[int, ...]]:
    """Host-count vector of `m` new devices under `policy`, or None if fewer are free."""
    free = [c - u for c, u in zip(capacity, used)]
    if m < 1 or sum(free) < m:
        return None
    H = len(capacity)
    fresh = [h for h in range(H) if used[h] == 0]
    partial = [h for h in range(H) if 0 < used[h] < capacity[h]]
    counts = [0] * H
    if policy == "fresh":
        _fill(fresh + partial, free, counts, m)
    elif policy == "append":
        _fill(partial + fresh, free, counts, m)
    elif policy == "scatter":
        need = _round_robin(partial if partial else fresh, free, counts, m)
        if need:
            need = _round_robin(fresh, free, counts, need)
    else:
        raise ValueError(f"unknown placement policy {policy!r}; use one of {POLICIES}")
    return tuple(counts)


def canonical_state(capacity: Sequence[int], used: Sequence[int], previous: Sequence[int],
                    counts: Sequence[int]) -> tuple:
    """A new stage of host counts `counts` after one on `previous`, `used` devices taken, up to
    a permutation of the hosts."""
    return tuple(sorted(zip(capacity, used, previous, counts)))


def assign_devices(topology, stage_counts: Sequence[Sequence[int]]) -> List[List[int]]:
    """Device ids per stage from host-count vectors, lowest free ids of each host first."""
    next_free = [topology.devices_of_host(h)[0] for h in range(topology.num_hosts)]
    out = []
    for counts in stage_counts:
        devices = []
        for h, c in enumerate(counts):
            devices.extend(range(next_free[h], next_free[h] + c))
            next_free[h] += c
        out.append(sorted(devices))
    return out
