"""A lower bound of every straight pipeline's latency (one device a stage, on all G devices),
cheap enough to decide before the straight search whether it can beat a plan already found
(`plan_space.plan_dapple`).

Eq. 1 of a straight plan (the search's summary V, which the latency we plan with never goes
below) is at least its pivot term for every stage q: the forwards and backwards of the stages
before q, M of q's forward + backward, and the transfers before q (no allreduce: one replica).
Leaving the transfers out, with w_s = F_s + B_s (each the layers' time at the micro-batch plus
the task overhead), that is P_q + M w_q with P_q = w_0 + ... + w_{q-1}. The least, over every
cut of the layers into at most G stages (a superset of the plans), of the largest such term
is a lower bound. Whether it is below a threshold T is decided greedily: each stage takes
layers while its term stays within T. That is exact for the relaxed problem: moving a layer
of stage q + 1 into stage q changes term q + 1 by (1 - M) times its work, never up, and
leaves the later P unchanged; a stage emptied so is dropped, which lowers the later P by its
overhead.

Where transfers matter (slow links), a second bound keeps them: each boundary, cut after layer
e, costs at least the cheaper of a transfer inside a host and one between hosts, forward and
back (one device to one: nothing else decides it), and is a pseudo-stage of its own, its term
P + M (its forward + backward), adding to the later P. The least P reaching each layer with
every term so far within T decides it (the terms ahead depend on P only through P + ..., so
the least P is the best state); it drops the stage count (any number of stages), which the
first bound keeps. A plan is ruled out at M when either bound is not below T.
"""
from __future__ import annotations

from typing import Sequence

from planner.estimate import cost_model as cm
from planner.formats.profile import Profile

# Relative slack on the threshold: the greedy's sums and the search's are rounded differently
# (a few ulps); a bound within this of the threshold does not rule a plan out.
SLACK = 1e-9


def straight_may_beat(profile: Profile, topology, global_batch_size: int, M: int,
                      threshold: float) -> bool:
    """False only if every straight pipeline of `profile` on `topology` at M micro-batches has
    eq. 1 (so a planned latency) at least `threshold`; True when one may be below it."""
    G, N = topology.num_devices, profile.num_layers
    if N < G:
        return False                        # no straight pipeline
    model = cm.StageModel(profile, topology, global_batch_size, M)
    scale = model.time_scale(1)
    overhead = 2 * cm.TASK_OVERHEAD_MS
    limit = threshold * (1 + SLACK)
    work = [l.forward_ms + l.backward_ms for l in profile.layers]
    P, k, stages = 0.0, 0, 0
    while k < N:
        stages += 1
        if stages > G:
            return False
        acc = work[k]
        if P + M * (acc * scale + overhead) > limit:
            return False
        k += 1
        while k < N:
            more = acc + work[k]
            if P + M * (more * scale + overhead) > limit:
                break
            acc = more
            k += 1
        P += acc * scale + overhead
    return _may_beat_with_transfers(profile, topology, model, work, scale, overhead, M, limit)


def _may_beat_with_transfers(profile: Profile, topology, model, work: Sequence[float],
                             scale: float, overhead: float, M: int, limit: float) -> bool:
    """The second bound of the module docstring: some cut of the layers (any stage count)
    whose stage and boundary terms all stay within `limit`."""
    N, hosts = profile.num_layers, len(topology.devices_per_host)
    links = []                              # (sender, receiver) host-count vectors
    if any(d > 1 for d in topology.devices_per_host):
        one = tuple(int(h == topology.devices_per_host.index(max(topology.devices_per_host)))
                    for h in range(hosts))
        links.append((one, one))
    if hosts > 1:
        links.append((tuple(int(h == 0) for h in range(hosts)),
                      tuple(int(h == 1) for h in range(hosts))))
    if not links:
        return True
    boundary = []
    for e in range(N - 1):
        x = model.boundary_bytes(e)
        boundary.append(min(model.transfer_ms(x, a, b) + model.transfer_ms(x, b, a)
                            for a, b in links))
    inf = float("inf")
    least = [inf] * (N + 1)                 # least P with layers 0..i-1 planned
    least[0] = 0.0
    for i in range(N):
        P = least[i]
        if P == inf:
            continue
        acc = 0.0
        for e in range(i, N):
            acc += work[e]
            w = acc * scale + overhead
            if P + M * w > limit:
                break                       # longer stages only grow
            if e == N - 1:
                return True
            t = boundary[e]
            if P + w + M * t <= limit and P + w + t < least[e + 1]:
                least[e + 1] = P + w + t
    return False


def straight_may_beat_any(profile: Profile, topology, global_batch_size: int,
                          micro_batches: Sequence[int], threshold: float) -> bool:
    """`straight_may_beat` at some M of `micro_batches`."""
    return any(straight_may_beat(profile, topology, global_batch_size, M, threshold)
               for M in micro_batches)
