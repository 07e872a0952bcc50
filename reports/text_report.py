"""The text (markdown) strategy report: what the plan is, where its time goes, and why it beat
the alternatives `reports.comparison` planned, their estimates side by side under the same
cost model."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from planner.formats.plan import Plan
from planner.search.schedule_choice import ScheduleOption
from reports.comparison import Alternative
from topology.units import format_bytes

RELAXED_CAPTION = ("Relaxed schedules on the same plan, opt-in: their weights are stale or "
                   "averaged, so `--schedule=auto` never takes one; the dapple runtime runs "
                   "them when a plan names one")


def _devices_by_host(plan_stage, topology) -> str:
    parts = []
    for host, devs in topology.devices_by_host(plan_stage.devices).items():
        span = f"{devs[0]}-{devs[-1]}" if len(devs) > 1 and devs == list(
            range(devs[0], devs[-1] + 1)) else ",".join(map(str, devs))
        parts.append(f"h{host}:[{span}]")
    return " ".join(parts)


def schedule_name(plan: Plan) -> str:
    if plan.virtual_stages:
        return f"{plan.schedule} (v = {plan.virtual_stages})"
    if plan.batches:
        parts = [f"{plan.batches} batches"]
        if plan.advance is not None:
            parts = [f"{plan.stages[0].replicas} pipeline(s)", f"advance {plan.advance}"] + parts
        if plan.vertical_sync:
            parts.append("vertical sync")
        return f"{plan.schedule} ({', '.join(parts)})"
    return plan.schedule.name


# The text report of `dapple plan` simulates a schedule `--schedule=auto` did not simulate only
# when it has at most this many compute tasks (`schedule_choice.schedule_tasks`; about 80 us
# each to lower and simulate), unless asked for all (`--simulate_all`): at 128 micro-batches
# on 16 device groups the relaxed schedules run 16,384 tasks each (about 63,000 actions).
REPORT_TASKS = 1024
NOT_SIMULATED = ("Not simulated: schedules of more than {tasks:,} compute tasks (micro-batches x "
                 "device groups x chunks x batches x passes) that planning did not simulate; "
                 "`--simulate_all` simulates them too.")


def skipped(option: ScheduleOption, max_tasks: Optional[int]) -> bool:
    """Whether a report limited to `max_tasks` (None: no limit) leaves `option` unsimulated."""
    return max_tasks is not None and not option.simulated and option.tasks > max_tasks


def schedule_table(options: Sequence[ScheduleOption], max_tasks: Optional[int] = None
                   ) -> List[List[str]]:
    """The synchronous schedules side by side, as text cells (header first): simulated
    iteration, bubble (idle) fraction and peak memory of each device group, whether it fits
    and runs; those `skipped` under `max_tasks` by name and task count only."""
    out = [["schedule", "simulated ms", "bubble per device group", "peak memory per device group",
            "fits", "dapple runtime"]]
    for o in options:
        if o.relaxed:
            continue
        if skipped(o, max_tasks):
            bound = o.lower_bound_ms       # no simulated iteration is shorter
            at_least = f">= {bound:.1f} (bound), " if bound is not None else ""
            out.append([o.name, f"{at_least}not simulated ({o.tasks:,} tasks)", "-", "-", "-",
                        "runs" if o.runtime_supported else "planned and simulated only"])
            continue
        name = schedule_name(o.plan) if o.plan is not None else o.name
        if o.simulation is None:
            out.append([name, "-", "-", "-", f"no: {o.note}", "-"])
            continue
        bubbles = ", ".join(f"{100 * s.bubble_fraction:.0f}%" for s in o.simulation.stages)
        memory = ", ".join(format_bytes(m) for m in o.memory_bytes)
        out.append([name, f"{o.iteration_ms:.1f}",
                    f"{100 * o.simulation.bubble_fraction:.1f}% ({bubbles})", memory,
                    "yes" if o.fits else f"no: {o.note}",
                    "runs" if o.runtime_supported else "planned and simulated only"])
    return out


def relaxed_table(options: Sequence[ScheduleOption], max_tasks: Optional[int] = None
                  ) -> List[List[str]]:
    """The relaxed schedules side by side (header first): simulated time per global batch over
    their batches, bubble, weight copies and peak memory per device group, whether it fits,
    the update rule and how stale each device group's gradients are; those `skipped` under
    `max_tasks` by name, task count and update rule only."""
    out = [["schedule (opt-in)", "ms per global batch", "bubble per device group",
            "weight copies per device group", "peak memory per device group", "fits",
            "update rule", "staleness per device group (updates)"]]
    for o in options:
        if not o.relaxed:
            continue
        if skipped(o, max_tasks):
            out.append([o.name, f"not simulated ({o.tasks:,} tasks)", "-", "-", "-", "-",
                        o.update_rule, "-"])
            continue
        if o.simulation is None:
            out.append([o.name, "-", "-", "-", "-", f"no: {o.note}", o.update_rule, "-"])
            continue
        stages = o.simulation.stages
        out.append([schedule_name(o.plan), f"{o.iteration_ms:.1f}",
                    f"{100 * o.simulation.bubble_fraction:.1f}% (" +
                    ", ".join(f"{100 * s.bubble_fraction:.0f}%" for s in stages) + ")",
                    ", ".join(str(s.weight_copies) for s in stages),
                    ", ".join(format_bytes(m) for m in o.memory_bytes),
                    "yes" if o.fits else f"no: {o.note}", o.update_rule,
                    ", ".join(str(s.staleness) for s in stages)])
    return out


def markdown_table(cells: Sequence[Sequence[str]]) -> List[str]:
    return (["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])] +
            ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells[1:]])


def strategy_report(plan: Plan, profile, topology,
                    alternatives: Optional[Dict[Alternative, Optional[Plan]]] = None,
                    schedules: Optional[Sequence[ScheduleOption]] = None,
                    max_tasks: Optional[int] = None) -> str:
    """Markdown report of `plan` (estimate filled), the schedules compared on its device groups
    if given (each simulated unless `skipped` under `max_tasks`), and the alternative plans if
    given (None values are shown as 'not feasible')."""
    est = plan.estimate
    dtype = getattr(profile, "compute_dtype", "float32")
    activations = f" (activations in {dtype})" if dtype != "float32" else ""
    lines = [f"# Strategy for {profile.name} on {topology.describe()}{activations}", "",
             f"Topology: {topology.links_source()}.", "",
             f"Plan **{plan.shape()}**, {plan.num_stages} stage(s), global batch "
             f"{plan.global_batch_size}, {plan.micro_batches} micro-batches of "
             f"{plan.micro_batch_size()}, schedule {schedule_name(plan)} "
             f"(K = {plan.warmup_depths()}).", "",
             "| stage | layers | devices (by host) | replicas | F ms | B ms | allreduce ms | "
             "memory/device |",
             "|---|---|---|---|---|---|---|---|"]
    for i, st in enumerate(plan.stages):
        se = est.stages[i]
        names = profile.layer_names
        lines.append(f"| {i} | {st.first}-{st.last} ({names[st.first]} .. {names[st.last]}) | "
                     f"{_devices_by_host(st, topology)} | {st.replicas} | {se.forward_ms:.2f} | "
                     f"{se.backward_ms:.2f} | {se.allreduce_ms:.2f} | "
                     f"{format_bytes(se.memory_bytes)} |")
    if est.method == "simulated":
        lines += ["", f"Latency {est.latency_ms:.1f} ms, simulated (the formula, eq. 1-3, "
                  f"describes GPipe and early backward only).", ""]
    else:
        lines += ["", f"Pivot stage Q = {est.pivot_stage}. Latency {est.latency_ms:.1f} ms = "
                  f"warm-up {est.warmup_ms:.1f} + steady {est.steady_ms:.1f} + ending "
                  f"{est.ending_ms:.1f} ms.", ""]
    if schedules:
        for o in schedules:     # the plan's own schedule is shown simulated, whatever its size
            if o.name == plan.schedule.name:
                _ = o.simulation
        lines += ["Schedules on this plan's device groups and micro-batches (simulated):", ""]
        lines += markdown_table(schedule_table(schedules, max_tasks)) + [""]
        if any(o.relaxed for o in schedules):
            lines += [RELAXED_CAPTION + ":", ""]
            lines += markdown_table(relaxed_table(schedules, max_tasks)) + [""]
        if any(skipped(o, max_tasks) for o in schedules):
            lines += [NOT_SIMULATED.format(tasks=max_tasks), ""]
    if alternatives:
        lines += ["| plan | shape | micro-batches | latency ms | vs this plan |", "|---|---|---|---|---|"]
        lines.append(f"| this plan (DAPPLE) | {plan.shape()} | {plan.micro_batches} | "
                     f"{est.latency_ms:.1f} | 1.00x |")
        for which, alt in alternatives.items():
            name = which.value
            if alt is None or alt.estimate is None:
                lines.append(f"| {name} | - | - | not feasible | - |")
                continue
            ratio = alt.estimate.latency_ms / est.latency_ms
            versus = "same" if abs(ratio - 1) < 5e-3 else \
                f"{ratio:.2f}x slower" if ratio > 1 else f"{1 / ratio:.2f}x faster"
            lines.append(f"| {name} | {alt.shape()} | {alt.micro_batches} | "
                         f"{alt.estimate.latency_ms:.1f} | {versus} |")
        lines.append("")
        lines.append(_why(plan, alternatives))
    return "\n".join(lines) + "\n"


def _why(plan: Plan, alternatives: Dict[Alternative, Optional[Plan]]) -> str:
    est = plan.estimate
    reasons = []
    dp = alternatives.get(Alternative.DATA_PARALLEL)
    if dp is not None and dp.estimate is not None and plan.num_stages > 1:
        ar = dp.estimate.stages[0].allreduce_ms
        reasons.append(f"data parallelism leaves {ar:.1f} ms of gradient allreduce exposed "
                       f"after its last backward; this plan's largest is "
                       f"{max(s.allreduce_ms for s in est.stages):.1f} ms")
    st = alternatives.get(Alternative.STRAIGHT)
    if st is not None and st.estimate is not None and plan.shape() != "straight":
        reasons.append(f"the straight pipeline spends {st.estimate.warmup_ms + st.estimate.ending_ms:.1f}"
                       f" ms filling and draining {st.num_stages} stages against "
                       f"{est.warmup_ms + est.ending_ms:.1f} ms here")
    def faster(alt):
        return alt is not None and alt.estimate is not None \
            and alt.estimate.latency_ms < est.latency_ms * (1 - 1e-9)
    why = "Why: " + "; ".join(reasons) + "." if reasons else \
        "This plan has the least estimated latency in its plan space." \
        if any(map(faster, alternatives.values())) else \
        "This plan has the least estimated latency of those compared."
    full = alternatives.get(Alternative.FULL_SPACE)
    if faster(full):
        why += (f" The full plan space has a deeper plan, {full.shape()}, estimated "
                f"{est.latency_ms / full.estimate.latency_ms:.2f}x faster: its small "
                f"replicated stages hide their allreduces behind the backward chain. The "
                f"default keeps to the shapes the DAPPLE paper reports (data parallelism, "
                f"two stages, straight), which have been measured on real clusters; "
                f"--plan_space=full plans the deeper one.")
    return why
