"""Cutting a plan's layers into the chunks of an interleaved schedule.

The search (`planner.search.plan_space`) chooses device groups, their replicas and the micro-batch
count under early backward. Interleaving keeps all of that and re-cuts the layers into S v
contiguous chunks, chunk c on group c % S, so that the slowest chunk (forward + backward of one
micro-batch slice on its group, the cost model's times) is as fast as possible: a dynamic
program over the cut positions. Transfers are left out of the balance (they depend on where
the cut falls, and a chunk boundary's transfer overlaps the other chunks' compute).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageModel
from planner.formats.plan import Plan, PlanError, Stage
from planner.formats.profile import Profile
from planner.schedules.interleaved import INTERLEAVED


def balanced_cuts(chunk_ms, num_layers: int, num_chunks: int,
                  chunk_table=None) -> List[Tuple[int, int]]:
    """[first, last] of each chunk minimising the largest `chunk_ms(chunk, first, last)`.

    `chunk_table(chunk)`, if given, is every `chunk_ms(chunk, first, last)` at once, an N x N
    array indexed [first, last] (used where last >= first): the same program over numpy rows,
    the same cuts (`min` of each row at its first occurrence, as the loop's strict `<` keeps
    the first least value; the maximum of two floats is the same float either way)."""
    if num_layers < num_chunks:
        raise PlanError(f"{num_chunks} chunks need at least {num_chunks} layers; the model has "
                        f"{num_layers}")
    if chunk_table is not None:
        return _balanced_cuts_numpy(chunk_table, num_layers, num_chunks)
    N, C = num_layers, num_chunks
    # best[c][i]: the least possible slowest chunk when chunks c.. cover layers i..N-1.
    best = [[math.inf] * (N + 1) for _ in range(C + 1)]
    cut = [[-1] * (N + 1) for _ in range(C + 1)]
    best[C][N] = 0.0
    for c in range(C - 1, -1, -1):
        for i in range(c, N - (C - c) + 1):        # leave a layer for every later chunk
            for e in range(i, N - (C - c - 1)):
                value = max(chunk_ms(c, i, e), best[c + 1][e + 1])
                if value < best[c][i]:
                    best[c][i], cut[c][i] = value, e
    out, i = [], 0
    for c in range(C):
        out.append((i, cut[c][i]))
        i = cut[c][i] + 1
    return out


def _balanced_cuts_numpy(chunk_table, N: int, C: int) -> List[Tuple[int, int]]:
    """`balanced_cuts`' program, each chunk's rows at once."""
    later = np.full(N + 1, math.inf)            # best[c + 1][.]
    later[N] = 0.0
    cuts = []
    below = np.tril(np.ones((N, N), dtype=bool), -1)     # last < first
    for c in range(C - 1, -1, -1):
        lo, hi = c, N - (C - c)                 # first in lo..hi, last in first..N-(C-c-1)-1
        values = np.maximum(chunk_table(c), later[None, 1:])
        values[below] = math.inf
        values[:, N - (C - c - 1):] = math.inf
        e = np.argmin(values, axis=1)
        least = values[np.arange(N), e]
        best = np.full(N + 1, math.inf)
        cut = np.full(N + 1, -1)
        rows = np.arange(lo, hi + 1)
        found = rows[least[rows] < math.inf]
        best[found], cut[found] = least[found], e[found]
        later = best
        cuts.append(cut)
    cuts.reverse()
    out, i = [], 0
    for c in range(C):
        out.append((i, int(cuts[c][i])))
        i = int(cuts[c][i]) + 1
    return out


def interleave_plan(plan: Plan, profile: Profile, topology, virtual_stages: int) -> Plan:
    """`plan`'s device groups and micro-batches with `virtual_stages` chunks per group, under
    the interleaved schedule (estimate and the other derived fields not yet filled: see
    `planner.search.plan_finishing.finish_plan`)."""
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PlanError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if plan.global_batch_size is None:
        raise PlanError("the plan has no global_batch_size; the cost model needs it to cut "
                        "chunks")
    groups = plan.stages[:plan.num_positions]
    S, v = len(groups), virtual_stages
    model = StageModel(profile, topology, plan.global_batch_size, plan.micro_batches)

    def chunk_ms(c: int, first: int, last: int) -> float:
        replicas = groups[c % S].replicas
        return model.forward_ms(first, last, replicas) + model.backward_ms(first, last, replicas)

    tables = {}

    def chunk_table(c: int) -> np.ndarray:
        """chunk_ms(c, first, last) for every [first, last]: `StageModel.forward_ms` and
        `backward_ms`, the same operations on the profile's prefix sums, elementwise."""
        replicas = groups[c % S].replicas
        if replicas not in tables:
            F, B = (np.array([0.0] + [f(0, k) for k in range(profile.num_layers)])
                    for f in (profile.forward_ms, profile.backward_ms))
            scale = model.time_scale(replicas)
            tables[replicas] = \
                ((F[None, 1:] - F[:-1, None]) * scale + cm.TASK_OVERHEAD_MS) + \
                ((B[None, 1:] - B[:-1, None]) * scale + cm.TASK_OVERHEAD_MS)
        return tables[replicas]

    try:
        cuts = balanced_cuts(chunk_ms, profile.num_layers, S * v, chunk_table)
    except PlanError as e:
        raise PlanError(f"interleaving {S} device group(s) with virtual_stages = {v}: {e}") \
            from None
    stages = [Stage(layers=[first, last], devices=list(groups[c % S].devices),
                    layer_names=profile.layer_names[first:last + 1])
              for c, (first, last) in enumerate(cuts)]
    return Plan(stages=stages, micro_batches=plan.micro_batches,
                global_batch_size=plan.global_batch_size, schedule=INTERLEAVED,
                virtual_stages=v, recompute=plan.recompute, transfers=plan.transfers)


def interleaved_plan(boundaries: Sequence[int], num_layers: int, micro_batches: int,
                     virtual_stages: int, global_batch_size: Optional[int] = None,
                     replicas: Optional[Sequence[int]] = None) -> Plan:
    """An interleaved plan from cut positions, for tests and hand-made plans: `boundaries` are
    the first layers of chunks 1..C-1 (C = S v chunks), chunk c runs on device group c % S,
    and group s has `replicas[s]` devices (default 1), numbered consecutively."""
    C, v = len(boundaries) + 1, virtual_stages
    if v < 1 or C % v:
        raise PlanError(f"{C} chunks cannot be spread over device groups holding "
                        f"virtual_stages = {v} chunks each: give S x {v} chunks")
    S = C // v
    replicas = list(replicas) if replicas is not None else [1] * S
    if len(replicas) != S:
        raise PlanError(f"{len(replicas)} replica counts for {S} device groups")
    groups, next_device = [], 0
    for r in replicas:
        groups.append(list(range(next_device, next_device + r)))
        next_device += r
    starts = [0] + list(boundaries)
    ends = [b - 1 for b in boundaries] + [num_layers - 1]
    stages = [Stage(layers=[first, last], devices=list(groups[c % S]))
              for c, (first, last) in enumerate(zip(starts, ends))]
    return Plan(stages=stages, micro_batches=micro_batches, global_batch_size=global_batch_size,
                schedule=INTERLEAVED, virtual_stages=v).validate(num_layers=num_layers)
