"""The PipeDream baseline (PipeDream §3.1): hierarchical dynamic programming that minimizes the
slowest stage's time per sample, converted to a Plan and evaluated with DAPPLE's synchronous
latency model (`planner.estimate.cost_model.evaluate`), as the DAPPLE paper does in §VI-F.

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

from itertools import accumulate
from typing import List, Tuple

import numpy as np

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan, PlanError, Stage
from planner.formats.profile import Profile
from planner.search.plan_finishing import finish_plan, micro_batch_choices
from planner.search.scoped_memo import ScopedMemo


def _levels(topology) -> List[Tuple[int, float]]:
    """[(units per component, bandwidth in bytes/ms)] from the devices in a host up."""
    per_host = min(topology.devices_per_host)
    hosts = topology.num_devices // per_host
    if per_host == 1:
        return [(hosts, topology.inter_host_bandwidth / 1e3)]
    return [(per_host, topology.intra_host_bandwidth / 1e3),
            (hosts, topology.inter_host_bandwidth / 1e3)]


def _replicated(inner: np.ndarray, W: np.ndarray, count: int, bw: float) -> np.ndarray:
    """T[m, i, j] for m in 0..count (row m = 0 and i > j are +inf): the whole range i..j as
    one stage on m units, each unit taking `inner[i, j]`."""
    N = W.shape[0]
    m = np.arange(count + 1)[:, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        # The same operations in the same order as the recurrence's scalar form, so the values
        # (and the ties between them) are bit-for-bit those of `max(inner, 2(m-1)W/B) / m`.
        T = np.maximum(inner[None], (2 * (m - 1)) * W[None] / bw) / m
    T[0] = np.inf
    T[:, np.tril(np.ones((N, N), dtype=bool), -1)] = np.inf
    return T


def _best(T: np.ndarray, comm: np.ndarray, count: int, rows: int) -> np.ndarray:
    """A[m, i, j] for i < rows: min(T[m, i, j], min over the last cut s (i <= s < j) and the
    m2 units after it of max(A[m - m2, i, s], comm[s], T[m2, s + 1, j])).

    Bottom-up in s: once every s' < s is done, A[:, :, s] is final (its own cuts are before s),
    so the cut s updates the whole block i <= s < j at once, for every m and m2."""
    N = T.shape[1]
    A = T[:, :rows, :].copy()
    if count < 2 or N < 2:
        return A
    # The pairs (m, m2) as a table over m = 2..count (rows) and m2 = 1..count-1 (columns):
    # A[m - m2] left of the cut, T[m2] right of it; the slots m2 >= m read row 0, which is
    # +inf in both (no units), so they never win a min. Min and max are exact, so taking the
    # min over all of a row's pairs at once gives the same values as one m at a time.
    m = np.arange(2, count + 1)[:, None]
    m2 = np.arange(1, count)[None, :]
    valid = m2 < m
    left_m = np.where(valid, m - m2, 0)
    right_m = np.where(valid, m2, 0)
    for s in range(N - 1):
        r = min(rows, s + 1)
        left = A[left_m, :r, s]                                    # (m, m2, i)
        right = np.maximum(T[right_m, s + 1, s + 1:], comm[s])     # (m, m2, j)
        cut = np.maximum(left[:, :, :, None], right[:, :, None, :]).min(axis=1)
        block = A[2:, :r, s + 1:]
        np.minimum(block, cut, out=block)
    return A


def parameter_table(profile: Profile) -> np.ndarray:
    """W[i, j] = profile.parameter_bytes(i, j) for i <= j: the layers' own parameters by prefix
    sums, plus each shared entry in every range that contains one of its positions."""
    N = profile.num_layers
    P = np.array([0.0] + list(accumulate(l.parameter_bytes for l in profile.layers)))
    W = P[None, 1:] - P[:-1, None]
    js = np.arange(N)
    for e in profile.shared_parameters:
        positions = np.array(e.positions)
        k = np.searchsorted(positions, js)                   # first position >= i
        nxt = np.where(k < len(positions), positions[np.minimum(k, len(positions) - 1)], N)
        W = W + e.bytes * (nxt[:, None] <= js[None, :])
    return W


def _pipedream_partition(profile: Profile, topology) -> List[Tuple[int, int, int]]:
    """[(first, last, replicas)] of PipeDream's optimal pipeline.

    Each level's T and A are numpy tables [m, i, j] filled bottom-up (`_best`); the top level
    only needs ranges starting at layer 0, and so does every level under a top of one unit.
    The partition is then read back from the tables, breaking ties as a top-down search in
    increasing s, then m2, that keeps the first strict improvement on the whole-range stage:
    the whole range if nothing beats it, else the first (s, m2) attaining the minimum."""
    N = profile.num_layers
    levels = _levels(topology)

    def prefix(f):
        return np.array([0.0] + [f(0, k) for k in range(N)])
    F, B = prefix(profile.forward_ms), prefix(profile.backward_ms)
    inner = (F[None, 1:] - F[:-1, None]) + (B[None, 1:] - B[:-1, None])   # compute(i..j)
    W = parameter_table(profile)                                           # params(i..j)
    tables = []                      # per level: (count, T, A, comm)
    for k, (count, bw) in enumerate(levels):
        comm = np.array([2 * profile.boundary_bytes(s) / bw for s in range(N - 1)])
        T = _replicated(inner, W, count, bw)
        # A level's ranges start anywhere if a level above it cuts (count >= 2), else at 0.
        rows = N if any(c > 1 for c, _ in levels[k + 1:]) else 1
        A = _best(T, comm, count, rows)
        tables.append((count, T, A, comm))
        inner = A[count]

    def best(k, i, j, m):
        count, T, A, comm = tables[k]
        value = A[m, i, j]
        if not value < T[m, i, j]:
            return whole(k, i, j, m)
        # (s, m2) for s = i..j-1 (rows), m2 = 1..m-1 (columns); the first one in row order.
        cut = np.maximum(np.maximum(A[m - 1:0:-1, i, i:j].T, comm[i:j, None]),
                         T[1:m, i + 1:j + 1, j].T)
        s, m2 = divmod(int(np.argmax(cut == value)), m - 1)
        s, m2 = i + s, m2 + 1
        return best(k, i, s, m - m2) + whole(k, s + 1, j, m2)

    def whole(k, i, j, m):
        if k == 0:
            return [(i, j, m)]
        return [(a, b, r * m) for a, b, r in best(k - 1, i, j, tables[k - 1][0])]

    return best(len(levels) - 1, 0, N - 1, levels[-1][0])


_partitions = ScopedMemo()      # by profile and topology, inside `remembering_partitions`


def remembering_partitions():
    """Within it, PipeDream's partition of a profile on a topology is made once: a report
    seeds two or three searches with it and plans PipeDream's baseline from it (it depends on
    the profile and the topology only)."""
    return _partitions.scope()


def pipedream_partition(profile: Profile, topology) -> List[Tuple[int, int, int]]:
    """[(first, last, replicas)] of PipeDream's plan (stages on consecutive devices)."""
    if len(set(topology.devices_per_host)) != 1:
        raise PlanError("the PipeDream baseline needs hosts of equal size (its topology is a "
                        "hierarchy of equal components)")
    partition = _partitions.get(profile, (topology,))
    if partition is None:
        partition = _pipedream_partition(profile, topology)
        _partitions.put(profile, (topology,), partition)
    return list(partition)


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
        costs = cm.PlanCosts(plan, profile, topology)
        fits = all(c.max_in_flight >= 1 for c in costs.stages)
        key = (not fits, costs.estimate().latency_ms)
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
