"""The DAPPLE planner (§IV-C): the plan of least estimated latency for a profile, a topology
and a global batch.

Plan space: the layers cut into consecutive stages; each stage placed on a device set built by
Fresh First, Append First or Scatter First (`planner.placement`) from the devices still free,
all devices used; the number of micro-batches M a divisor of the global batch with every
replica's slice at least `cost_model.minimum_slice` samples (the profile batch: the DAPPLE
authors' `min_micro_batch_size`); with `even_slices` every stage's replicas get equal slices
(what the runtime needs); every stage able to hold one micro-batch in memory. Pure
data parallelism (one stage) and straight pipelines are points of this space.

Two plan spaces (`plan_space`), both searched exactly:

* "paper" (the default): data parallelism, every two-stage plan (any cut, any r : G - r, any
  placement) and the straight pipeline (one device a stage on all devices). These are the
  shapes the DAPPLE paper reports (Table V: DP, 8:8, 11:5, 15:1, straight) and the only shapes
  its authors' planner (HPGO 0.9.2, run on the paper's profiles: README, "The authors'
  planner") returned; §IV-D1 argues for as few stages as possible. With the paper's profiles it
  reproduces 14 of Table V's 15 shapes. When nothing in it fits in memory, the full space is
  searched (`SearchStats.plan_space` says "full"): a model too big for two stages needs a
  deeper pipeline.
* "full": every pipeline (any number of stages, each of any size). On flat networks our cost
  model (and the simulator) rate deeper pipelines of small replicated stages 8-38% faster than
  the paper's shapes: their allreduces hide behind the backward chain of the stages before them.
  They have not been measured on a real cluster; the strategy report shows the full space's
  best beside the plan, so a user can opt in (`dapple plan --plan_space=full`).

Objective: the latency of `cost_model.evaluate`, i.e. eq. 1 with the pivot's round-trip wait
(`cost_model.round_trip_phases`), which depends on the warm-up depths K_i the plan will run
(policy by ACR, capped by memory: `cost_model.warmup_for`). A complete plan is valued exactly
that way (`_Search.plan_value`); eq. 1 is a lower bound of it and drives the pruning.

Search, for each M: depth-first over (layers planned j, occupied devices), adding one stage at a
time, exactly as eq. 4-5 extend T_PL(j, m, g) to T_PL(j', m + m', g + g'). It is exact (tests
compare it with brute force) because every pruning test uses a lower bound:

* prefix sums over layers (`Profile`), so a stage's cost is O(1) (its allreduce overlap O(len),
  cached);
* a 4-number summary of the partial plan (V, sum F, E, G) from which eq. 1 of any completion
  follows (`_extend`); V is eq. 1 of the known stages, a lower bound of every completion;
* seeds: before searching, every uniform pipeline (G/r stages of r devices, balanced cuts;
  DP and straight included), every two-stage plan (each cut, each r : G - r, as the DAPPLE
  authors' planner enumerates them) and PipeDream's partition are valued at every M;
* lower-bound pruning: a completion costs at least sum F + E + M * (the remaining work spread
  over the remaining devices + the per-task overheads), and at least V;
* the round-trip bound (`_round_trip_bound`): for each known stage q, its pivot term of the
  round-trip latency with the trip known so far and the largest K_q any completion could run
  (memory caps of stages 0..q, policy B's depth with the most stages still possible).
No dominance between partial plans: with K depending on the whole plan (stage count, ACR,
memory caps) a partial plan worse in eq. 1's summary can still complete better, so the old
dominance test on (V, G, sumF, sumF + E) is not exact any more.

On topologies of more than `LARGE_TOPOLOGY_DEVICES` devices the stage sizes tried are 1..(the
largest host) and whole multiples of it (a plan then still may be DP, straight, or hybrid).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from planner import cost_model as cm
from planner.cost_model import StageModel
from planner.placement import POLICIES, assign_devices, place
from planner.costs import PipelineCosts
from planner.plan import Plan, PlanError, Stage
from planner.profile import Profile

LARGE_TOPOLOGY_DEVICES = 64
# Candidate stages evaluated before the search settles for the best plan found (about 1 s of
# Python). Far above what small instances need (the brute-force tests never reach it); it
# bounds the time on deep, uniform models on flat networks, where many near-equal deep
# pipelines survive the bounds. `SearchStats.complete` reports whether it was reached.
# A candidate's cost grows with the hosts (placement and transfers work on host vectors), so
# beyond BUDGET_HOSTS hosts the budget shrinks in proportion: the time stays about the same.
DEFAULT_MAX_CANDIDATES = 15000
BUDGET_HOSTS = 16
# "paper": data parallelism, every two-stage plan and the straight pipeline (the shapes the
# DAPPLE paper's planner returns); "full": every pipeline. See the module docstring.
PLAN_SPACES = ("paper", "full")
DEFAULT_PLAN_SPACE = "paper"
_INF = math.inf


class NoPlanFits(PlanError):
    """No plan fits in device memory; `min_memory_bytes` is the least memory that would."""

    def __init__(self, message: str, min_memory_bytes: float):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclasses.dataclass
class SearchStats:
    nodes: int = 0
    candidates: int = 0
    pruned: int = 0
    dominated: int = 0
    seeds: int = 0              # known plans (DP, uniform pipelines, PipeDream) offered first
    complete: bool = True       # False when the candidate budget stopped the search early
    plan_space: str = ""        # the space the plan came from ("paper" or "full")


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


def micro_batch_choices(global_batch_size: int) -> List[int]:
    return [m for m in range(1, global_batch_size + 1) if global_batch_size % m == 0]


class _Search:
    def __init__(self, profile: Profile, topology, global_batch_size: int,
                 policies: Sequence[str] = POLICIES, stage_sizes: Optional[Sequence[int]] = None,
                 stats: Optional[SearchStats] = None, even_slices: bool = False,
                 max_stages: Optional[int] = None):
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
        self.max_candidates = math.inf
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
        self.fits: Dict[tuple, bool] = {}
        self.transfer_cache: Dict[tuple, Tuple[float, float]] = {}
        if self._remaining_bound(0, self.G) >= self.best_value:
            self.stats.pruned += 1
            return
        self.path_costs = []
        try:
            self._dfs(0, (0,) * len(self.capacity), (0,) * len(self.capacity), _EMPTY, [])
        except _Budget:
            self.stats.complete = False

    def seed(self, M: int, stages: Sequence[Tuple[int, int, int]],
             model: Optional[StageModel] = None) -> None:
        """Offer a known plan [(first, last, replicas)] at M as the incumbent if it lies in the
        plan space (devices placed by the append policy, i.e. consecutive ids; replica counts
        allowed; every stage fits). Its value is computed by the search's own summaries, so
        the search still returns the exact minimum; a good seed only prunes earlier."""
        if self.gbs % M or not stages or stages[-1][1] != self.N - 1 \
                or len(stages) > self.stage_limit:
            return
        if self.stage_sizes is not None and any(r not in self.stage_sizes for _, _, r in stages):
            return
        if model is None or model.M != M:
            model = StageModel(self.profile, self.topology, self.gbs, M)
        used = (0,) * len(self.capacity)
        prev, summary, path = None, _EMPTY, []
        for first, last, r in stages:
            if not self.replicas_allowed(r, model.micro_batch) or \
                    model.max_in_flight(first, last, r) < 1:
                return
            counts = place("append", self.capacity, used, r)
            if counts is None or "append" not in self.policies:
                return
            if prev is not None:
                x = model.boundary_bytes(first - 1)
                summary = _extend(summary, model.transfer_ms(x, prev, counts),
                                  model.transfer_ms(x, counts, prev), 0.0, M)
            summary = _extend(summary, model.forward_ms(first, last, r),
                              model.backward_ms(first, last, r),
                              model.exposed_allreduce_ms(first, last, counts), M)
            used = tuple(u + c for u, c in zip(used, counts))
            prev = counts
            path.append((first, last, counts))
        if sum(used) != self.G:
            return
        self.stats.seeds += 1
        if summary[0] < self.best_value:
            value = self.plan_value(model, path)
            if value < self.best_value:
                self.best_value = value
                self.best = (M, path)

    def _remaining_bound(self, j: int, devices_left: int) -> float:
        if j >= self.N:
            return 0.0
        return self.work_suffix[j] * self.work_factor / devices_left + self.overhead

    def _fits(self, first: int, last: int, m: int) -> bool:
        key = (first, last, m)
        hit = self.fits.get(key)
        if hit is None:
            hit = self.model.max_in_flight(first, last, m) >= 1
            self.fits[key] = hit
        return hit

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

    def plan_value(self, model: StageModel, path) -> float:
        """The latency we plan with (`cost_model.round_trip_phases`) of a complete plan
        [(first, last, counts)] at `model`'s M, with the K_i `finish_plan` will choose."""
        stage_costs = []
        prev = None
        for first, last, counts in path:
            r = sum(counts)
            tf = tb = 0.0
            if prev is not None:
                x = model.boundary_bytes(first - 1)
                tf, tb = model.transfer_ms(x, prev, counts), model.transfer_ms(x, counts, prev)
            stage_costs.append((tf, tb, model.forward_ms(first, last, r),
                                model.backward_ms(first, last, r),
                                model.exposed_allreduce_ms(first, last, counts),
                                model.max_in_flight(first, last, r)))
            prev = counts
        return self.value_of_costs(model.M, stage_costs)

    @staticmethod
    def value_of_costs(M: int, stage_costs) -> float:
        """`plan_value` from per-stage (send forward into it, send backward out of it, F, B,
        AR, memory cap D) as the depth-first search carries them along its path."""
        fw = [c[2] for c in stage_costs]
        bw = [c[3] for c in stage_costs]
        ar = [c[4] for c in stage_costs]
        caps = [c[5] for c in stage_costs]
        sf = [c[0] for c in stage_costs[1:]]
        sb = [c[1] for c in stage_costs[1:]]
        costs = PipelineCosts(forward_ms=fw, backward_ms=bw, send_forward_ms=sf,
                              send_backward_ms=sb, allreduce_ms=ar)
        ks = cm.warmup_for(costs, caps, M)[1]
        Tw, Ts, Te, _ = cm.round_trip_phases(*cm.interleave(costs), M, ks)
        return Tw + Ts + Te

    def _round_trip_bound(self, new_stage, more_stages: int, trip_rest: float) -> float:
        """A lower bound of the round-trip latency (`cost_model.round_trip_phases`) of every
        completion of the current path plus `new_stage`, from the pivot terms of the known
        stages. For a known stage q, Tw up to q and the s <= q terms of Te are final; the trip
        R_q only grows as stages are added (by at least `trip_rest`, the remaining work spread
        over the free devices); K_q is at most min(M, policy B's depth with the most stages
        still possible, the memory caps D of stages 0..q). The wait and the steady period fall
        as K grows and rise with R, so those values give a lower bound of the final L(q), and
        the latency is the maximum over q."""
        M = self.M
        costs = self.path_costs + [new_stage]
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
            tf, tb, F, B, AR, cap = costs[i]
            fb, k = F + B, kmax[i]
            wait = trip - (k - 1) * F
            period = (fb + trip) / k
            value = tw[i] + (wait if wait > 0.0 else 0.0) + \
                (M - 1) * (period if period > fb else fb) + te[i]
            if value > best:
                best = value
            trip += fb + tf + tb
        return best

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
                value = self.value_of_costs(self.M, self.path_costs)
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
                sym = tuple(sorted(zip(self.capacity, used, prev, counts)))
                if sym in seen:
                    continue
                seen.add(sym)
                new_used = tuple(u + c for u, c in zip(used, counts))
                s0 = summary
                tf = tb = 0.0
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
                    if not self._fits(j, last, m):
                        continue
                    AR = model.exposed_allreduce_ms(j, last, counts)
                    s1 = _extend(s0, F, B, AR, M)
                    bound = max(s1[0], s1[1] + s1[2] + rest) if rest else s1[0]
                    if bound >= self.best_value:
                        self.stats.pruned += 1
                        continue
                    stage_cost = (tf, tb, F, B, AR, model.max_in_flight(j, last, m))
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


def _order_micro_batches(profile: Profile, topology, gbs: int) -> List[int]:
    """Try the micro-batch counts most likely to be best first (a good early incumbent
    prunes the rest): M near 4x the stage count of a balanced deep pipeline, then outwards."""
    choices = micro_batch_choices(gbs)
    target = 4 * min(profile.num_layers, topology.num_devices)
    return sorted(choices, key=lambda m: abs(math.log(m / target)))


def balanced_cuts(profile: Profile, stages: int) -> List[Tuple[int, int]]:
    """[(first, last)] of `stages` consecutive layer ranges whose largest forward+backward time
    is least (binary search on that time, greedy packing; every range non-empty)."""
    N = profile.num_layers
    work = [l.forward_ms + l.backward_ms for l in profile.layers]

    def pack(limit):
        parts, first, acc = [], 0, 0.0
        for k in range(N):
            # cut before k if it would overflow, or if the layers left are just enough to
            # give every remaining stage one
            must_cut = N - k == stages - len(parts) - 1 and k > first
            if k > first and (acc + work[k] > limit or must_cut):
                parts.append((first, k - 1))
                first, acc = k, 0.0
            acc += work[k]
        parts.append((first, N - 1))
        return parts

    lo, hi = max(work), sum(work)
    best = pack(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        parts = pack(mid)
        if len(parts) <= stages:
            hi, best = mid, parts
        else:
            lo = mid
    # split the largest ranges until there are exactly `stages`
    while len(best) < stages:
        i = max(range(len(best)), key=lambda t: best[t][1] - best[t][0])
        a, b = best[i]
        if a == b:
            break
        best[i:i + 1] = [(a, (a + b) // 2), ((a + b) // 2 + 1, b)]
    return best


def _seed_search(search: "_Search", ms: Sequence[int]) -> None:
    """Known plans as first incumbents: every uniform pipeline (G/r stages of r devices, layers
    balanced; r = G is data parallelism, r = 1 the straight pipeline) and PipeDream's plan,
    each at every M tried. They prune most of the space before the exact search starts."""
    G, N = search.G, search.N
    shapes = []
    for r in range(1, G + 1):
        if G % r == 0 and G // r <= N:
            shapes.append([(a, b, r) for a, b in balanced_cuts(search.profile, G // r)])
    # PipeDream's partition (its numpy DP takes 0.1 s even on 128 x 8), so the result is never
    # estimated slower than PipeDream's whenever its partition lies in the plan space.
    try:
        from planner.pipedream import pipedream_partition
        shapes.append(pipedream_partition(search.profile, search.topology))
    except PlanError:
        pass
    # Every two-stage plan (each cut, each r : G - r), as the DAPPLE authors' planner
    # enumerates them (HPGO `compute_bipartition`): cheap, and the best of them is often the
    # optimum or close to it (VGG-19's 15:1, AmoebaNet's 11:5).
    sizes = search.stage_sizes
    pairs = [r for r in range(1, G)
             if sizes is None or (r in sizes and G - r in sizes)]
    for last in range(N - 1):
        for r in pairs:
            shapes.append([(0, last, r), (last + 1, N - 1, G - r)])
    for M in ms:
        model = StageModel(search.profile, search.topology, search.gbs, M)
        for stages in shapes:
            search.seed(M, stages, model)


def _build_plan(search: _Search, profile: Profile, topology, gbs: int) -> Plan:
    M, path = search.best
    devices = assign_devices(topology, [counts for _, _, counts in path])
    stages = [Stage(layers=[first, last], devices=devs,
                    layer_names=profile.layer_names[first:last + 1])
              for (first, last, _), devs in zip(path, devices)]
    return finish_plan(Plan(stages=stages, micro_batches=M, global_batch_size=gbs),
                       profile, topology)


def finish_plan(plan: Plan, profile: Profile, topology, keep_warmup: bool = False) -> Plan:
    """Fill the derived fields: warm-up policy and K_i, estimate, topology, profile."""
    if not keep_warmup or plan.warmup is None:
        policy, ks = cm.choose_warmup(plan, profile, topology)
        plan.schedule, plan.warmup = policy, ks
    plan.estimate = cm.evaluate(plan, profile, topology)
    plan.topology = topology.to_dict()
    plan.profile = profile.summary()
    if not plan.stages[0].layer_names:
        for st in plan.stages:
            st.layer_names = profile.layer_names[st.first:st.last + 1]
    return plan


def _with_memory(topology, memory_limit):
    if memory_limit is None:
        return topology
    if isinstance(memory_limit, str):
        from topology.units import parse_memory
        memory_limit = parse_memory(memory_limit)
    return dataclasses.replace(topology, device_memory_bytes=float(memory_limit))


def _check_inputs(profile: Profile, topology, gbs: int) -> None:
    if not isinstance(gbs, int) or gbs < 1:
        raise PlanError(f"global batch size must be a positive integer, got {gbs!r}")


def minimum_memory_bytes(profile: Profile, topology, gbs: int) -> float:
    """The least per-device memory any plan needs: a straight pipeline over
    min(layers, devices) stages at one-sample micro-batches, cut to balance memory
    (weights, gradients, optimizer slots, one micro-batch, the reserve)."""
    model = StageModel(profile, topology, gbs, gbs)
    N, S = profile.num_layers, min(profile.num_layers, topology.num_devices)

    def need(a, b):
        return model.static_bytes(a, b) + model.activation_bytes(a, b, 1)

    # best[k][i]: least max-stage memory covering layers i.. with k stages.
    best = [[_INF] * (N + 1) for _ in range(S + 1)]
    best[0][N] = 0.0
    for k in range(1, S + 1):
        for i in range(N - 1, -1, -1):
            v = _INF
            for e in range(i, N):
                if best[k - 1][e + 1] == _INF:
                    continue
                v = min(v, max(need(i, e), best[k - 1][e + 1]))
            best[k][i] = v
    return min(best[k][0] for k in range(1, S + 1))


def plan_dapple(profile: Profile, topology, global_batch_size: int, memory_limit=None,
                policies: Sequence[str] = POLICIES, micro_batches: Optional[Sequence[int]] = None,
                stage_sizes: Optional[Sequence[int]] = None,
                stats: Optional[SearchStats] = None,
                max_candidates: Optional[int] = DEFAULT_MAX_CANDIDATES,
                even_slices: bool = False, plan_space: str = DEFAULT_PLAN_SPACE) -> Plan:
    """The plan of least estimated latency in `plan_space` (see the module docstring).

    `memory_limit` (bytes or '16GB') overrides the topology's device memory. `micro_batches`
    restricts M; `stage_sizes` the replica counts tried. `max_candidates` caps the stages
    evaluated by each search (None: no cap; on more than BUDGET_HOSTS hosts it is scaled down
    in proportion); `stats.complete` says whether the whole space was covered and
    `stats.plan_space` which space the plan came from. Raises NoPlanFits with the least memory
    that would fit when nothing does.
    """
    _check_inputs(profile, topology, global_batch_size)
    if plan_space not in PLAN_SPACES:
        raise PlanError(f"unknown plan space {plan_space!r}; use one of {', '.join(PLAN_SPACES)}")
    topo = _with_memory(topology, memory_limit)
    ms = list(micro_batches) if micro_batches is not None else \
        _order_micro_batches(profile, topo, global_batch_size)
    for M in ms:
        if global_batch_size % M:
            raise PlanError(f"micro_batches {M} does not divide the global batch "
                            f"{global_batch_size}")
    min_slice = cm.minimum_slice(profile, topo, global_batch_size)
    ms = [M for M in ms if min_slice <= global_batch_size // M]
    budget = math.inf if max_candidates is None else \
        max_candidates * BUDGET_HOSTS // max(BUDGET_HOSTS, topo.num_hosts)
    stats = stats if stats is not None else SearchStats()

    def search(sizes, max_stages):
        own = SearchStats()     # each search has its own candidate budget
        found = _Search(profile, topo, global_batch_size, policies, sizes, own,
                        even_slices=even_slices, max_stages=max_stages)
        found.max_candidates = budget
        _seed_search(found, ms)
        for M in ms:
            found.run_micro_batches(M)
        for name in ("nodes", "candidates", "pruned", "dominated", "seeds"):
            setattr(stats, name, getattr(stats, name) + getattr(own, name))
        stats.complete = stats.complete and own.complete
        return found

    searches = []
    if plan_space == "paper":
        searches.append(search(stage_sizes, 2))          # data parallelism, two stages
        if topo.num_devices <= profile.num_layers and (stage_sizes is None or 1 in stage_sizes):
            searches.append(search([1], None))           # the straight pipeline
    stats.plan_space = plan_space
    if not any(s.best is not None for s in searches):
        # The full space; for "paper", only when nothing there fits (a model too big for two
        # stages needs a deeper pipeline).
        stats.plan_space = "full"
        searches.append(search(stage_sizes, None))
    found = [s for s in searches if s.best is not None]
    if not found:
        need = minimum_memory_bytes(profile, topo, global_batch_size)
        if need > topo.device_memory_bytes:
            raise NoPlanFits(
                f"no plan of {profile.name} fits in {topo.device_memory_bytes / 2**30:.2f} GiB "
                f"per device on {topo.describe()}; the smallest plan needs "
                f"{need / 2**30:.2f} GiB per device (a straight pipeline at one-sample "
                f"micro-batches). Use devices with more memory, more devices, or a smaller model",
                need)
        raise PlanError(f"no plan of {profile.name} uses all {topo.num_devices} devices with a "
                        f"global batch of {global_batch_size}: every replica needs a slice of "
                        f"at least one sample and every stage at least one layer; use a larger "
                        f"global batch or fewer devices")
    best = min(found, key=lambda s: s.best_value)
    return _build_plan(best, profile, topo, global_batch_size)


def best_data_parallel_plan(profile: Profile, topology, global_batch_size: int,
                            memory_limit=None, even_slices: bool = False) -> Plan:
    """Pure data parallelism on all devices (gradient accumulation over M micro-batches,
    allreduce overlapped with the last backward), the best M."""
    _check_inputs(profile, topology, global_batch_size)
    topo = _with_memory(topology, memory_limit)
    G = topo.num_devices
    if global_batch_size < G:
        raise PlanError(f"global batch {global_batch_size} is smaller than the {G} replicas of "
                        f"data parallelism: every replica needs at least one sample")
    if even_slices and global_batch_size % G:
        raise PlanError(f"even slices need the global batch {global_batch_size} to divide by "
                        f"the {G} replicas of data parallelism; use a multiple of {G}")
    best = None
    floor = cm.minimum_slice(profile, topo, global_batch_size)
    for M in micro_batch_choices(global_batch_size):
        mb = global_batch_size // M
        if mb // G < floor or (even_slices and mb % G):
            continue
        model = StageModel(profile, topo, global_batch_size, M)
        if model.max_in_flight(0, profile.num_layers - 1, G) < 1:
            continue
        plan = Plan(stages=[Stage(layers=[0, profile.num_layers - 1], devices=list(range(G)))],
                    micro_batches=M, global_batch_size=global_batch_size)
        est = cm.evaluate(plan, profile, topo)
        if best is None or est.latency_ms < best[0]:
            best = (est.latency_ms, plan)
    if best is None:
        raise NoPlanFits(f"data parallelism of {profile.name} does not fit in "
                         f"{topo.device_memory_bytes / 2**30:.2f} GiB per device even at the "
                         f"smallest allowed slice ({floor} samples a replica)", minimum_memory_bytes(profile, topo,
                                                                     global_batch_size))
    return finish_plan(best[1], profile, topo)


def best_straight_plan(profile: Profile, topology, global_batch_size: int,
                       memory_limit=None, even_slices: bool = False) -> Plan:
    """The best pipeline without replication over all devices (one device a stage)."""
    _check_inputs(profile, topology, global_batch_size)
    topo = _with_memory(topology, memory_limit)
    if topo.num_devices > profile.num_layers:
        raise PlanError(f"a straight pipeline over {topo.num_devices} devices needs at least "
                        f"as many layers; {profile.name} has {profile.num_layers}")
    plan = plan_dapple(profile, topo, global_batch_size, stage_sizes=[1], even_slices=even_slices,
                       plan_space="full")
    assert all(st.replicas == 1 for st in plan.stages) and plan.num_stages == topo.num_devices
    return plan
