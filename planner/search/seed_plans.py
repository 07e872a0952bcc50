"""Known plans offered to the exact search before it starts (`Search.seed`): a good first
incumbent prunes most of the space, and the result is never worse than any seed.

The shapes, each valued at every M tried: every uniform pipeline (G/r stages of r devices, the
layers balanced: r = G is data parallelism, r = 1 the straight pipeline), PipeDream's
partition, and every two-stage plan (each cut, each r : G - r, as the DAPPLE authors' planner
enumerates them in HPGO's `compute_bipartition`), whose best is often the optimum or close to
it (VGG-19's 15:1, AmoebaNet's 11:5)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from planner.estimate.cost_model import StageModel
from planner.search.exact_search import Search
from planner.search.pipedream import pipedream_partition
from planner.formats.plan import PlanError
from planner.formats.profile import Profile

Shape = List[Tuple[int, int, int]]          # [(first layer, last layer, replicas)]


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


def seed_shapes(profile: Profile, topology, stage_sizes: Optional[Sequence[int]]) -> List[Shape]:
    """The shapes of the module docstring; two-stage plans only with both sizes allowed."""
    G, N = topology.num_devices, profile.num_layers
    shapes = []
    for r in range(1, G + 1):
        if G % r == 0 and G // r <= N:
            shapes.append([(a, b, r) for a, b in balanced_cuts(profile, G // r)])
    try:
        shapes.append(pipedream_partition(profile, topology))
    except PlanError:
        pass
    pairs = [r for r in range(1, G)
             if stage_sizes is None or (r in stage_sizes and G - r in stage_sizes)]
    for last in range(N - 1):
        for r in pairs:
            shapes.append([(0, last, r), (last + 1, N - 1, G - r)])
    return shapes


def seed_search(search: Search, micro_batches: Sequence[int]) -> None:
    """Offer every seed shape to `search` at every M of `micro_batches`."""
    shapes = seed_shapes(search.profile, search.topology, search.stage_sizes)
    # A shape with a replica count outside the plan space at M is refused by `Search.seed`;
    # checking that once per M and set of replica counts skips most of the two-stage shapes on
    # large topologies (tens of thousands) without a call each. The order is kept (ties).
    replicas = [tuple(r for _, _, r in stages) for stages in shapes]
    for M in micro_batches:
        model = StageModel(search.profile, search.topology, search.gbs, M)
        allowed = {rs: all(search.replicas_allowed(r, model.micro_batch) for r in rs)
                   for rs in set(replicas)}
        for stages, rs in zip(shapes, replicas):
            if allowed[rs]:
                search.seed(M, stages, model)
