"""The latency of one global batch from per-stage durations: DAPPLE eq. 1-3 plus the pivot's
round-trip wait (docs/cost_model.md, "Latency"). Pure arithmetic on lists of numbers; the
direct forms the tests check these against are in `tests.planner.estimate.reference_formulas`."""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

from planner.estimate.pipeline_costs import PipelineCosts


def interleave(costs: PipelineCosts) -> Tuple[List[float], List[float], List[float]]:
    """The stage list of eq. 1: computation stages with transfer stages between them
    (a transfer: F = forward send, B = backward send, AR = 0)."""
    F, B, AR = [], [], []
    for s in range(costs.num_stages):
        F.append(costs.forward_ms[s])
        B.append(costs.backward_ms[s])
        AR.append(costs.allreduce_ms[s])
        if s < costs.num_stages - 1:
            F.append(costs.send_forward_ms[s])
            B.append(costs.send_backward_ms[s])
            AR.append(0.0)
    return F, B, AR


def round_trip_phases(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int,
                      K: Sequence[int]) -> Tuple[float, float, float, int]:
    """(Tw, Ts, Te, Q) of eq. 1 with the pivot's round-trip wait: the latency we plan with.

    `F`, `B`, `AR` are the interleaved stage list (`interleave`); `K` holds K_i per computation
    stage (interleaved index q uses K[q // 2]: a transfer takes the K of the stage sending it).
    For pivot q, with R_q = sum_{s>q} (F_s + B_s), the pivot waits W_q = max(0, R_q - (K_q - 1)
    F_q) (added to Tw) and the steady period is max(F_q + B_q, (F_q + B_q + R_q) / K_q).
    Q = argmax_q L(q), ties to the later stage.

    One pass from the last stage to the first (the search values thousands of plans): Tw and
    the s <= q maximum of Te from prefix arrays, the s > q maximum and R_q accumulated on the
    way. With P[k] = sum_{a<k} B_a and x_s = AR_s - P[s], Te(q) = P[q+1] +
    max(max_{s<=q} x_s, B_q + max_{s>q} x_s)."""
    S = len(F)
    P = [0.0] * (S + 1)
    for a in range(S):
        P[a + 1] = P[a] + B[a]
    prefix, tw = [0.0] * S, [0.0] * S
    best_x, acc = -math.inf, 0.0
    for s in range(S):
        v = AR[s] - P[s]
        if v > best_x:
            best_x = v
        prefix[s] = best_x
        acc += F[s]
        tw[s] = acc
    best, best_total, suffix, trip = None, -math.inf, -math.inf, 0.0
    for q in range(S - 1, -1, -1):
        f, b = F[q], B[q]
        fb = f + b
        k = K[q >> 1]
        if k < 1:
            k = 1
        Te = P[q + 1] + max(prefix[q], b + suffix)
        wait = trip - (k - 1) * f
        period = (fb + trip) / k
        Tw = tw[q] + (wait if wait > 0.0 else 0.0)
        Ts = (M - 1) * (period if period > fb else fb)
        total = Tw + Ts + Te
        if total > best_total and (best is None or
                                   total - best_total > 1e-12 * max(1.0, abs(total))):
            best, best_total = (Tw, Ts, Te, q), total
        v = AR[q] - P[q]
        if v > suffix:
            suffix = v
        trip += fb
    return best
