"""The exact DAPPLE search (§IV-C2, eq. 4-5) for one global batch: the plan of least
estimated latency among those whose stage sizes and stage count lie in given limits.

Plan space: the layers cut into consecutive stages; each stage placed on a device set built by
Fresh First, Append First or Scatter First (`planner.search.placement`) from the devices still free,
all devices used; M a divisor of the global batch with every replica's slice at least
`cost_model.minimum_slice` samples (equal slices with `even_slices`); every stage able to hold
one micro-batch. The objective is `cost_model.planned_latency_ms`: eq. 1 with the pivot's
round-trip wait at the warm-up depths the plan will run.

For each M, depth-first over (layers planned j, occupied devices), one stage at a time, as
eq. 4-5 extend T_PL(j, m, g) to T_PL(j', m + m', g + g'). Every pruning test uses a lower
bound, so the result is exact (tests compare it with brute force):

* a 4-number summary of the partial plan (V, sum F, E, G) from which eq. 1 of any completion
  follows (`_extend`); V, eq. 1 of the known stages, bounds every completion from below;
* the remaining work spread over the remaining devices, plus the per-task overheads;
* the round-trip bound (`planner.search.round_trip_bound`).
There is no dominance test between partial plans: K depends on the whole plan (stage count,
ACR, memory caps), so a partial plan worse in eq. 1's summary can still complete better.
Hosts equal in capacity, use and the devices of the previous and the new stage are
interchangeable, so symmetric children are searched once (`placement.canonical_state`).
`max_candidates` bounds the work; `SearchStats.complete` says whether it was reached.

On topologies of more than `LARGE_TOPOLOGY_DEVICES` devices the stage sizes tried are 1..(the
largest host) and whole multiples of it.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageCost, StageModel
from planner.search.placement import POLICIES, canonical_state, place
from planner.formats.profile import Profile
from planner.search.round_trip_bound import round_trip_bound, trail_entry

LARGE_TOPOLOGY_DEVICES = 64
_INF = math.inf
_first = operator.itemgetter(0)     # a child's bound, which orders the children


@dataclasses.dataclass
class SearchStats:
    nodes: int = 0
    candidates: int = 0
    pruned: int = 0
    seeds: int = 0              # known plans offered before the search
    complete: bool = True       # False when the candidate budget stopped the search early
    plan_space: str = ""        # the space the plan came from ("paper" or "full")

    COUNTS = ("nodes", "candidates", "pruned", "seeds")

    def add_counts(self, other: "SearchStats") -> None:
        """Add `other`'s counts (nodes, candidates, pruned, seeds) to these."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class _Budget(Exception):
    pass


class _Found(Exception):
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


def slices_allowed(m: int, mb: int, min_slice: int, even_slices: bool) -> bool:
    """A stage of m replicas is in the plan space at micro-batch mb: every slice at least
    `min_slice` samples, and equal slices when `even_slices`."""
    return mb // m >= min_slice and (not even_slices or mb % m == 0)


class Search:
    """The exact search over one plan space restriction (`stage_sizes`, `max_stages`): offer
    known plans with `seed`, then `run_micro_batches` for every M; `best` is then
    (M, [(first, last, host counts)]) of least `best_value`, or None if nothing fits."""

    def __init__(self, profile: Profile, topology, global_batch_size: int,
                 policies: Sequence[str] = POLICIES, stage_sizes: Optional[Sequence[int]] = None,
                 stats: Optional[SearchStats] = None, even_slices: bool = False,
                 max_stages: Optional[int] = None, max_candidates: float = math.inf,
                 transfers: str = "async"):
        self.profile = profile
        # On a TensorFlow cluster a first stage's replicas off the chief wait for their rows
        # (`StageModel.first_stage_rows_ms`): added to a complete plan's value, it only raises
        # what every bound here bounds from below.
        self.fed_rows = transfers == "tensorflow" and profile.input_bytes > 0
        self.transfers = transfers      # its `StageModel`s' (replica gradients by exchange)
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
        self.stage_size_set = frozenset(self.stage_sizes or ())
        self.stats = stats or SearchStats()
        self.stage_limit = max_stages or self.G
        self.min_slice = cm.minimum_slice(profile, topology, global_batch_size)
        self.max_candidates = max_candidates
        self.stop_at_first = False      # stop at the first plan better than the incumbent
        self.best_value = _INF
        self.place_cache: Dict[tuple, Optional[tuple]] = {}   # placement depends on used, m only
        self.best: Optional[Tuple[int, List[Tuple[int, int, tuple]]]] = None
        work = [l.forward_ms + l.backward_ms for l in profile.layers]
        self.work_suffix = [0.0] * (self.N + 1)
        for i in range(self.N - 1, -1, -1):
            self.work_suffix[i] = self.work_suffix[i + 1] + work[i]
        self.neg_work_suffix = [-w for w in self.work_suffix]
        # Prefix sums of F and B at the profile batch, as `Profile.forward_ms(0, k - 1)` gives
        # them: the inner loop's stage times are the same numbers as `StageModel.forward_ms`.
        self.forward_prefix = [0.0] + [profile.forward_ms(0, k) for k in range(self.N)]
        self.backward_prefix = [0.0] + [profile.backward_ms(0, k) for k in range(self.N)]

    # ---- one M --------------------------------------------------------------------
    def run_micro_batches(self, M: int) -> None:
        model = StageModel(self.profile, self.topology, self.gbs, M, self.transfers)
        self.model, self.M = model, M
        # A replica's slice time is at least T * (slice / pbs) (the affine scale is never
        # below the linear one for slices under the profile batch): a valid lower bound.
        H = cm.SMALL_BATCH_HALF_SAMPLES
        self.work_factor = M * min(model.micro_batch / model.pbs,
                                   (model.micro_batch + H) / (model.pbs + H))
        self.overhead = M * 2 * cm.TASK_OVERHEAD_MS
        self.transfer_cache: Dict[tuple, Tuple[float, float]] = {}
        # (first, counts, previous) -> {last: StageCost}
        self.stage_cache: Dict[tuple, Dict[int, cm.StageCost]] = {}
        self.placement_cache: Dict[tuple, tuple] = {}        # `_node` by its arguments
        self.stages_after_cache: Dict[tuple, List[tuple]] = {}   # `_stages_after` likewise
        if self._remaining_bound(0, self.G) >= self.best_value:
            self.stats.pruned += 1
            return
        self.path_costs: List[cm.StageCost] = []      # the stages on the depth-first path
        self.trail: List[tuple] = []                  # their `trail_entry`s
        try:
            self._dfs(0, (0,) * len(self.capacity), (0,) * len(self.capacity), _EMPTY, [])
        except _Budget:
            self.stats.complete = False
        except _Found:
            pass

    def seed(self, M: int, stages: Sequence[Tuple[int, int, int]],
             model: Optional[StageModel] = None) -> None:
        """Offer a known plan [(first, last, replicas)] at M as the incumbent if it lies in the
        plan space (devices placed by the append policy, i.e. consecutive ids; replica counts
        allowed; every stage fits). It is valued like any complete plan of the search, so the
        search still returns the exact minimum; a good seed only prunes earlier."""
        if self.gbs % M or not stages or stages[-1][1] != self.N - 1 \
                or len(stages) > self.stage_limit:
            return
        if self.stage_sizes is not None and any(r not in self.stage_size_set for _, _, r in stages):
            return
        if model is None or model.M != M:
            model = StageModel(self.profile, self.topology, self.gbs, M, self.transfers)
        if "append" not in self.policies:
            return
        used = (0,) * len(self.capacity)
        path, taken, mb, stage_bound, forwards = [], 0, model.micro_batch, 0.0, 0.0
        for first, last, r in stages:
            if not self.replicas_allowed(r, mb) or model.max_in_flight(first, last, r) < 1:
                return
            counts = self._place("append", used, r)
            if counts is None:
                return
            used = counts if not path else tuple(map(operator.add, used, counts))
            taken += r
            path.append((first, last, counts))
            F, B = model.forward_ms(first, last, r), model.backward_ms(first, last, r)
            forwards += F
            AR = model.exposed_allreduce_ms(first, last, counts, r)
            stage_bound = max(stage_bound, forwards + (M - 1) * (F + B) + AR + B)
        if taken != self.G:
            return
        self.stats.seeds += 1
        self.value_seed(M, path, model, stage_bound)

    def value_seed(self, M: int, path: List[Tuple[int, int, tuple]], model: StageModel,
                   stage_bound: float) -> None:
        """The rest of `seed` for a seed in the plan space (counted in `stats.seeds`), its
        stages [(first, last, host counts)] placed: its value, the incumbent if less.

        Eq. 1 of the seed (its summary's V) is at least `stage_bound`: for each stage, the
        forwards up to it, then M - 1 of its F + B, then its allreduce and B (transfers only
        add); well above the incumbent (far beyond rounding), the seed cannot replace it: its
        costs are skipped."""
        if stage_bound > self.best_value * (1 + 1e-9):
            return
        prev, summary, costs = None, _EMPTY, []
        for first, last, counts in path:
            cost = model.stage_cost_of(first, last, counts, prev, sum(counts))
            if prev is not None:
                summary = _extend(summary, cost.send_forward_ms, cost.send_backward_ms, 0.0, M)
            summary = _extend(summary, cost.forward_ms, cost.backward_ms, cost.allreduce_ms, M)
            prev = counts
            costs.append(cost)
        if summary[0] < self.best_value:
            value = cm.planned_latency_ms(costs, M)
            if self.fed_rows:
                value += model.first_stage_rows_ms(path[0][2])
            if value < self.best_value:
                self.best_value = value
                self.best = (M, path)

    def _place(self, policy: str, used: tuple, m: int) -> Optional[tuple]:
        """`placement.place`, remembered: it depends on `used` and `m` only."""
        key = (policy, used, m)
        counts = self.place_cache.get(key, 0)
        if counts == 0:
            counts = self.place_cache[key] = place(policy, self.capacity, used, m)
        return counts

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
        """`slices_allowed` with this search's minimum slice and `even_slices`."""
        return mb // m >= self.min_slice and (not self.even_slices or mb % m == 0)

    def _sizes(self, free: int, mb: int) -> Iterable[int]:
        top = min(free, mb // self.min_slice)
        if self.stage_sizes is None:
            return [m for m in range(1, top + 1) if self.replicas_allowed(m, mb)]
        sizes = [s for s in self.stage_sizes if s <= top and self.replicas_allowed(s, mb)]
        if not self.explicit_sizes and free <= top and free not in sizes \
                and self.replicas_allowed(free, mb):
            sizes.append(free)
        return sizes

    def _placements(self, j: int, used: tuple, prev: tuple, must_finish: bool) -> List[tuple]:
        """A node's new stages up to symmetry, in the order the search tries them: (replicas,
        host counts, devices used after it, (forward, backward) transfer from the previous
        stage); only the last stage (all free devices) when `must_finish`. They depend on
        these arguments only, which many paths share; all but the transfer do not depend on
        `j` (`_stages_after`), which the nodes of a two-stage search all differ in."""
        if j == 0:
            return [(m, counts, new_used, None)
                    for m, counts, new_used in self._stages_after(used, prev, must_finish)]
        return [(m, counts, new_used, self._transfer(j - 1, prev, counts))
                for m, counts, new_used in self._stages_after(used, prev, must_finish)]

    def _stages_after(self, used: tuple, prev: tuple, must_finish: bool) -> List[tuple]:
        """`_placements` without the transfers: (replicas, host counts, devices used after
        it), remembered by these arguments (for this M)."""
        key = (used, prev, must_finish)
        out = self.stages_after_cache.get(key)
        if out is not None:
            return out
        free = self.G - sum(used)
        out, seen = [], set()
        for m in self._sizes(free, self.model.micro_batch):
            if must_finish and m != free:
                continue
            for policy in self.policies:
                counts = self._place(policy, used, m)
                if counts is None:
                    continue
                sym = canonical_state(self.capacity, used, prev, counts)
                if sym in seen:
                    continue
                seen.add(sym)
                out.append((m, counts, tuple(map(operator.add, used, counts))))
        self.stages_after_cache[key] = out
        return out

    def _node(self, j: int, used: tuple, prev: tuple, must_finish: bool) -> tuple:
        """What a node's candidate loop needs besides its summary, remembered by these
        arguments (for this M): (free devices, [(replicas, host counts, devices used after
        it, transfer from the previous stage, `time_scale` of the replicas, whether the stage
        takes every free device)])."""
        free = self.G - sum(used)
        scale = self.model.time_scale
        return free, [(m, counts, new_used, transfer, scale(m), m == free)
                      for m, counts, new_used, transfer
                      in self._placements(j, used, prev, must_finish)]

    def _dfs(self, j: int, used: tuple, prev: tuple, summary, path) -> None:
        stats = self.stats
        stats.nodes += 1
        if stats.candidates > self.max_candidates:
            raise _Budget()
        N = self.N
        if j == N:
            # eq. 1 (the summary) is a lower bound of the latency we plan with
            if summary[0] < self.best_value:
                value = cm.planned_latency_ms(self.path_costs, self.M)
                if self.fed_rows:
                    value += self.model.first_stage_rows_ms(path[0][2])
                if value < self.best_value:
                    self.best_value = value
                    self.best = (self.M, list(path))
                    if self.stop_at_first:
                        raise _Found()
            return
        model, M = self.model, self.M
        must_finish = len(path) + 1 >= self.stage_limit
        # best_value changes only below this node (in the recursion after the loop)
        best_value = self.best_value
        candidates = pruned = 0
        fwd, bwd, stage_cache = self.forward_prefix, self.backward_prefix, self.stage_cache
        work_suffix, work_factor, total_overhead = \
            self.work_suffix, self.work_factor, self.overhead
        overhead_ms = cm.TASK_OVERHEAD_MS
        transfer_cpu = model.transfer_cpu
        trail = self.trail
        children = []
        key = (j, used, prev, must_finish)
        node = self.placement_cache.get(key)
        if node is None:
            node = self.placement_cache[key] = self._node(j, used, prev, must_finish)
        free, placements = node
        fwd_j, bwd_j = fwd[j], bwd[j]
        previous = prev if j else None
        for m, counts, new_used, transfer, scale, last_stage_only in placements:
            if j > 0:
                # s0 = _extend(summary, transfer[0], transfer[1], 0.0, M), written out
                V, sumF, E, G = summary
                tf, tb = transfer
                sumF += tf
                x, y = E + tb, 0.0 + tb
                E = y if y > x else x
                base = sumF + (M - 1) * (tf + tb)
                x = G + 0.0
                if x > V:
                    V = x
                x = base + E
                if x > V:
                    V = x
                x, y = G - tb, base + tb
                G = y if y > x else x
            else:
                V, sumF, E, G = summary
            if V >= best_value:
                pruned += 1
                continue
            if last_stage_only:
                lasts = (N - 1,)
            else:
                # The completion bound falls as the stage grows: skip the stage ends whose
                # remaining work alone already exceeds the incumbent (binary search).
                start = j
                if best_value < _INF:
                    base0 = sumF + (0.0 if 0.0 > E else E)      # max(E, 0.0)
                    room = (best_value - base0 - total_overhead) * (free - m) / work_factor
                    i = bisect.bisect_right(self.neg_work_suffix, -room, j + 1, N)
                    start = i - 1
                    pruned += start - j
                lasts = range(start, N - 1)
            # The loop below is `model.forward_ms`, `backward_ms`, `_remaining_bound`,
            # `stage_cost` and `_extend` inlined (the same arithmetic in the same order):
            # it runs for every candidate.
            reach = sumF + E if E > -_INF else sumF
            devices_left = free - m
            # this placement's stage costs by last layer (`stage_cache` by (j, counts, previous))
            costs_by_last = stage_cache.get((j, counts, previous))
            if costs_by_last is None:
                costs_by_last = stage_cache[(j, counts, previous)] = {}
            for last in lasts:
                candidates += 1
                F = (fwd[last + 1] - fwd_j) * scale + overhead_ms
                B = (bwd[last + 1] - bwd_j) * scale + overhead_ms
                # Monotone in `last`: once the stage alone is too long, longer ones are too.
                if reach + M * (F + B) >= best_value:
                    pruned += 1
                    break
                if transfer_cpu:    # `stage_cost_of`'s transfer ends (not monotone: after)
                    cpu = model.transfer_cpu_ms(j, last, m)
                    F, B = F + cpu, B + cpu
                if not last_stage_only:
                    rest = work_suffix[last + 1] * work_factor / devices_left + total_overhead
                else:
                    rest = 0.0
                stage_cost = costs_by_last.get(last)
                if stage_cost is None:
                    fit = model.max_in_flight(j, last, m)
                    if fit < 1:
                        continue
                    # `model.stage_cost_of`: its transfers are the node's, F and B these
                    stage_cost = costs_by_last[last] = StageCost(
                        transfer[0] if j else 0.0, transfer[1] if j else 0.0, F, B,
                        model.exposed_allreduce_ms(j, last, counts, m), fit)
                elif stage_cost.max_in_flight < 1:
                    continue
                AR = stage_cost.allreduce_ms
                # s1 = _extend(s0, F, B, AR, M), each max(a, b) as `b if b > a else a`
                sumF2 = sumF + F
                x, y = E + B, AR + B
                E2 = y if y > x else x
                base = sumF2 + (M - 1) * (F + B)
                V2, x = V, G + AR
                if x > V2:
                    V2 = x
                x = base + E2
                if x > V2:
                    V2 = x
                x, y = G - B, base + B
                s1 = (V2, sumF2, E2, y if y > x else x)
                if rest:
                    x = sumF2 + E2 + rest
                    bound = x if x > V2 else V2
                else:
                    bound = V2
                if bound >= best_value:
                    pruned += 1
                    continue
                entry = None
                if best_value < _INF:
                    if last_stage_only:
                        more = 0
                    else:
                        more = N - 1 - last
                        if devices_left < more:
                            more = devices_left
                    trip_rest = (rest - total_overhead) / M if rest else 0.0
                    # the trail's K bounds are kept for G stages (a straight pipeline's count)
                    trip_bound, entry = round_trip_bound(trail, stage_cost, M, more, trip_rest,
                                                         best_value, self.G)
                    if trip_bound > bound:
                        bound = trip_bound
                    if bound >= best_value:
                        pruned += 1
                        continue
                children.append((bound, last, m, counts, new_used, s1, stage_cost, entry))
        stats.candidates += candidates
        stats.pruned += pruned
        if not children:
            return
        if len(children) > 1:
            children.sort(key=_first)
        path_costs = self.path_costs
        for bound, last, m, counts, new_used, s1, stage_cost, entry in children:
            if bound >= self.best_value:
                stats.pruned += 1
                continue
            path.append((j, last, counts))
            trail.append(entry or trail_entry(trail, stage_cost, M, self.G))
            path_costs.append(stage_cost)
            self._dfs(last + 1, new_used, counts, s1, path)
            path.pop()
            path_costs.pop()
            trail.pop()
