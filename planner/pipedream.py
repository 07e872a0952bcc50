"""The PipeDream baseline (PipeDream §3.1): hierarchical dynamic programming that minimizes the
slowest stage's time per sample, converted to a Plan and evaluated with DAPPLE's synchronous
latency model (`planner.cost_model.evaluate`), as the DAPPLE paper does in §VI-F.

Levels: level 1 is the devices inside a host (bandwidth B_1 = in-host rate), level 2 the hosts
(B_2 = network rate). For level k,

    T^k(i..j, m) = max(A^{k-1}(i..j, m_{k-1}), 2 (m-1) W(i..j) / B_k) / m
    A^k(i..j, m) = min( T^k(i..j, m),                                   # the whole range as
                                                                        #   one replicated stage
                        min_{i<=s<j, 1<=m'<m} max(A^k(i..s, m-m'), 2 a_s / B_k, T^k(s+1..j, m')) )

with A^0(i..j, 1) = the compute time of layers i..j for one profile batch, a_s the bytes crossing
the cut after s, W the parameter bytes. Times are per profile batch. The result is a pipeline of
level-2 stages (each a whole number of hosts' worth of devices) whose stages inside are the
level-1 partition; we flatten it into DAPPLE stages with consecutive devices. PipeDream's micro-
batch count is not part of its plan (it is asynchronous); we give the converted plan the M that
minimizes DAPPLE's latency estimate, so the comparison is about partitioning and placement.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import List, Optional, Tuple

from planner import cost_model as cm
from planner.plan import Plan, PlanError, Stage
from planner.profile import Profile
from planner.search import finish_plan, micro_batch_choices

_INF = math.inf


def _pipedream_partition(profile: Profile, topology) -> List[Tuple[int, int, int]]:
    """[(first, last, replicas)] of PipeDream's optimal pipeline."""
    N = profile.num_layers
    per_host = min(topology.devices_per_host)
    hosts = topology.num_devices // per_host
    levels = [(per_host, topology.intra_host_bandwidth / 1e3), (hosts, topology.inter_host_bandwidth / 1e3)]
    if per_host == 1:
        levels = [(hosts, topology.inter_host_bandwidth / 1e3)]

    def compute(i, j):
        return profile.forward_ms(i, j) + profile.backward_ms(i, j)

    def make_level(prev, bw):
        @lru_cache(maxsize=None)
        def T(i, j, m):
            inner_time, inner_part = prev(i, j) if prev else (compute(i, j), [(i, j, 1)])
            sync = 2 * (m - 1) * profile.parameter_bytes(i, j) / bw
            return max(inner_time, sync) / m, [(a, b, r * m) for a, b, r in inner_part]

        @lru_cache(maxsize=None)
        def A(i, j, m):
            best = T(i, j, m)          # the whole range as one replicated stage
            for s in range(i, j):
                comm = 2 * profile.boundary_bytes(s) / bw
                if comm >= best[0]:
                    continue
                for m2 in range(1, m):
                    left = A(i, s, m - m2)
                    if left[0] >= best[0]:
                        continue
                    right = T(s + 1, j, m2)
                    value = max(left[0], comm, right[0])
                    if value < best[0]:
                        best = (value, left[1] + right[1])
            return best
        return A

    prev = None                      # (i, j) -> (time, partition) of one level-(k-1) unit
    for count, bw in levels:
        A = make_level(prev, bw)
        prev = (lambda i, j, A=A, count=count: A(i, j, count))
    return prev(0, N - 1)[1]


def pipedream_partition(profile: Profile, topology) -> List[Tuple[int, int, int]]:
    """[(first, last, replicas)] of PipeDream's plan (stages on consecutive devices)."""
    if len(set(topology.devices_per_host)) != 1:
        raise PlanError("the PipeDream baseline needs hosts of equal size (its topology is a "
                        "hierarchy of equal components)")
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        return _pipedream_partition(profile, topology)
    finally:
        sys.setrecursionlimit(limit)


def plan_pipedream(profile: Profile, topology, global_batch_size: int,
                   memory_limit=None) -> Plan:
    """PipeDream's partition as a synchronous DAPPLE Plan (consecutive device ids per stage,
    best micro-batch count under DAPPLE's latency model)."""
    part = pipedream_partition(profile, topology)
    stages, next_device = [], 0
    for first, last, r in part:
        stages.append(Stage(layers=[first, last], devices=list(range(next_device, next_device + r)),
                            layer_names=profile.layer_names[first:last + 1]))
        next_device += r
    best = None
    max_r = max(r for _, _, r in part)
    # The same micro-batch rule as DAPPLE's search (`cost_model.minimum_slice`), so the two
    # are compared on the same plan space; below it only if nothing else is possible.
    floor = cm.minimum_slice(profile, topology, global_batch_size)
    choices = [M for M in micro_batch_choices(global_batch_size)
               if global_batch_size // M // max_r >= floor] or micro_batch_choices(global_batch_size)
    for M in choices:
        if global_batch_size // M < max_r:
            continue
        plan = Plan(stages=[Stage(list(s.layers), list(s.devices), list(s.layer_names))
                            for s in stages], micro_batches=M, global_batch_size=global_batch_size)
        est = cm.evaluate(plan, profile, topology)
        fits = all(cm.StageModel(profile, topology, global_batch_size, M).max_in_flight(
            s.first, s.last, s.replicas) >= 1 for s in plan.stages)
        key = (not fits, est.latency_ms)
        if best is None or key < best[0]:
            best = (key, plan)
    if best is None:
        raise PlanError(f"PipeDream's plan has a stage of {max_r} replicas, more than the "
                        f"global batch {global_batch_size} has samples")
    plan = best[1]
    try:
        return finish_plan(plan, profile, topology)
    except PlanError:
        plan.estimate = cm.evaluate(plan, profile, topology)
        plan.topology, plan.profile = topology.to_dict(), profile.summary()
        return plan
