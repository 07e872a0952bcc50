"""The exact search's round-trip bound (`planner.search.exact_search`): a lower bound of the latency we
plan with (`latency.round_trip_phases`) of every completion of a partial plan, from the pivot
terms of its known stages.

For a known stage q, Tw up to q and the s <= q terms of Te are final; the trip R_q only grows
as stages are added (by at least `trip_rest`, the remaining work spread over the free
devices); K_q is at most min(M, policy B's depth with the most stages still possible, the
memory caps D of stages 0..q). The wait and the steady period fall as K grows and rise with R,
so those values give a lower bound of the final L(q), and the latency is the maximum over q.

The search keeps, for the stages on its path, their prefix terms (a "trail", `trail_entry`),
so a bound costs the new stage's terms and one pass back over the path. An entry also holds its
stage's K bound and (K - 1) F for one count of stages the search names (`usual_stages`, the most
a straight pipeline has), so that where the plan may have that many stages the pass does not
recompute them."""
from __future__ import annotations

import math
from typing import List, Tuple

_INF = math.inf


def trail_entry(trail: List[tuple], cost, M: int, usual_stages: int = 0) -> tuple:
    """The prefix terms of a stage (a `cost_model.StageCost`) appended to a path whose stages
    have `trail`: (Tw up to it, the s <= q chain of Te, the least memory cap so far (K bound),
    F, F + B, what it adds to an earlier stage's round trip, and for plans of at most
    `usual_stages` stages its K bound and (K - 1) F)."""
    tf, tb, F, B, AR, cap = cost                           # StageCost fields
    if trail:
        acc_f, chain, runmin = trail[-1][0], trail[-1][1], trail[-1][2]
        x = chain + tb
        chain = tb if tb > x else x                 # max(chain + tb, tb)
    else:
        acc_f, chain, runmin = 0.0, -_INF, M
    acc_f += tf + F
    x, y = chain + B, AR + B
    chain = y if y > x else x
    if cap < 1:
        cap = 1
    if cap < runmin:
        runmin = cap
    fb = F + B
    kr = 2 * (usual_stages - len(trail)) - 1
    k = runmin if runmin < kr else kr
    return (acc_f, chain, runmin, F, fb, fb + tf + tb, k, (k - 1) * F)


def round_trip_bound(trail: List[tuple], new_stage, M: int, more_stages: int,
                     trip_rest: float, stop_at: float = _INF,
                     usual_stages: int = 0) -> Tuple[float, tuple]:
    """(The bound for the path of `trail` plus `new_stage` with at most `more_stages` stages
    after it, the new stage's trail entry). The search calls it for most candidates, so
    `trail_entry` is written out here (the same arithmetic). The pass back over the path
    stops at the first stage whose term reaches `stop_at` (the bound returned is then that
    term, not above the bound, and at least `stop_at`: the search prunes the candidate
    either way). The trail's entries are `trail_entry`s of the same `usual_stages`."""
    n = len(trail)
    max_stages = n + 1 + more_stages
    tf, tb, F, B, AR, cap = new_stage                       # StageCost fields
    if n:
        acc_f, chain, runmin = trail[-1][0], trail[-1][1], trail[-1][2]
        x = chain + tb
        chain = tb if tb > x else x
    else:
        acc_f, chain, runmin = 0.0, -_INF, M
    acc_f += tf + F
    x, y = chain + B, AR + B
    chain = y if y > x else x
    if cap < 1:
        cap = 1
    if cap < runmin:
        runmin = cap
    fb = F + B
    link = fb + tf + tb
    kr = 2 * (usual_stages - n) - 1
    k = runmin if runmin < kr else kr
    entry = (acc_f, chain, runmin, F, fb, link, k, (k - 1) * F)
    M1 = M - 1
    # k = min(2 (max_stages - i) - 1, runmin) for stage i: both at least 1 (M >= 1, caps
    # raised to 1, more_stages >= 0)
    kr = 2 * (max_stages - n) - 1
    k = runmin if runmin < kr else kr
    trip = trip_rest
    wait = trip - (k - 1) * F
    period = (fb + trip) / k
    best = acc_f + (wait if wait > 0.0 else 0.0) + \
        M1 * (period if period > fb else fb) + chain
    if best >= stop_at:
        return best, entry
    trip += link
    if max_stages == usual_stages:
        # the same pass with each stage's k and (k - 1) F from its entry
        for tw_i, te_i, _, _, fb, link, k, kF in reversed(trail):
            wait = trip - kF
            period = (fb + trip) / k
            value = tw_i + (wait if wait > 0.0 else 0.0) + \
                M1 * (period if period > fb else fb) + te_i
            if value > best:
                best = value
                if best >= stop_at:
                    return best, entry
            trip += link
        return best, entry
    for tw_i, te_i, runmin, F, fb, link, _, _ in reversed(trail):
        kr += 2
        k = runmin if runmin < kr else kr
        wait = trip - (k - 1) * F
        period = (fb + trip) / k
        value = tw_i + (wait if wait > 0.0 else 0.0) + \
            M1 * (period if period > fb else fb) + te_i
        if value > best:
            best = value
            if best >= stop_at:
                return best, entry
        trip += link
    return best, entry
