"""`dapple plan`: plan a model on a topology (planner only; never imports TensorFlow).

    dapple plan --profile=FILE --topology=SPEC --global_batch_size=N [--memory=16GB]
                [--output=plan.json] [--format=text|json] [--even_slices]
                [--plan_space=paper|full]
    dapple plan --profile=FILE --topology=SPEC --global_batch_size=64,128,256   # one row each
    dapple plan --evaluate=plan.json --profile=FILE --topology=SPEC [--format=json]
    dapple plan ... --compute_dtype=float16     # activations in 16 bits (mixed precision)
    dapple plan ... --schedule=auto|gpipe|1f1b|interleaved|zb-h1 [--virtual_stages=V]
    dapple plan ... --schedule=pipedream|2bw|avgpipe [--batches=K]

--schedule: the search plans under early backward (1f1b, the default); another schedule is then
put on the same device groups and micro-batches (interleaved re-cuts the layers into V chunks
per group), and `auto` takes the one the simulator finds fastest among those that fit in
memory (`planner.search.schedule_choice`). The text report shows all of them side by side; the dapple
runtime runs each. The relaxed schedules pipedream, 2bw and avgpipe (stale or averaged weights,
over K consecutive global batches, `planner.schedules.relaxed_lists`) are listed as alternatives and taken
only when named: `auto` never picks one.

With --format=json stdout is the Plan JSON and nothing else. --compute_dtype rescales the
profile's activation bytes (every layer's output, so boundary transfers and activation memory)
by size(new) / size(the profile's compute dtype; graph.txt: float32); model inputs, weights
and times are kept (`Profile.with_compute_dtype`).
"""
from __future__ import annotations

import sys

from absl import flags

from planner import schedules
from planner.schedules.relaxed_lists import DEFAULT_BATCHES

FLAGS = flags.FLAGS
flags.DEFINE_string("profile", None, "profile file: PipeDream/DAPPLE graph.txt or dapple JSON")
flags.DEFINE_integer("profile_batch_size", None,
                     "batch size the profile was measured at (graph.txt files without -pbs-N)")
flags.DEFINE_string("topology", None, "preset A/B/C, spec like 2x8,net=25Gbps, or a JSON file")
flags.DEFINE_string("global_batch_size", None, "global batch size, or a comma list of sizes")
flags.DEFINE_string("memory", None, "device memory limit, e.g. 16GB (default: the topology's)")
flags.DEFINE_string("output", None, "write the plan JSON here")
flags.DEFINE_enum("format", "text", ["text", "json"], "text report or the Plan JSON on stdout")
flags.DEFINE_string("evaluate", None, "a plan JSON to validate and estimate instead of planning")
flags.DEFINE_string("report", None,
                    "also write a strategy report with pictures: plan table, timelines and "
                    "speedup bars against the best DP plan, a straight pipeline and PipeDream "
                    "(.html, self-contained, or .md with PNGs next to it; needs matplotlib)")
flags.DEFINE_enum("transfers", "async", ["async", "horovod", "tensorflow"],
                  "how the runtime will move tensors between stages, for the simulated "
                  "estimates and --schedule=auto: async (one process's devices: a transfer "
                  "goes when sent), horovod (under horovodrun: a collective both ranks "
                  "enter, one at a time per rank) or tensorflow (`dapple launch "
                  "--runtime=tensorflow`: buffered Send/Recv, full duplex, over the "
                  "topology's links, the chief sending a first stage's other replicas their "
                  "rows, which the search counts too); kept in the plan and used for the "
                  "compared plans")
flags.DEFINE_enum("plan_space", "paper", ["paper", "full"],
                  "paper: data parallelism, two-stage plans and the straight pipeline (the shapes "
                  "the DAPPLE paper reports; searched deeper only if none fits); full: every "
                  "pipeline, however deep (planner/search/plan_space.py explains both)")
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
flags.DEFINE_string("compute_dtype", None,
                    "activation dtype to plan for: float32, float16 or bfloat16 (Keras mixed "
                    "precision); scales the profile's activation bytes by its size over that of "
                    "the profile's own compute dtype (graph.txt profiles: float32). Default: the "
                    "profile's")
flags.DEFINE_enum("schedule", None, ["auto", *schedules.names()],
                  "schedule of the plan (default "
                  f"{schedules.DEFAULT.name}, DAPPLE's early backward; with --evaluate, the "
                  f"plan's own): auto picks the fastest synchronous one that fits in memory by "
                  f"the simulator; {', '.join(schedules.names(relaxed=True))} (stale or "
                  f"averaged weights) only when named; the text report compares them all. "
                  + "; ".join(f"{s.name}: {s.summary}" for s in schedules.specs()))
flags.DEFINE_integer("batches", None,
                     "consecutive global batches one run of a relaxed schedule ("
                     f"{', '.join(schedules.takers('batches'))}) covers, without a flush "
                     f"between them (default {DEFAULT_BATCHES})")
flags.DEFINE_integer("virtual_stages", None,
                     "chunks per device group of the interleaved schedule (default 2)")
flags.DEFINE_bool("simulate_all", False,
                  "the text report simulates every schedule it lists; by default it leaves out "
                  "those --schedule=auto did not simulate that run more than "
                  "reports.text_report.REPORT_TASKS compute tasks (e.g. the relaxed schedules "
                  "at 128 micro-batches on 16 device groups, seconds each)")
flags.DEFINE_bool("even_slices", False,
                  "consider only plans whose every stage splits a micro-batch into equal slices "
                  "(what the dapple runtime needs: the global batch divisible by M x replicas)")


def _takes(schedule, parameter: str) -> bool:
    """Whether --schedule (auto: any) takes `parameter`."""
    return schedule == "auto" or (schedule is not None and
                                  schedules.get(schedule).takes(parameter))


def _either(parameter: str) -> str:
    """The schedules taking `parameter`: "a", "a or b", "a, b or c"."""
    *most, last = schedules.takers(parameter)
    return f"{', '.join(most)} or {last}" if most else last


def _fail(message: str) -> None:
    print(f"dapple plan: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}")
    from planner.schedules.actions import ScheduleError
    from planner.formats.plan import PlanError
    from planner.formats.profile import ProfileError
    from planner.formats.profile_readers import load_profile
    from topology import TopologyError, parse_topology
    for name in ("profile", "topology"):
        if not getattr(FLAGS, name):
            _fail(f"--{name} is required")
    if FLAGS.compute_dtype is not None and FLAGS.compute_dtype not in COMPUTE_DTYPES:
        _fail(f"--compute_dtype={FLAGS.compute_dtype} is not one of {', '.join(COMPUTE_DTYPES)}")
    if FLAGS.virtual_stages is not None and FLAGS.virtual_stages < 1:
        _fail(f"--virtual_stages must be a positive integer, got {FLAGS.virtual_stages}")
    if FLAGS.virtual_stages is not None and not _takes(FLAGS.schedule, "virtual_stages"):
        _fail(f"--virtual_stages applies to --schedule={_either('virtual_stages')} (or auto)")
    if FLAGS.batches is not None and not _takes(FLAGS.schedule, "batches"):
        _fail(f"--batches applies to --schedule={_either('batches')} (or auto, for the "
              f"report)")
    if FLAGS.evaluate and FLAGS.schedule:
        _fail("--evaluate keeps the plan's schedule (its \"schedule\" object); --schedule "
              "applies when planning")
    try:
        profile = load_profile(FLAGS.profile, batch_size=FLAGS.profile_batch_size)
        if FLAGS.compute_dtype:
            profile = profile.with_compute_dtype(FLAGS.compute_dtype)
        topo = parse_topology(FLAGS.topology)
        if FLAGS.memory:
            import dataclasses
            from topology.units import parse_memory
            topo = dataclasses.replace(topo, device_memory_bytes=parse_memory(FLAGS.memory))
    except (ProfileError, TopologyError) as e:
        _fail(str(e))
    try:
        if FLAGS.evaluate:
            _evaluate(profile, topo)
        else:
            from planner.search.plan_space import remembering_searches
            from planner.search.seed_plans import remembering_shapes
            # the report plans the straight pipeline twice, and seeds every search it runs
            # with the same shapes
            with remembering_searches(), remembering_shapes():
                _plan(profile, topo)
    except (PlanError, ProfileError, TopologyError, ScheduleError, ValueError) as e:
        _fail(str(e))


def _evaluate(profile, topo) -> None:
    from planner.formats.plan import Plan, PlanError
    from reports.text_report import strategy_report
    from planner.search.plan_finishing import finish_plan
    plan = Plan.load(FLAGS.evaluate)
    if FLAGS.global_batch_size:
        plan.global_batch_size = int(FLAGS.global_batch_size)
    if plan.global_batch_size is None:
        raise PlanError(f"{FLAGS.evaluate}: the plan has no global_batch_size; add it to the "
                        f"file or pass --global_batch_size")
    plan.validate(num_layers=profile.num_layers, num_devices=topo.num_devices)
    if plan.profile and plan.profile.get("hash") not in (None, profile.content_hash):
        dtype = plan.profile.get("compute_dtype", "float32")
        hint = (f"; it was planned for compute dtype {dtype} (pass --compute_dtype={dtype})"
                if dtype != profile.compute_dtype else "")
        raise PlanError(f"{FLAGS.evaluate} was made for profile {plan.profile.get('name')!r} "
                        f"(hash {str(plan.profile.get('hash'))[:12]}...), not {profile.name} "
                        f"(hash {profile.content_hash[:12]}..., compute dtype "
                        f"{profile.compute_dtype}){hint}")
    finish_plan(plan, profile, topo, keep_warmup=True)
    if FLAGS.output:
        plan.save(FLAGS.output)
    if FLAGS.format == "json":
        print(plan.to_json())
    else:
        from planner.search.schedule_choice import schedule_options
        options = schedule_options(plan, profile, topo, plan.virtual_stages) \
            if plan.num_positions == plan.num_stages else None
        print(strategy_report(plan, profile, topo, schedules=options,
                              max_tasks=_report_tasks()))


def _report_tasks():
    """The text report's limit on what it simulates (None: everything)."""
    from reports.text_report import REPORT_TASKS
    return None if FLAGS.simulate_all else REPORT_TASKS


def _plan(profile, topo) -> None:
    from planner.search.plan_space import plan_dapple
    from reports.comparison import BASELINES, Alternative, alternatives
    from reports.text_report import strategy_report
    if not FLAGS.global_batch_size:
        _fail("--global_batch_size is required (or --evaluate=plan.json)")
    try:
        sizes = [int(x) for x in FLAGS.global_batch_size.split(",") if x.strip()]
    except ValueError:
        _fail(f"--global_batch_size must be integers, got {FLAGS.global_batch_size!r}")
    for gbs in sizes:
        if gbs < 1:
            _fail(f"--global_batch_size must be positive, got {gbs}")
    if FLAGS.report:
        _report(profile, topo, sizes)
    if len(sizes) > 1:
        if FLAGS.format == "json":
            _fail("--format=json takes one global batch size")
        _table(profile, topo, sizes)
        return
    gbs = sizes[0]
    # The text report's "best straight" alternative is the straight search on its own: plan
    # with that search (remembered) rather than also with one bounded by the other plans'.
    plan, options = _scheduled(plan_dapple(profile, topo, gbs, even_slices=FLAGS.even_slices,
                                           plan_space=FLAGS.plan_space,
                                           transfers=FLAGS.transfers,
                                           bound_straight=FLAGS.format == "json"),
                               profile, topo, timeline=FLAGS.format == "text")
    if FLAGS.output:
        plan.save(FLAGS.output)
    if FLAGS.format == "json":
        print(plan.to_json())
        return
    compared = (*BASELINES, Alternative.other_space(FLAGS.plan_space))
    print(strategy_report(plan, profile, topo,
                          alternatives(profile, topo, gbs, compared,
                                       even_slices=FLAGS.even_slices,
                                       transfers=FLAGS.transfers), schedules=options,
                          max_tasks=_report_tasks()))
    uneven = [i for i in range(plan.num_stages) if len(set(plan.slice_sizes(i))) > 1]
    if uneven:
        print(f"Note: stage(s) {uneven} split each micro-batch of {plan.micro_batch_size()} "
              f"samples into uneven slices; the dapple runtime needs even ones (the global "
              f"batch divisible by micro-batches x replicas of every stage). Re-run with "
              f"--even_slices, or pick a global batch that divides evenly.")
    if FLAGS.output:
        print(f"plan written to {FLAGS.output}")


def _scheduled(plan, profile, topo, timeline: bool = False):
    """(the plan under --schedule, every schedule compared on it; `timeline`: the report
    will print their simulations, so `auto` runs them rather than timing the iterations
    alone)."""
    import dataclasses
    from planner.search.schedule_choice import choose_schedule
    plan = dataclasses.replace(plan, transfers=FLAGS.transfers)
    return choose_schedule(plan, profile, topo, FLAGS.schedule or schedules.DEFAULT.name,
                           FLAGS.virtual_stages, FLAGS.batches, timeline=timeline)


def _report(profile, topo, sizes) -> None:
    from reports.comparison import strategy_row
    from reports.html_report import check_report_path, write_report
    from reports.timeline import require_matplotlib
    check_report_path(FLAGS.report)
    try:
        require_matplotlib()
    except ImportError as e:
        _fail(f"--report={FLAGS.report}: {e}")
    rows = [strategy_row(profile, topo, gbs, even_slices=FLAGS.even_slices,
                         plan_space=FLAGS.plan_space, transfers=FLAGS.transfers,
                         schedule=FLAGS.schedule or schedules.DEFAULT.name,
                         virtual_stages=FLAGS.virtual_stages, batches=FLAGS.batches)
            for gbs in sizes]
    written = write_report(FLAGS.report, rows, title=f"{profile.name} on {topo.describe()}",
                           notes=[f"Topology: {topo.links_source()}."])
    print(f"strategy report written to {', '.join(written)}", file=sys.stderr)


def _table(profile, topo, sizes) -> None:
    from planner.search.plan_space import plan_dapple
    from reports.comparison import Alternative, alternatives, single_device_ms
    print(f"{profile.name} on {topo.describe()}")
    print(f"{'global batch':>12}  {'plan':>14}  {'M':>5}  {'latency ms':>11}  "
          f"{'vs 1 device':>11}  {'vs best DP':>10}  {'vs PipeDream':>12}  schedule")
    for gbs in sizes:
        plan = _scheduled(plan_dapple(profile, topo, gbs, even_slices=FLAGS.even_slices,
                                      plan_space=FLAGS.plan_space, transfers=FLAGS.transfers),
                          profile, topo)[0]
        lat = plan.estimate.latency_ms
        one = single_device_ms(profile, topo, gbs)
        alts = alternatives(profile, topo, gbs,
                            (Alternative.DATA_PARALLEL, Alternative.PIPEDREAM),
                            even_slices=FLAGS.even_slices, transfers=FLAGS.transfers)

        def ratio(p):
            return f"{p.estimate.latency_ms / lat:.2f}x" if p is not None else "n/a"
        print(f"{gbs:>12}  {plan.shape():>14}  {plan.micro_batches:>5}  {lat:>11.1f}  "
              f"{(one / lat if one else float('nan')):>10.2f}x  "
              f"{ratio(alts[Alternative.DATA_PARALLEL]):>10}  "
              f"{ratio(alts[Alternative.PIPEDREAM]):>12}  {plan.schedule}")
