"""Eq. 1-3 in their direct forms, for checking, never for planning.

The planner uses `planner.estimate.latency.round_trip_phases` (eq. 1 with the pivot's round-trip wait,
one pass). The tests and `benchmarks/simulate_table_v.py` compare it, and the simulator, with
these: eq. 1 for one pivot by direct sums (`latency_with_pivot`), for every pivot in O(S)
(`all_pivots`), eq. 1 with the argmax pivot (`phases`), eq. 1's Te as printed (`te_literal`) and
eq. 3's pivot scan as printed (`pivot_stage_eq3`). docs/cost_model.md explains the readings."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple


def pivot_stage_eq3(F: Sequence[float], B: Sequence[float], M: int) -> int:
    """Eq. 3 as printed: a greedy scan from the last stage towards stage 0."""
    S = len(F)
    Q = S - 1
    between = 0.0        # sum of F+B strictly between s and Q
    for s in range(S - 2, -1, -1):
        if (M - 1) * (F[s] + B[s]) > (M - 1) * (F[Q] + B[Q]) + between:
            Q = s
            between = 0.0
        else:
            between += F[s] + B[s]
    return Q


def latency_with_pivot(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int,
                       q: int) -> Tuple[float, float, float]:
    """(Tw, Ts, Te) of eq. 1 with pivot q, under our reading of Te, by direct sums."""
    Tw = sum(F[: q + 1])
    Ts = (M - 1) * (F[q] + B[q])
    te = -math.inf
    chain = 0.0
    for s in range(q, -1, -1):
        chain += B[s]
        te = max(te, AR[s] + chain)
    chain = 0.0
    for s in range(q + 1, len(F)):
        te = max(te, AR[s] + B[q] - chain)
        chain += B[s]
    return Tw, Ts, te


def all_pivots(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int
               ) -> List[Tuple[float, float, float]]:
    """`latency_with_pivot` for every pivot q, in O(S): with P[k] = sum_{a<k} B_a and
    x_s = AR_s - P[s], Te(q) = P[q+1] + max(max_{s<=q} x_s, B_q + max_{s>q} x_s)."""
    S = len(F)
    P = [0.0] * (S + 1)
    for a in range(S):
        P[a + 1] = P[a] + B[a]
    x = [AR[s] - P[s] for s in range(S)]
    suffix = [-math.inf] * (S + 1)
    for s in range(S - 1, -1, -1):
        suffix[s] = max(suffix[s + 1], x[s])
    out, prefix, tw = [], -math.inf, 0.0
    for q in range(S):
        prefix = max(prefix, x[q])
        tw += F[q]
        te = P[q + 1] + max(prefix, B[q] + suffix[q + 1])
        out.append((tw, (M - 1) * (F[q] + B[q]), te))
    return out


def phases(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int
           ) -> Tuple[float, float, float, int]:
    """(Tw, Ts, Te, Q) of eq. 1 without the round trip: Q = argmax_q L(q), ties to the later
    stage (eq. 3's intent; eq. 3 only moves on a strict excess)."""
    best = None
    for q, (Tw, Ts, Te) in enumerate(all_pivots(F, B, AR, M)):
        total = Tw + Ts + Te
        if best is None or total >= best[0] - 1e-12 * max(1.0, abs(total)):
            best = (total, Tw, Ts, Te, q)
    return best[1], best[2], best[3], best[4]


def te_literal(B: Sequence[float], AR: Sequence[float], Q: int) -> float:
    """Eq. 1's Te exactly as printed."""
    terms = []
    for s in range(len(B)):
        if s >= Q:
            terms.append(AR[s] - sum(B[a] for a in range(Q, s + 1)))
        else:
            terms.append(AR[s] + sum(B[a] for a in range(s, Q + 1)))
    return max(terms)
