"""Finishing a plan, and the limits every planner shares: which micro-batch counts exist, the
memory a topology must offer, the warm-up depths and estimate a plan carries."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from planner.estimate.cost_model import PlanCosts, StageModel
from planner.formats.plan import Plan, PlanError
from planner.formats.profile import Profile


class NoPlanFits(PlanError):
    """No plan fits in device memory; `min_memory_bytes` is the least memory that would."""

    def __init__(self, message: str, min_memory_bytes: float):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


def micro_batch_choices(global_batch_size: int) -> List[int]:
    """Every M that divides the global batch into equal micro-batches."""
    return [m for m in range(1, global_batch_size + 1) if global_batch_size % m == 0]


def finish_plan(plan: Plan, profile: Profile, topology, keep_warmup: bool = False,
                costs: Optional[PlanCosts] = None) -> Plan:
    """Fill the derived fields: an early-backward, zb-h1, pipedream or 2bw plan's K_i (policy A
    or B by the ACR, capped by memory; kept when `keep_warmup` and the plan has them; "A" and
    "B" become "1f1b"), estimate, topology, profile, layer names. Other schedules keep their
    own warm-up. The plan is validated and costed once (`costs`: this plan's, when the caller
    has them)."""
    costs = costs or PlanCosts(plan, profile, topology)
    settle_warmup(plan, costs, keep_warmup)
    plan.estimate = costs.estimate()
    plan.topology = topology.to_dict()
    plan.profile = profile.summary()
    if not plan.stages[0].layer_names:
        for st in plan.stages:
            st.layer_names = profile.layer_names[st.first:st.last + 1]
    return plan


def settle_warmup(plan: Plan, costs: PlanCosts, keep_warmup: bool = False) -> None:
    """`finish_plan`'s first step, alone: an early-backward, zb-h1, pipedream or 2bw plan's
    K_i (kept when `keep_warmup` and the plan has them; "A" and "B" become "1f1b")."""
    if plan.schedule.planner_warmup and (not keep_warmup or plan.warmup is None):
        plan.warmup = costs.warmup()[1]
        plan.schedule = plan.schedule.canonical


def with_memory(topology, memory_limit):
    """`topology` with its device memory replaced by `memory_limit` (bytes or '16GB'), if
    given."""
    if memory_limit is None:
        return topology
    if isinstance(memory_limit, str):
        from topology.units import parse_memory
        memory_limit = parse_memory(memory_limit)
    return dataclasses.replace(topology, device_memory_bytes=float(memory_limit))


def check_global_batch(gbs: int) -> None:
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
    best = [[math.inf] * (N + 1) for _ in range(S + 1)]
    best[0][N] = 0.0
    for k in range(1, S + 1):
        for i in range(N - 1, -1, -1):
            v = math.inf
            for e in range(i, N):
                if best[k - 1][e + 1] == math.inf:
                    continue
                v = min(v, max(need(i, e), best[k - 1][e + 1]))
            best[k][i] = v
    return min(best[k][0] for k in range(1, S + 1))
