"""The cost model's formula (DAPPLE eq. 1-3) against the simulator, on the planner's own plans
for the 15 cells of the paper's Table V (5 models x configs A, B, C, 16 devices).

    .venv/bin/python benchmarks/simulate_table_v.py [--markdown] [--models=bert,xlnet]
                                                    [--plan_space=paper|full]

For every cell: plan with `planner.search.plan_space.plan_dapple`, take the formula's latency from the
plan's estimate, simulate the same plan with the same `PipelineCosts`
(`planner.estimate.cost_model.pipeline_costs`), and print both and their ratio. The target is agreement
within 10% on every cell; docs/simulator.md explains cells beyond 5%. Also prints the
simulator's bubble fraction and the pivot stage, which show where the formula's assumption
(no bubbles inside the pivot stage) breaks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.tables import print_table  # noqa: E402
from planner.estimate.cost_model import pipeline_costs  # noqa: E402
from planner.formats.profile_readers import load_profile  # noqa: E402
from planner.search.plan_space import plan_dapple  # noqa: E402
from planner.estimate.simulator import simulate_plan  # noqa: E402
from topology.parse import parse_topology  # noqa: E402

PROFILES = os.environ.get("DAPPLE_PROFILES", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "profiles"))
# Model, profile file, Table V global batch size (profiles/README.md).
TABLE_V = [
    ("VGG-19", "dapple/vgg-19-pbs-32.txt", 2048),
    ("GNMT-16", "dapple/gnmt-16-pbs-64.txt", 1024),
    ("BERT-48", "dapple/bert-48-pbs-2.txt", 64),
    ("XLNet-36", "dapple/xlnet-36-pbs-1.txt", 128),
    ("AmoebaNet-36", "dapple/amoeba-36-pbs-1.txt", 128),
]
CONFIGS = ("A", "B", "C")


def stage_split(plan) -> str:
    """Layers per stage, like Table V's split column ('13:6')."""
    return ":".join(str(st.num_layers) for st in plan.stages)


def pivot_inner_idle_ms(plan, result) -> float:
    """What eq. 1 leaves out: idle time of the pivot stage between its first forward and its
    last backward (eq. 1 assumes the pivot, once started, never waits). It comes from the
    pivot waiting for a micro-batch's round trip through the later stages (a warm-up depth
    K_q too small to cover it, e.g. capped by memory, or few micro-batches), or from earlier
    stages that cannot feed it."""
    q = plan.estimate.pivot_stage
    compute = [e for e in result.stage_events(q) if e.kind in ("forward", "backward")]
    span = max(e.end_ms for e in compute) - min(e.start_ms for e in compute)
    return max(0.0, span - sum(e.duration_ms for e in compute))   # no "-0.0" from rounding


def with_round_trip_ms(costs, M, warmup) -> float:
    """A proposal, not the planner's model: eq. 1 with the pivot's round-trip wait, where
    only the micro-batches beyond the warm-up depth pay the loop bound.

    After its K_q warm-up forwards, pivot q needs the gradient of its first micro-batch, which
    returns after R_q = the F+B of every stage and transfer after q; the pivot waits
    W_q = max(0, R_q - (K_q - 1) F_q). The first K_q micro-batches are then in hand (K_q - 1
    more periods of F_q + B_q); each later one must go round the loop, so with K_q in flight
    the period is max(F_q + B_q, (F_q + B_q + R_q) / K_q) for the remaining M - K_q.
    L = max over q of Tw + W_q + (K_q - 1)(F_q + B_q) + (M - K_q) loop + Te (the planner's Te).
    With K_q = 1 (VGG-19 capped by memory) every micro-batch pays the loop; with K_q = M none
    does (charging both the wait and M - 1 loops counts the round trip twice)."""
    from planner.estimate.latency import interleave
    from tests.planner.estimate.reference_formulas import latency_with_pivot
    F, B, AR = interleave(costs)
    best = 0.0
    for q in range(len(F)):
        K = min(warmup[q // 2], M)
        trip = sum(F[j] + B[j] for j in range(q + 1, len(F)))
        wait = max(0.0, trip - (K - 1) * F[q])
        loop = max(F[q] + B[q], (F[q] + B[q] + trip) / K)
        Tw, _, Te = latency_with_pivot(F, B, AR, M, q)
        best = max(best, Tw + wait + (K - 1) * (F[q] + B[q]) + (M - K) * loop + Te)
    return best


def rows(models=None, progress=None, plan_space="paper"):
    out = []
    for name, path, gbs in TABLE_V:
        if models and not any(m.lower() in name.lower() for m in models):
            continue
        profile = load_profile(os.path.join(PROFILES, path))
        for config in CONFIGS:
            topology = parse_topology(config)
            started = time.time()
            plan = plan_dapple(profile, topology, gbs, plan_space=plan_space)
            planned_s = time.time() - started
            costs = pipeline_costs(plan, profile, topology)
            started = time.time()
            half = simulate_plan(plan, costs, link_duplex="half")
            full = simulate_plan(plan, costs, link_duplex="full")
            simulated_s = time.time() - started
            formula = plan.estimate.latency_ms
            out.append({
                "model": name, "config": config, "gbs": gbs, "shape": plan.shape(),
                "split": stage_split(plan), "M": plan.micro_batches,
                "schedule": plan.schedule.name, "pivot": plan.estimate.pivot_stage,
                "formula_ms": formula, "simulated_ms": full.iteration_ms,
                "ratio": full.iteration_ms / formula,
                "half_duplex_ratio": half.iteration_ms / formula,
                "bubble": full.bubble_fraction, "K": plan.warmup_depths(),
                "pivot_idle_ms": pivot_inner_idle_ms(plan, full),
                "round_trip_ratio": full.iteration_ms / with_round_trip_ms(
                    costs, plan.micro_batches, plan.warmup_depths()), "plan_s": planned_s, "sim_s": simulated_s,
                "plan": plan, "result": full, "costs": costs,
            })
            if progress:
                progress(out[-1])
    return out


HEADER = ["model (GBS)", "config", "plan", "split", "M", "sched (K)", "pivot", "formula ms",
          "simulated ms", "sim/formula", "half-duplex", "bubbles", "pivot idle ms", "sim/proposal"]


def cells(r):
    return [f"{r['model']} ({r['gbs']})", r["config"], r["shape"], r["split"], str(r["M"]),
            f"{r['schedule']} {r['K']}", str(r["pivot"]), f"{r['formula_ms']:.1f}", f"{r['simulated_ms']:.1f}",
            f"{r['ratio']:.3f}", f"{r['half_duplex_ratio']:.3f}", f"{100 * r['bubble']:.1f}%",
            f"{r['pivot_idle_ms']:.1f}", f"{r['round_trip_ratio']:.3f}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--models", default="", help="comma-separated model name filter")
    parser.add_argument("--plan_space", default="paper", choices=["paper", "full"],
                        help="the planner's plan space (planner/search/plan_space.py)")
    args = parser.parse_args()
    table = rows([m for m in args.models.split(",") if m], plan_space=args.plan_space,
                 progress=lambda r: print("  ".join(cells(r)) + f"  (planned in "
                                          f"{r['plan_s']:.1f} s)", file=sys.stderr, flush=True))
    print_table(HEADER, [cells(r) for r in table], args.markdown)
    worst = max(table, key=lambda r: abs(r["ratio"] - 1))

    def beyond(limit):
        return [f"{r['model']}/{r['config']}" for r in table if abs(r["ratio"] - 1) > limit]

    print(f"\nworst cell: {worst['model']} config {worst['config']}, simulated / formula = "
          f"{worst['ratio']:.3f}; cells beyond 5%: {beyond(0.05) or 'none'}; "
          f"beyond 10%: {beyond(0.10) or 'none'}")
    print(f"planning {sum(r['plan_s'] for r in table):.1f} s, simulating "
          f"{sum(r['sim_s'] for r in table):.1f} s in all")


if __name__ == "__main__":
    main()
