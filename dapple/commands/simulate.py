"""`dapple simulate`: replay a plan's schedule with the cost model; print results, draw pictures.

    dapple simulate --plan=plan.json --profile=bert-48-pbs-2.txt --topology=A --format=json
    dapple simulate --plan=plan.json --profile=... --topology=... --output=timeline.png
    dapple simulate --plan=plan.json --costs=costs.json --held_output=held.png
    dapple simulate --plan=plan.json --costs=costs.json --schedule=zb-h1
    dapple simulate --plan=plan.json --profile=... --topology=... --schedule=auto
    dapple simulate --plan=plan.json --costs=costs.json --schedule=2bw --batches=4

--schedule puts the plan's stages under another schedule before simulating (gpipe, 1f1b, zb-h1,
pipedream, 2bw and avgpipe keep the stages, so --costs works; interleaved re-cuts the layers
into --virtual_stages chunks per device group and auto compares all of them, which both need
--profile and --topology: `planner.search.schedule_choice`). The relaxed schedules (pipedream, 2bw,
avgpipe) run --batches consecutive global batches (default 4) as one run; the results give the
run and its time per global batch. With --costs, an avgpipe plan keeps its advance (0 when put
under avgpipe here) and the costs are one pipeline's; with --profile and --topology the
advance is tuned as AvgPipe's Algorithm 1 does.

Durations come from `planner.estimate.cost_model.pipeline_costs(plan, profile, topology)`, or from a
`--costs` JSON file holding `PipelineCosts` fields (hand-made costs, or measured ones). Planner
only: never imports TensorFlow.
"""
from __future__ import annotations

import dataclasses
import json
import sys

from absl import flags

from planner import schedules

FLAGS = flags.FLAGS
flags.DEFINE_string("plan", None, "plan JSON file (written by `dapple plan` or by hand)")
flags.DEFINE_string("profile", None, "layer profile (graph.txt or dapple JSON)")
flags.DEFINE_float("profile_batch_size", None,
                   "batch size the profile was measured at, when its file name has no -pbs-N")
flags.DEFINE_string("topology", None, "topology: preset A/B/C, a spec like '2x8,net=25Gbps', "
                                      "or a JSON file")
flags.DEFINE_string("costs", None, "JSON file of PipelineCosts fields (forward_ms, backward_ms, "
                                   "send_forward_ms, send_backward_ms, allreduce_ms, "
                                   "activation_bytes, weight_gradient_bytes; one entry per "
                                   "chunk), instead of --profile/--topology")
flags.DEFINE_enum("format", "text", ["text", "json"], "how to print the results")
flags.DEFINE_boolean("timeline", False, "include every timeline event in the JSON output")
flags.DEFINE_string("output", None, "write the timeline picture here (.png, .svg or .pdf)")
flags.DEFINE_string("held_output", None,
                    "write a picture of activations held over time, GPipe against early "
                    "backward (the paper's Fig. 3c), here")
flags.DEFINE_enum("schedule", None, ["auto", *schedules.names()],
                  "simulate the plan's stages under this schedule instead of the plan's own "
                  "(auto: the fastest synchronous one that fits in memory, all compared)")
flags.DEFINE_integer("batches", None,
                     "consecutive global batches a relaxed schedule ("
                     f"{', '.join(schedules.takers('batches'))}) runs without a flush (default: "
                     f"the plan's, else 4)")
flags.DEFINE_integer("virtual_stages", None,
                     "chunks per device group for --schedule=interleaved (default 2)")
flags.DEFINE_enum("link_duplex", None, ["full", "half", "serial"],
                  "full: activations and gradients cross a boundary on separate channels; "
                  "half: they share one (eq. 1's reading of a boundary as a stage); serial: "
                  "a device takes part in one transfer at a time over all its links (Horovod "
                  "runs a process's collectives one after another; with --rendezvous, the "
                  "runtime under horovodrun). Default: the plan's transfers (full; serial "
                  "for \"transfers\": \"horovod\")")
flags.DEFINE_bool("rendezvous", None,
                  "a transfer also waits until its receiver reached the receive, as a "
                  "collective does (Horovod's alltoall, the runtime under horovodrun). "
                  "Default: the plan's transfers (on for \"transfers\": \"horovod\")")


LINKS = {"full": "links full duplex", "half": "links half duplex",
         "serial": "one transfer at a time per device"}


class UsageError(Exception):
    pass


def load_costs(path: str, num_stages: int):
    from planner.estimate.pipeline_costs import PipelineCosts
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"--costs file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--costs file {path}: not valid JSON: {e}") from None
    fields = ("forward_ms", "backward_ms", "send_forward_ms", "send_backward_ms",
              "allreduce_ms", "activation_bytes", "weight_gradient_bytes")
    if not isinstance(data, dict) or any(k not in fields for k in data):
        raise UsageError(f"--costs file {path}: must be a JSON object with the fields {fields}")
    try:
        costs = PipelineCosts(**data)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--costs file {path}: {e}") from None
    if costs.num_stages != num_stages:
        raise UsageError(f"--costs file {path} describes {costs.num_stages} stages but the plan "
                         f"has {num_stages}")
    return costs


def profile_and_topology(why: str):
    if not FLAGS.profile or not FLAGS.topology:
        raise UsageError(f"{why}: pass --profile and --topology")
    from planner.formats.profile_readers import load_profile
    from topology.parse import parse_topology
    return (load_profile(FLAGS.profile, batch_size=FLAGS.profile_batch_size),
            parse_topology(FLAGS.topology))


def costs_for(plan):
    """PipelineCosts for `plan` from --costs, or from --profile and --topology."""
    if FLAGS.costs:
        if FLAGS.profile or FLAGS.topology:
            raise UsageError("give either --costs or --profile with --topology, not both")
        return load_costs(FLAGS.costs, plan.num_stages)
    profile, topology = profile_and_topology(
        "durations are needed (or give --costs=costs.json)")
    from planner.estimate.cost_model import pipeline_costs
    plan.validate(num_layers=profile.num_layers, num_devices=topology.num_devices)
    return pipeline_costs(plan, profile, topology)


def _takes(schedule, parameter: str) -> bool:
    """Whether `schedule` (a name, a spec; auto: any) takes `parameter`."""
    return schedule == "auto" or (schedule is not None and
                                  schedules.coerce(schedule).takes(parameter))


def rescheduled(plan):
    """(the plan under --schedule, the schedules compared when auto chose: else None)."""
    name, v, k = FLAGS.schedule, FLAGS.virtual_stages, FLAGS.batches
    if v is not None and not _takes(name, "virtual_stages"):
        raise UsageError(f"--virtual_stages applies to --schedule="
                         f"{' or '.join(schedules.takers('virtual_stages'))} (or auto)")
    if k is not None and not _takes(name or plan.schedule, "batches"):
        raise UsageError(f"--batches applies to the relaxed schedules: "
                         f"{', '.join(schedules.takers('batches'))}")
    if name is None or (name == plan.schedule and v in (None, plan.virtual_stages)):
        if k is not None:
            plan = dataclasses.replace(plan, batches=k).validate()
        return plan, None
    from planner.search.schedule_choice import choose_schedule, with_schedule
    spec = None if name == "auto" else schedules.get(name)
    # Same stages, no cost model needed, unless the cost model tunes a parameter (advance).
    if spec is not None and not spec.rechunks and (not spec.takes("advance") or FLAGS.costs):
        return with_schedule(plan, name, k), None
    if FLAGS.costs:
        raise UsageError(f"--schedule={name} needs the cost model (interleaved re-cuts the "
                         f"layers): pass --profile and --topology instead of --costs")
    profile, topology = profile_and_topology(f"--schedule={name}")
    chosen, options = choose_schedule(plan, profile, topology, name, v, k)
    return chosen, options if name == "auto" else None


def format_text(plan, result) -> str:
    v = f" (v = {plan.virtual_stages})" if plan.virtual_stages else ""
    lines = [f"plan {plan.shape()}: {plan.num_stages} stage(s), {plan.micro_batches} "
             f"micro-batches, schedule {plan.schedule}{v}, warm-up K = {plan.warmup_depths()}",
             f"iteration {result.iteration_ms:.3f} ms, bubble fraction "
             f"{result.bubble_fraction:.3f} ({LINKS[result.link_duplex]}"
             f"{', rendezvous transfers' if result.rendezvous else ''})"]
    if result.batches > 1 or result.pipelines > 1:
        lines.append(f"{result.batches} global batches x {result.pipelines} pipeline(s) in the "
                     f"run: {result.batch_ms:.3f} ms per global batch; weight copies "
                     f"{[s.weight_copies for s in result.stages]}, staleness (updates) "
                     f"{[s.staleness for s in result.stages]}")
    if plan.estimate is not None and plan.estimate.method == "formula":
        formula = plan.estimate.latency_ms
        lines.append(f"formula (eq. 1-3) in the plan: {formula:.3f} ms; simulated / formula = "
                     f"{result.iteration_ms / formula:.3f}" if formula else "")
    lines.append(f"{'stage':>5} {'devices':>10} {'busy ms':>10} {'idle ms':>10} "
                 f"{'allreduce':>10} {'bubble':>7} {'peak held':>9} {'awaiting W':>10}")
    for st, stats in zip(plan.stages, result.stages):
        d = st.devices
        devices = str(d[0]) if len(d) == 1 else f"{d[0]}-{d[-1]}"
        lines.append(f"{stats.stage:>5} {devices:>10} {stats.busy_ms:>10.3f} "
                     f"{stats.idle_ms:>10.3f} {stats.allreduce_ms:>10.3f} "
                     f"{stats.bubble_fraction:>7.3f} {stats.peak_held_micro_batches:>9} "
                     f"{stats.peak_awaiting_weight_micro_batches:>10}")
    return "\n".join(line for line in lines if line)


def run() -> int:
    from planner.formats.plan import Plan
    from planner.estimate.simulator import simulate_plan
    if not FLAGS.plan:
        raise UsageError("--plan=plan.json is required (write one with `dapple plan`)")
    plan, options = rescheduled(Plan.load(FLAGS.plan).validate())
    costs = costs_for(plan)
    result = simulate_plan(plan, costs, link_duplex=FLAGS.link_duplex,
                           rendezvous=FLAGS.rendezvous)
    # Pictures first: the printed results may go to a pipe that closes early (| head).
    if FLAGS.output:
        from reports.timeline import save_figure, timeline_figure
        title = (f"plan {plan.shape()}, {plan.micro_batches} micro-batches, schedule "
                 f"{plan.schedule}, warm-up K = {plan.warmup_depths()}")
        save_figure(timeline_figure(result, plan, title=title), FLAGS.output)
        print(f"timeline written to {FLAGS.output}", file=sys.stderr)
    if FLAGS.held_output:
        from reports.comparison import held_comparison
        from reports.timeline import held_activations_figure, held_stages, save_figure
        held = held_comparison(plan, costs, FLAGS.link_duplex, FLAGS.rendezvous)
        save_figure(held_activations_figure(held, stages=held_stages(plan),
                                            title=f"activations held, plan {plan.shape()}, "
                                                  f"{plan.micro_batches} micro-batches"),
                    FLAGS.held_output)
        print(f"held-activations picture written to {FLAGS.held_output}", file=sys.stderr)
    if FLAGS.format == "json":
        d = result.to_dict(with_timeline=FLAGS.timeline)
        d["schedule"] = plan.to_dict()["schedule"]
        if plan.estimate is not None and plan.estimate.method == "formula":
            d["formula_latency_ms"] = plan.estimate.latency_ms
        if options:
            d["schedules_compared"] = [
                {"name": o.name, "iteration_ms": o.iteration_ms, "fits": o.fits,
                 "bubble_fraction": o.simulation and o.simulation.bubble_fraction,
                 "memory_bytes": o.memory_bytes, "note": o.note} for o in options]
        print(json.dumps(d, indent=2))
    else:
        if options:
            from reports.text_report import markdown_table, schedule_table
            print("\n".join(markdown_table(schedule_table(options))) + "\n")
        print(format_text(plan, result))
    return 0


def main(argv):
    if len(argv) > 1:
        print(f"dapple simulate: unexpected arguments {argv[1:]}; all inputs are --flags",
              file=sys.stderr)
        return 2
    from planner.formats.plan import PlanError
    from planner.formats.profile import ProfileError
    from planner.schedules.actions import ScheduleError
    try:
        from topology import TopologyError
    except ImportError:   # pragma: no cover - topology is part of the same package
        TopologyError = ValueError
    try:
        return run()
    except (UsageError, PlanError, ProfileError, TopologyError, ScheduleError, ImportError,
            ValueError, OSError) as e:
        print(f"dapple simulate: {e}", file=sys.stderr)
        return 2
