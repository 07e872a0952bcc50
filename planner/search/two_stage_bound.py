"""A lower bound of every plan of at most two stages (data parallelism and every r : G - r, any
cut, any placement), cheap enough to decide, once the straight pipeline's plan is known,
whether the two-stage search can find anything at least as fast (`plan_space.plan_dapple`).

Eq. 1 of such a plan (the search's summary V, which the latency we plan with never goes below;
`exact_search._extend`) is at least, with F, B each stage's forward and backward at its slice
(the layers' time plus the task overhead) and AR its exposed allreduce:

* one stage: F + (M - 1)(F + B) + AR + B;
* two stages, its first term F0 + (M - 1)(F0 + B0) + AR0 + B0 and its last
  F0 + F1 + (M - 1)(F1 + B1) + B1 + max(AR0 + B0, AR1): the transfer between them only adds
  (its forward to the forwards, its backward to the chain the first stage's allreduce waits
  behind).

F and B depend on the cut and r only. AR depends on the placement through the hosts' counts:
a hierarchical ring over k hosts with at most n replicas on one costs
2 (n - 1)/n per byte over NVLink plus 2 (k - 1)/k over the network (and their latencies), both
growing with n and k, and r replicas on k hosts put at least ceil(r / k) on one; so the least
over the host counts k that can hold r of that cost is below every placement's. On a
TensorFlow cluster every replica gets the sums on its own device (`StageModel.allreduce_rate`),
which costs less on uneven placements (4 replicas as 3 + 1 on 2 hosts: 1.5 gradients into a
host, as 2 + 2: 2): there, r replicas on one host cost 2 (r - 1) / r per byte in-host and on
k >= 2 hosts at least 2 (r - 1) / r over the network (a host with c of them receives
2 c (r - c) / r, and c (r - c) >= r - 1), each with its latency once. Memory is left out (a
bound over more plans is still a bound). The least over every M, cut and r allowed
(`exact_search.slices_allowed`) bounds every plan the two-stage search can return.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageModel
from planner.formats.profile import Profile
from planner.search.exact_search import slices_allowed

# Relative slack on a comparison with it: its sums and the search's are rounded differently
# (a few ulps); a plan within this of the bound is not ruled out.
SLACK = 1e-9


def _allreduce_rates(model: StageModel, capacity: Sequence[int], replicas: int
                     ) -> List[Tuple[float, float]]:
    """(ms per byte, fixed ms) of the cheapest ring (replica sums) on each number of hosts
    that can hold `replicas` devices; the exposed allreduce of any placement is at least the least
    of per_byte * bytes + fixed over them."""
    largest = sorted(capacity, reverse=True)
    if model.exchange:
        share = 2 * (replicas - 1) / replicas
        rates = []
        if replicas <= largest[0]:
            rates.append((share / model.intra_bw, model.intra_lat))
        if len(largest) > 1 and replicas > 1:
            rates.append((share / model.inter_bw, model.inter_lat))
        return rates
    rates = []
    for hosts in range(1, min(len(largest), replicas) + 1):
        on_one = -(-replicas // hosts)
        if sum(largest[:hosts]) < replicas or on_one > largest[0]:
            continue
        rates.append(model._allreduce_rate([on_one] * hosts))   # the cost model's own rule
    return rates


def _allreduce_floor(rates: List[Tuple[float, float]], replicas: int,
                     parameters: np.ndarray) -> np.ndarray:
    """The least exposed allreduce of a stage of `replicas` holding `parameters` bytes."""
    if replicas <= 1 or not rates:
        return np.zeros_like(parameters)
    least = np.min([per_byte * parameters + fixed for per_byte, fixed in rates], axis=0)
    return np.where(parameters > 0, least, 0.0)


def two_stage_floor(profile: Profile, topology, global_batch_size: int,
                    micro_batches: Sequence[int], min_slice: int, even_slices: bool,
                    transfers: str = "async") -> float:
    """No plan of at most two stages of `profile` on `topology` at any of `micro_batches`, with
    every replica's slice allowed (`min_slice`, `even_slices`) and `transfers`, has a planned
    latency below this (math.inf when there is none)."""
    N, G = profile.num_layers, topology.num_devices
    ms = [M for M in micro_batches if global_batch_size % M == 0]
    if not ms:
        return math.inf
    capacity = tuple(topology.devices_per_host)
    forward = np.array([profile.forward_ms(0, k) for k in range(N)])
    backward = np.array([profile.backward_ms(0, k) for k in range(N)])
    overhead = cm.TASK_OVERHEAD_MS
    # The allreduce does not depend on M (the bandwidths and latencies are the topology's).
    any_model = StageModel(profile, topology, global_batch_size, ms[0], transfers)
    rates = {r: _allreduce_rates(any_model, capacity, r) for r in range(1, G + 1)}
    everything = _allreduce_floor(rates[G], G, np.array([profile.parameter_bytes(0, N - 1)]))[0]
    # Two stages: rows are the cuts after layer k = 0 .. N - 2 (the first stage 0..k, the
    # second k + 1..N - 1), columns the first stage's replicas r = 1 .. G - 1.
    firsts = np.arange(1, G)
    head = forward[:-1, None], backward[:-1, None]
    tail = (forward[-1] - forward[:-1])[:, None], (backward[-1] - backward[:-1])[:, None]
    head_bytes = np.array([profile.parameter_bytes(0, k) for k in range(N - 1)])
    tail_bytes = np.array([profile.parameter_bytes(k + 1, N - 1) for k in range(N - 1)])
    AR0 = np.stack([_allreduce_floor(rates[r], r, head_bytes) for r in firsts], axis=1) \
        if N > 1 and G > 1 else None
    AR1 = np.stack([_allreduce_floor(rates[G - r], G - r, tail_bytes) for r in firsts], axis=1) \
        if N > 1 and G > 1 else None
    best = math.inf
    for M in ms:
        model = StageModel(profile, topology, global_batch_size, M, transfers)
        mb = model.micro_batch
        if slices_allowed(G, mb, min_slice, even_slices):       # data parallelism
            scale = model.time_scale(G)
            F, B = forward[-1] * scale + overhead, backward[-1] * scale + overhead
            best = min(best, float(F + (M - 1) * (F + B) + everything + B))
        if AR0 is None:
            continue
        allowed = np.array([slices_allowed(r, mb, min_slice, even_slices)
                            and slices_allowed(G - r, mb, min_slice, even_slices)
                            for r in firsts])
        if not allowed.any():
            continue
        first = np.array([model.time_scale(r) for r in firsts])[None, :]
        second = np.array([model.time_scale(G - r) for r in firsts])[None, :]
        F0, B0 = head[0] * first + overhead, head[1] * first + overhead
        F1, B1 = tail[0] * second + overhead, tail[1] * second + overhead
        terms = np.maximum(F0 + (M - 1) * (F0 + B0) + AR0 + B0,
                           F0 + F1 + (M - 1) * (F1 + B1) + B1 + np.maximum(AR0 + B0, AR1))
        best = min(best, float(terms[:, allowed].min()))
    return best
