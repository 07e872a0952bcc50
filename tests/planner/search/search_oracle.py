"""The exact search as it was at e0aa918, before #29's pass on its speed, kept verbatim as an
oracle (only renamed and its imports adjusted): the search in planner/search/exact_search.py must
visit the same candidates in the same order, so with any candidate budget it returns the same
plan, value and statistics (test_search_oracle.py). Its seeding is the former one too: every
seed shape offered at every M, one call each."""
from __future__ import annotations

import bisect
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageModel
from planner.search.exact_search import LARGE_TOPOLOGY_DEVICES, SearchStats
from planner.search.placement import POLICIES, canonical_state, place
from planner.formats.profile import Profile
from planner.search.seed_plans import seed_shapes

_INF = math.inf


class _Budget(Exception):
    pass


def _extend(summary, F, B, AR, M):
    """Append one stage (F, B, AR) to a partial plan's summary (V, sumF, E, G).

    V = max over pivots q so far of L(q) restricted to known stages; E = max_s AR_s + B_s..B_q
    chain at the last stage; G = max_q base_q + B_q - sum of B after q (the s > q terms)."""
    V, sumF, E, G = summary
    sumF2 = sumF + F
    E2 = max(E + B, AR + B)
    base = sumF2 + (M - 1) * (F + B)
    V2 = max(V, G + AR, base + E2)
    G2 = max(G - B, base + B)
    return (V2, sumF2, E2, G2)


_EMPTY = (-_INF, 0.0, -_INF, -_INF)


class OracleSearch:
    """The exact search over one plan space restriction (`stage_sizes`, `max_stages`): offer
    known plans with `seed`, then `run_micro_batches` for every M; `best` is then
    (M, [(first, last, host counts)]) of least `best_value`, or None if nothing fits."""

    def __init__(self, profile: Profile, topology, global_batch_size: int,
                 policies: Sequence[str] = POLICIES, stage_sizes: Optional[Sequence[int]] = None,
                 stats: Optional[SearchStats] = None, even_slices: bool = False,
                 max_stages: Optional[int] = None, max_candidates: float = math.inf):
        self.profile = profile
        self.even_slices = even_slices
        self.topology = topology
        self.gbs = global_batch_size
        self.capacity = tuple(topology.devices_per_host)
        self.G = topology.num_devices
        self.N = profile.num_layers
        self.policies = tuple(policies)
        self.explicit_sizes = stage_sizes is not None
        if stage_sizes is None and self.G > LARGE_TOPOLOGY_DEVICES:
            h = max(self.capacity)
            stage_sizes = sorted(set(range(1, h + 1)) | set(range(h, self.G + 1, h)))
        self.stage_sizes = None if stage_sizes is None else sorted(set(stage_sizes))
        self.stats = stats or SearchStats()
        self.stage_limit = max_stages or self.G
        self.min_slice = cm.minimum_slice(profile, topology, global_batch_size)
        self.max_candidates = max_candidates
        self.best_value = _INF
        self.place_cache: Dict[tuple, Optional[tuple]] = {}   # placement depends on used, m only
        self.best: Optional[Tuple[int, List[Tuple[int, int, tuple]]]] = None
        work = [l.forward_ms + l.backward_ms for l in profile.layers]
        self.work_suffix = [0.0] * (self.N + 1)
        for i in range(self.N - 1, -1, -1):
            self.work_suffix[i] = self.work_suffix[i + 1] + work[i]
        self.neg_work_suffix = [-w for w in self.work_suffix]

    # ---- one M --------------------------------------------------------------------
    def run_micro_batches(self, M: int) -> None:
        model = StageModel(self.profile, self.topology, self.gbs, M)
        self.model, self.M = model, M
        # A replica's slice time is at least T * (slice / pbs) (the affine scale is never
        # below the linear one for slices under the profile batch): a valid lower bound.
        H = cm.SMALL_BATCH_HALF_SAMPLES
        self.work_factor = M * min(model.micro_batch / model.pbs,
                                   (model.micro_batch + H) / (model.pbs + H))
        self.overhead = M * 2 * cm.TASK_OVERHEAD_MS
        self.transfer_cache: Dict[tuple, Tuple[float, float]] = {}
        if self._remaining_bound(0, self.G) >= self.best_value:
            self.stats.pruned += 1
            return
        self.path_costs: List[cm.StageCost] = []      # the stages on the depth-first path
        try:
            self._dfs(0, (0,) * len(self.capacity), (0,) * len(self.capacity), _EMPTY, [])
        except _Budget:
            self.stats.complete = False

    def seed(self, M: int, stages: Sequence[Tuple[int, int, int]],
             model: Optional[StageModel] = None) -> None:
        """Offer a known plan [(first, last, replicas)] at M as the incumbent if it lies in the
        plan space (devices placed by the append policy, i.e. consecutive ids; replica counts
        allowed; every stage fits). It is valued like any complete plan of the search, so the
        search still returns the exact minimum; a good seed only prunes earlier."""
        if self.gbs % M or not stages or stages[-1][1] != self.N - 1 \
                or len(stages) > self.stage_limit:
            return
        if self.stage_sizes is not None and any(r not in self.stage_sizes for _, _, r in stages):
            return
        if model is None or model.M != M:
            model = StageModel(self.profile, self.topology, self.gbs, M)
        used = (0,) * len(self.capacity)
        prev, summary, path, costs = None, _EMPTY, [], []
        for first, last, r in stages:
            if not self.replicas_allowed(r, model.micro_batch) or \
                    model.max_in_flight(first, last, r) < 1:
                return
            counts = place("append", self.capacity, used, r)
            if counts is None or "append" not in self.policies:
                return
            cost = model.stage_cost(first, last, counts, prev)
            if prev is not None:
                summary = _extend(summary, cost.send_forward_ms, cost.send_backward_ms, 0.0, M)
            summary = _extend(summary, cost.forward_ms, cost.backward_ms, cost.allreduce_ms, M)
            used = tuple(u + c for u, c in zip(used, counts))
            prev = counts
            path.append((first, last, counts))
            costs.append(cost)
        if sum(used) != self.G:
            return
        self.stats.seeds += 1
        if summary[0] < self.best_value:
            value = cm.planned_latency_ms(costs, M)
            if value < self.best_value:
                self.best_value = value
                self.best = (M, path)

    def _remaining_bound(self, j: int, devices_left: int) -> float:
        if j >= self.N:
            return 0.0
        return self.work_suffix[j] * self.work_factor / devices_left + self.overhead

    def _transfer(self, last: int, prev: tuple, counts: tuple) -> Tuple[float, float]:
        key = (last, prev, counts)
        hit = self.transfer_cache.get(key)
        if hit is None:
            x = self.model.boundary_bytes(last)
            hit = (self.model.transfer_ms(x, prev, counts), self.model.transfer_ms(x, counts, prev))
            self.transfer_cache[key] = hit
        return hit

    def replicas_allowed(self, m: int, mb: int) -> bool:
        """A stage of m replicas is in the plan space at micro-batch mb: every slice at least
        the minimum slice, and equal slices when `even_slices`."""
        return mb // m >= self.min_slice and (not self.even_slices or mb % m == 0)

    def _round_trip_bound(self, new_stage, more_stages: int, trip_rest: float) -> float:
        """A lower bound of the round-trip latency (`latency.round_trip_phases`) of every
        completion of the current path plus `new_stage`, from the pivot terms of the known
        stages. For a known stage q, Tw up to q and the s <= q terms of Te are final; the trip
        R_q only grows as stages are added (by at least `trip_rest`, the remaining work spread
        over the free devices); K_q is at most min(M, policy B's depth with the most stages
        still possible, the memory caps D of stages 0..q). The wait and the steady period fall
        as K grows and rise with R, so those values give a lower bound of the final L(q), and
        the latency is the maximum over q."""
        return round_trip_reference(self.path_costs + [new_stage], self.M, more_stages,
                                    trip_rest)

    def _sizes(self, free: int, mb: int) -> Iterable[int]:
        top = min(free, mb // self.min_slice)
        if self.stage_sizes is None:
            return [m for m in range(1, top + 1) if self.replicas_allowed(m, mb)]
        sizes = [s for s in self.stage_sizes if s <= top and self.replicas_allowed(s, mb)]
        if not self.explicit_sizes and free <= top and free not in sizes \
                and self.replicas_allowed(free, mb):
            sizes.append(free)
        return sizes

    def _dfs(self, j: int, used: tuple, prev: tuple, summary, path) -> None:
        self.stats.nodes += 1
        if self.stats.candidates > self.max_candidates:
            raise _Budget()
        if j == self.N:
            # eq. 1 (the summary) is a lower bound of the latency we plan with
            if summary[0] < self.best_value:
                value = cm.planned_latency_ms(self.path_costs, self.M)
                if value < self.best_value:
                    self.best_value = value
                    self.best = (self.M, list(path))
            return
        free = self.G - sum(used)

        model, M, N = self.model, self.M, self.N
        must_finish = len(path) + 1 >= self.stage_limit
        children = []
        seen = set()
        for m in self._sizes(free, model.micro_batch):
            last_stage_only = m == free
            if must_finish and not last_stage_only:
                continue
            for policy in self.policies:
                key = (policy, used, m)
                counts = self.place_cache.get(key, 0)
                if counts == 0:
                    counts = self.place_cache[key] = place(policy, self.capacity, used, m)
                if counts is None:
                    continue
                sym = canonical_state(self.capacity, used, prev, counts)
                if sym in seen:
                    continue
                seen.add(sym)
                new_used = tuple(u + c for u, c in zip(used, counts))
                s0 = summary
                if j > 0:
                    tf, tb = self._transfer(j - 1, prev, counts)
                    s0 = _extend(summary, tf, tb, 0.0, M)
                if s0[0] >= self.best_value:
                    self.stats.pruned += 1
                    continue
                if last_stage_only:
                    lasts = [N - 1]
                else:
                    # The completion bound falls as the stage grows: skip the stage ends whose
                    # remaining work alone already exceeds the incumbent (binary search).
                    start = j
                    if self.best_value < _INF:
                        base0 = s0[1] + max(s0[2], 0.0)
                        room = (self.best_value - base0 - self.overhead) * (free - m) \
                            / self.work_factor
                        i = bisect.bisect_right(self.neg_work_suffix, -room, j + 1, N)
                        start = i - 1
                        self.stats.pruned += start - j
                    lasts = range(start, N - 1)
                for last in lasts:
                    self.stats.candidates += 1
                    F = model.forward_ms(j, last, m)
                    B = model.backward_ms(j, last, m)
                    # Monotone in `last`: once the stage alone is too long, longer ones are too.
                    if s0[1] + s0[2] + M * (F + B) >= self.best_value if s0[2] > -_INF else \
                            s0[1] + M * (F + B) >= self.best_value:
                        self.stats.pruned += 1
                        break
                    if not last_stage_only:
                        rest = self._remaining_bound(last + 1, free - m)
                    else:
                        rest = 0.0
                    if model.max_in_flight(j, last, m) < 1:
                        continue
                    stage_cost = model.stage_cost(j, last, counts, prev if j else None)
                    s1 = _extend(s0, F, B, stage_cost.allreduce_ms, M)
                    bound = max(s1[0], s1[1] + s1[2] + rest) if rest else s1[0]
                    if bound >= self.best_value:
                        self.stats.pruned += 1
                        continue
                    if self.best_value < _INF:
                        more = 0 if last_stage_only else min(free - m, N - 1 - last)
                        trip_rest = (rest - self.overhead) / M if rest else 0.0
                        bound = max(bound, self._round_trip_bound(stage_cost, more, trip_rest))
                        if bound >= self.best_value:
                            self.stats.pruned += 1
                            continue
                    children.append((bound, last, m, counts, new_used, s1, stage_cost))
        children.sort(key=lambda c: c[0])
        for bound, last, m, counts, new_used, s1, stage_cost in children:
            if bound >= self.best_value:
                self.stats.pruned += 1
                continue
            path.append((j, last, counts))
            self.path_costs.append(stage_cost)
            self._dfs(last + 1, new_used, counts, s1, path)
            path.pop()
            self.path_costs.pop()


def oracle_seed_search(search: OracleSearch, micro_batches: Sequence[int]) -> None:
    shapes = seed_shapes(search.profile, search.topology, search.stage_sizes)
    for M in micro_batches:
        model = StageModel(search.profile, search.topology, search.gbs, M)
        for stages in shapes:
            search.seed(M, stages, model)


def round_trip_reference(costs, M: int, more_stages: int, trip_rest: float) -> float:
    """The round-trip bound for the path of stage costs `costs` (StageCost fields: tf, tb, F,
    B, AR, cap) with at most `more_stages` stages after it: each stage's pivot term at its
    least trip and largest K, the maximum over the stages (see `_round_trip_bound`)."""
    n = len(costs)
    max_stages = n + more_stages
    tw, te, kmax = [0.0] * n, [0.0] * n, [0] * n
    acc_f, chain, runmin = 0.0, -_INF, M
    for i, (tf, tb, F, B, AR, cap) in enumerate(costs):
        acc_f += tf + F
        tw[i] = acc_f
        if i:
            chain = max(chain + tb, tb)
        chain = max(chain + B, AR + B)
        te[i] = chain
        runmin = min(runmin, max(1, cap))
        kmax[i] = max(1, min(runmin, 2 * (max_stages - i) - 1))
    best, trip = -_INF, trip_rest
    for i in range(n - 1, -1, -1):
        tf, tb, F, B, _, _ = costs[i]
        fb, k = F + B, kmax[i]
        wait = trip - (k - 1) * F
        period = (fb + trip) / k
        value = tw[i] + (wait if wait > 0.0 else 0.0) + \
            (M - 1) * (period if period > fb else fb) + te[i]
        if value > best:
            best = value
        trip += fb + tf + tb
    return best
