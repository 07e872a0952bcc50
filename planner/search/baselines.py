"""Baselines the DAPPLE plan is compared with: the best data-parallel plan and the best
straight pipeline (PipeDream's plan is `planner.search.pipedream.plan_pipedream`)."""
from __future__ import annotations

from planner.estimate import cost_model as cm
from planner.search.plan_finishing import (NoPlanFits, check_global_batch, finish_plan, micro_batch_choices,
                            minimum_memory_bytes, with_memory)
from planner.formats.plan import Plan, PlanError, Stage
from planner.search.plan_space import plan_dapple
from planner.formats.profile import Profile


def best_data_parallel_plan(profile: Profile, topology, global_batch_size: int,
                            memory_limit=None, even_slices: bool = False,
                            transfers: str = "async") -> Plan:
    """Pure data parallelism on all devices (gradient accumulation over M micro-batches, then
    the allreduce), the best M; its plans' `transfers` as given."""
    check_global_batch(global_batch_size)
    topo = with_memory(topology, memory_limit)
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
        plan = Plan(stages=[Stage(layers=[0, profile.num_layers - 1], devices=list(range(G)))],
                    micro_batches=M, global_batch_size=global_batch_size, transfers=transfers)
        costs = cm.PlanCosts(plan, profile, topo)
        if costs.stages[0].max_in_flight < 1:
            continue
        est = costs.estimate()
        if best is None or est.latency_ms < best[0]:
            best = (est.latency_ms, plan)
    if best is None:
        raise NoPlanFits(f"data parallelism of {profile.name} does not fit in "
                         f"{topo.device_memory_bytes / 2**30:.2f} GiB per device even at the "
                         f"smallest allowed slice ({floor} samples a replica)",
                         minimum_memory_bytes(profile, topo, global_batch_size))
    return finish_plan(best[1], profile, topo)


def best_straight_plan(profile: Profile, topology, global_batch_size: int,
                       memory_limit=None, even_slices: bool = False,
                       transfers: str = "async") -> Plan:
    """The best pipeline without replication over all devices (one device a stage)."""
    check_global_batch(global_batch_size)
    topo = with_memory(topology, memory_limit)
    if topo.num_devices > profile.num_layers:
        raise PlanError(f"a straight pipeline over {topo.num_devices} devices needs at least "
                        f"as many layers; {profile.name} has {profile.num_layers}")
    plan = plan_dapple(profile, topo, global_batch_size, stage_sizes=[1], even_slices=even_slices,
                       plan_space="full", transfers=transfers)
    assert all(st.replicas == 1 for st in plan.stages) and plan.num_stages == topo.num_devices
    return plan
