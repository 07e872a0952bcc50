"""The DAPPLE planner's entry point, `plan_dapple`: which plans it considers (the plan space),
in which order it tries M, and how much work each exact search may do.

Two plan spaces (`plan_space`), both searched exactly (`planner.search.exact_search`):

* "paper" (the default): data parallelism, every two-stage plan (any cut, any r : G - r, any
  placement) and the straight pipeline (one device a stage on all devices). These are the
  shapes the DAPPLE paper reports (Table V: DP, 8:8, 11:5, 15:1, straight), the only shapes its
  authors' planner (HPGO 0.9.2) returned on the paper's profiles, and §IV-D1 argues for as few
  stages as possible. When nothing in it fits in memory, the full space is searched
  (`SearchStats.plan_space` says "full"): a model too big for two stages needs a deeper
  pipeline.
* "full": every pipeline (any number of stages, each of any size). On flat networks the cost
  model rates deeper pipelines of small replicated stages faster than the paper's shapes
  (their allreduces hide behind the backward chain of the stages before them); such plans have
  not been measured on a real cluster, so they are opt-in (`dapple plan --plan_space=full`).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

from planner.estimate import cost_model as cm
from planner.search.exact_search import Search, SearchStats
from planner.search.plan_finishing import (NoPlanFits, check_global_batch, finish_plan, micro_batch_choices,
                            minimum_memory_bytes, with_memory)
from planner.search.placement import POLICIES, assign_devices
from planner.formats.plan import Plan, PlanError, Stage
from planner.formats.profile import Profile
from planner.search.scoped_memo import ScopedMemo
from planner.search.seed_plans import remembering_shapes, seed_search
from planner.search.straight_bound import straight_may_beat_any
from planner.search.two_stage_bound import SLACK as FLOOR_SLACK, two_stage_floor

PLAN_SPACES = ("paper", "full")
DEFAULT_PLAN_SPACE = "paper"
# Candidate stages one search evaluates before it settles for the best plan found (its time:
# docs/planner.md, "Speed"). Far above what small instances need; it bounds the time on deep,
# uniform models on flat networks, where many near-equal deep pipelines survive the bounds. A
# candidate costs O(hosts), so beyond BUDGET_HOSTS hosts the budget shrinks in proportion.
DEFAULT_MAX_CANDIDATES = 15000
BUDGET_HOSTS = 16
_searches = ScopedMemo()        # by everything a search depends on, inside `remembering_searches`


def remembering_searches():
    """Within it, a search run again with the same arguments is not run again: a report plans
    the straight pipeline twice (the paper space's own search, then the "best straight"
    alternative: the same search, the same result). The search is deterministic in its
    arguments, so use it where neither the profile nor the cost model changes (one command)."""
    return _searches.scope()


class Found(NamedTuple):
    """What a finished search found: `Search.best` and `Search.best_value`."""
    best: Optional[Tuple[int, List[Tuple[int, int, tuple]]]]
    best_value: float


def _search(profile: Profile, topo, gbs: int, policies: Sequence[str],
            sizes: Optional[Sequence[int]], max_stages: Optional[int], even_slices: bool,
            budget: float, ms: Sequence[int], below: float = math.inf,
            transfers: str = "async") -> Tuple[SearchStats, Found]:
    """(its statistics, what the seeded search run over `ms` found; remembered within
    `remembering_searches`).

    `below` (the latency of a plan found before, which wins ties): only a plan below it
    matters, and the one returned is the search's own without `below`. If the seeds' best is
    not below it, the search starts with `below` as its incumbent and stops at the first plan
    below it; then the search without `below` is run and returned. If it finds none, neither
    does the search without `below`: that one's incumbent after seeding is finite and at least
    `below`, so the children are sorted by the same bounds, and the bounded search visits a
    subset of its nodes in the same order with no more candidates at each; no bound prunes the
    path to the first plan below `below` it would value, so that plan is reached within the
    budget. Within `remembering_searches`, the search without `below`, if run before (the
    report's "best straight" alternative), is the answer."""
    key = (topo, gbs, tuple(policies), None if sizes is None else tuple(sizes), max_stages,
           even_slices, budget, tuple(ms), transfers, below)
    unbounded = key[:-1] + (math.inf,)
    hit = _searches.get(profile, key)
    if hit is None and below < math.inf:
        hit = _searches.get(profile, unbounded)   # the search without it, if run
    if hit is not None:
        return hit
    own = SearchStats()     # each search has its own candidate budget
    found = Search(profile, topo, gbs, policies, sizes, own, even_slices=even_slices,
                   max_stages=max_stages, max_candidates=budget, transfers=transfers)
    seed_search(found, ms)
    bounded = found.best is not None and below <= found.best_value
    if bounded:         # stop at the first plan below `below`: the search without it follows
        found.best, found.best_value, found.stop_at_first = None, below, True
    for M in ms:
        found.run_micro_batches(M)
        if bounded and found.best is not None:
            break
    if bounded and found.best is not None:
        alone, result = _search(profile, topo, gbs, policies, sizes, max_stages, even_slices,
                                budget, ms, math.inf, transfers)
        own.add_counts(alone)
        own.complete = alone.complete
    else:
        result = Found(found.best, found.best_value)
    _searches.put(profile, key, (own, result))
    if not bounded:     # it was the search without `below`
        _searches.put(profile, unbounded, (own, result))
    return own, result


def _order_micro_batches(profile: Profile, topology, gbs: int) -> List[int]:
    """The micro-batch counts most likely to be best first (a good early incumbent prunes the
    rest): M near 4x the stage count of a balanced deep pipeline, then outwards."""
    choices = micro_batch_choices(gbs)
    target = 4 * min(profile.num_layers, topology.num_devices)
    return sorted(choices, key=lambda m: abs(math.log(m / target)))


def _build_plan(search: Found, profile: Profile, topology, gbs: int,
                transfers: str = "async") -> Plan:
    M, path = search.best
    devices = assign_devices(topology, [counts for _, _, counts in path])
    stages = [Stage(layers=[first, last], devices=devs,
                    layer_names=profile.layer_names[first:last + 1])
              for (first, last, _), devs in zip(path, devices)]
    return finish_plan(Plan(stages=stages, micro_batches=M, global_batch_size=gbs,
                            transfers=transfers), profile, topology)


def plan_dapple(profile: Profile, topology, global_batch_size: int, memory_limit=None,
                policies: Sequence[str] = POLICIES, micro_batches: Optional[Sequence[int]] = None,
                stage_sizes: Optional[Sequence[int]] = None,
                stats: Optional[SearchStats] = None,
                max_candidates: Optional[int] = DEFAULT_MAX_CANDIDATES,
                even_slices: bool = False, plan_space: str = DEFAULT_PLAN_SPACE,
                bound_straight: bool = True, transfers: str = "async") -> Plan:
    """The plan of least estimated latency in `plan_space` (see the module docstring).

    `memory_limit` (bytes or '16GB') overrides the topology's device memory. `micro_batches`
    restricts M; `stage_sizes` the replica counts tried. `max_candidates` caps the stages
    evaluated by each search (None: no cap; on more than BUDGET_HOSTS hosts it is scaled down
    in proportion); `stats.complete` says whether the whole space was covered and
    `stats.plan_space` which space the plan came from. Raises NoPlanFits with the least memory
    that would fit when nothing does. In the paper space the straight pipeline is searched
    last, below the latency of the plans found before (`_search`'s `below`), and not at all
    when a lower bound of every straight plan's latency is not below it
    (`straight_bound.straight_may_beat`); or, when a straight plan may be faster than every
    two-stage plan (`two_stage_bound.two_stage_floor`), first and on its own, then the
    two-stage plans below or equal to it, not at all when their floor is above it: the same
    plan, other statistics; `bound_straight=False` searches it on its own, after them, as
    before. `transfers` is the plans' (`Plan.transfers`); "tensorflow" counts the rows the
    chief sends a first stage's other replicas.
    """
    check_global_batch(global_batch_size)
    if plan_space not in PLAN_SPACES:
        raise PlanError(f"unknown plan space {plan_space!r}; use one of {', '.join(PLAN_SPACES)}")
    topo = with_memory(topology, memory_limit)
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

    def search(sizes, max_stages, below=math.inf):
        own, found = _search(profile, topo, global_batch_size, policies, sizes, max_stages,
                             even_slices, budget, ms, below, transfers)
        stats.add_counts(own)
        stats.complete = stats.complete and own.complete
        return found

    with remembering_shapes():      # the searches below seed with the same shapes
        searches = []
        if plan_space == "paper":
            straight = topo.num_devices <= profile.num_layers and \
                (stage_sizes is None or 1 in stage_sizes)
            # No plan of data parallelism or two stages is faster than `floor`.
            floor = two_stage_floor(profile, topo, global_batch_size, ms, min_slice,
                                    even_slices, transfers) if straight and bound_straight \
                else None
            if floor is not None and straight_may_beat_any(profile, topo, global_batch_size,
                                                           ms, floor):
                # The straight pipeline may win: searched first, on its own (the search
                # `_search` returns below when it wins), then the two-stage plans only if one
                # may be as fast (ties go to them: `min` below keeps the first of equals),
                # below or equal to it. Where it is faster than `floor` they are not searched.
                alone = search([1], None)
                if alone.best is None or floor <= alone.best_value * (1 + FLOOR_SLACK):
                    below = math.nextafter(alone.best_value, math.inf)
                    searches.append(search(stage_sizes, 2, below))
                searches.append(alone)
            else:
                searches.append(search(stage_sizes, 2))      # data parallelism, two stages
                if straight:
                    # the straight pipeline, if it beats them (`min` below keeps the first of
                    # equals)
                    below = searches[0].best_value if bound_straight else math.inf
                    # not searched when no straight plan can be below it (`straight_bound`):
                    # the search would find none, so the plan is the same
                    if below == math.inf or straight_may_beat_any(
                            profile, topo, global_batch_size, ms, below):
                        searches.append(search([1], None, below))
        stats.plan_space = plan_space
        if not any(s.best is not None for s in searches):
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
    return _build_plan(best, profile, topo, global_batch_size, transfers)
