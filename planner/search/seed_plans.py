"""Known plans offered to the exact search before it starts (`Search.seed`): a good first
incumbent prunes most of the space, and the result is never worse than any seed.

The shapes, each valued at every M tried: every uniform pipeline (G/r stages of r devices, the
layers balanced: r = G is data parallelism, r = 1 the straight pipeline), PipeDream's
partition, and every two-stage plan (each cut, each r : G - r, as the DAPPLE authors' planner
enumerates them in HPGO's `compute_bipartition`), whose best is often the optimum or close to
it (VGG-19's 15:1, AmoebaNet's 11:5)."""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageModel
from planner.search.exact_search import Search
from planner.search.pipedream import pipedream_partition, remembering_partitions
from planner.formats.plan import PlanError
from planner.formats.profile import Profile
from planner.search.scoped_memo import ScopedMemo

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


_shapes_made = ScopedMemo()     # by profile and topology, inside `remembering_shapes`


@contextlib.contextmanager
def remembering_shapes():
    """Within it, the seed shapes of a profile on a topology are made once: `plan_dapple` runs
    two or three searches of one profile on one topology, each seeded with them (they depend
    on the profile and the topology only; the same lists, so the same seeds in the same
    order); and PipeDream's partition (`pipedream.remembering_partitions`), which a report's
    PipeDream baseline plans from too."""
    with _shapes_made.scope(), remembering_partitions():
        yield


def _shapes(profile: Profile, topology, stage_sizes: Optional[Sequence[int]]
            ) -> Tuple[List[Shape], List[int]]:
    """(the uniform pipelines of a replica count in `stage_sizes` (None: any) and PipeDream's
    partition, the first stage's replica counts r of the two-stage shapes r : G - r). A
    uniform pipeline of another replica count is not in the search's space (`Search.seed`
    refuses it uncounted), so it is not made: the straight search makes only its own."""
    G, N = topology.num_devices, profile.num_layers
    made = _shapes_made.get(profile, (topology,))
    if made is None:
        made = {}           # replicas -> uniform pipeline; "partition" -> [PipeDream's] or []
        _shapes_made.put(profile, (topology,), made)
    shapes = []
    for r in range(1, G + 1):
        if G % r == 0 and G // r <= N and (stage_sizes is None or r in stage_sizes):
            if r not in made:
                made[r] = [(a, b, r) for a, b in balanced_cuts(profile, G // r)]
            shapes.append(made[r])
    if "partition" not in made:
        try:
            made["partition"] = [pipedream_partition(profile, topology)]
        except PlanError:
            made["partition"] = []
    shapes += made["partition"]
    pairs = [r for r in range(1, G)
             if stage_sizes is None or (r in stage_sizes and G - r in stage_sizes)]
    return shapes, pairs


def seed_shapes(profile: Profile, topology, stage_sizes: Optional[Sequence[int]]) -> List[Shape]:
    """The shapes of the module docstring, in the order offered; two-stage plans only with
    both sizes allowed, each cut in turn with every r : G - r."""
    shapes, pairs = _shapes(profile, topology, stage_sizes)
    G, N = topology.num_devices, profile.num_layers
    return shapes + [[(0, last, r), (last + 1, N - 1, G - r)]
                     for last in range(N - 1) for r in pairs]


def seed_search(search: Search, micro_batches: Sequence[int]) -> None:
    """Offer every seed shape to `search` at every M of `micro_batches`, in `seed_shapes`'
    order: as `Search.seed` would one at a time, the two-stage ones all at once
    (`TwoStageSeeds`)."""
    shapes, pairs = _shapes(search.profile, search.topology, search.stage_sizes)
    two_stage = TwoStageSeeds(search, pairs)
    # A shape with a replica count outside the plan space at M is refused by `Search.seed`;
    # checking that once per M and set of replica counts saves a call each. The order is kept
    # (ties).
    replicas = [tuple(r for _, _, r in stages) for stages in shapes]
    for M in micro_batches:
        model = StageModel(search.profile, search.topology, search.gbs, M, search.transfers)
        allowed = {rs: all(search.replicas_allowed(r, model.micro_batch) for r in rs)
                   for rs in set(replicas)}
        for stages, rs in zip(shapes, replicas):
            if allowed[rs]:
                search.seed(M, stages, model)
        two_stage.seed(M, model)


class TwoStageSeeds:
    """`Search.seed` of every two-stage shape [(0, last, r), (last + 1, N - 1, G - r)] at one
    M, cut by cut, as numpy arrays over (cut, r): on 128 x 8 there are 6,600 shapes per M. The
    same tests (replicas allowed, each stage fits: `StageModel.max_in_flight` >= 1) and the
    same stage bound, each a sum of the same numbers in the same order (IEEE arithmetic, so
    the same floats), count the seeds; only those whose bound does not exceed the incumbent
    are valued (`Search.value_seed`), in the shapes' order."""

    def __init__(self, search: Search, pairs: Sequence[int]):
        self.search, profile, N, G = search, search.profile, search.N, search.G
        self.pairs = list(pairs)
        self.usable = bool(self.pairs) and N > 1 and search.stage_limit >= 2 \
            and "append" in search.policies
        if not self.usable:
            return
        head = [(0, last) for last in range(N - 1)]
        tail = [(last + 1, N - 1) for last in range(N - 1)]
        self.stages = []            # per stage: (F, B, parameters, outputs) per cut, r, counts
        used = (0,) * len(search.capacity)
        first_counts = [search._place("append", used, r) for r in self.pairs]
        second_counts = [search._place("append", c, G - r)
                         for c, r in zip(first_counts, self.pairs)]
        for ranges, replicas, counts in ((head, self.pairs, first_counts),
                                         (tail, [G - r for r in self.pairs], second_counts)):
            per_cut = np.array([(profile.forward_ms(a, b), profile.backward_ms(a, b),
                                 profile.parameter_bytes(a, b), profile.output_bytes(a, b))
                                for a, b in ranges], dtype=np.float64)
            self.stages.append((per_cut, replicas, counts))

    def seed(self, M: int, model: StageModel) -> None:
        search = self.search
        if not self.usable or search.gbs % M:
            return
        mb, memory = model.micro_batch, search.topology.device_memory_bytes
        allowed = np.array([search.replicas_allowed(r, mb) and
                            search.replicas_allowed(search.G - r, mb) for r in self.pairs])
        fits, forwards, stage_bound, times = allowed[None, :], None, 0.0, []
        for per_cut, replicas, counts in self.stages:
            F, B, parameters, outputs = (per_cut[:, k:k + 1] for k in range(4))
            scale = np.array([model.time_scale(r) for r in replicas])[None, :]
            size = np.array([model.slice_size(r) for r in replicas], dtype=np.float64)[None, :]
            # StageModel.max_in_flight(first, last, r) >= 1: the activations fit
            free = memory - (cm.BYTES_PER_PARAMETER_FACTOR * parameters
                             + cm.DEVICE_RESERVED_BYTES)
            fits = fits & ~(free < cm.ACTIVATION_MEMORY_FACTOR * outputs * size / model.pbs)
            F = F * scale + cm.TASK_OVERHEAD_MS                 # StageModel.forward_ms
            B = B * scale + cm.TASK_OVERHEAD_MS
            rates = [model.allreduce_rate(c) for c in counts]    # exposed_allreduce_ms
            per_byte = np.array([p for p, _ in rates])[None, :]
            fixed = np.array([f for _, f in rates])[None, :]
            AR = np.where((np.array(replicas) > 1)[None, :] & (parameters > 0),
                          per_byte * parameters + fixed, 0.0)
            forwards = F if forwards is None else forwards + F
            stage_bound = np.maximum(stage_bound, forwards + (M - 1) * (F + B) + AR + B)
        search.stats.seeds += int(np.count_nonzero(fits))
        candidates = fits & ~(stage_bound > search.best_value * (1 + 1e-9))
        (_, _, first), (_, _, second) = self.stages
        N, R = search.N, len(self.pairs)
        for i in np.flatnonzero(candidates).tolist():
            last, j = divmod(i, R)
            search.value_seed(M, [(0, last, first[j]), (last + 1, N - 1, second[j])], model,
                              float(stage_bound[last, j]))
