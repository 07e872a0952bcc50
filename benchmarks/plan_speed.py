"""How fast the planner plans, in four tables (seconds, best of --repeat runs; wall clock, and
for cells and processes also their CPU time, steadier when others share the machine):

* table_v: each Table V cell (benchmarks/simulate_table_v.py's profiles and batches, configs A,
  B, C) planned in-process with --schedule=auto (search, then schedule choice), and as a
  `dapple plan --schedule=auto` process (JSON output, and the default text report, which
  simulates what `auto` simulated and every other schedule of at most
  `reports.text_report.REPORT_TASKS` compute tasks);
* bert: BERT-48 on 128x8,net=25Gbps at global batch 8192, the same way;
* scaling: the simulator's time per action, early backward on 16 stages, M = 8 .. 512 (first
  run of a schedule, lowering included; and a run of a schedule simulated before; wall clock
  and CPU);
* profiles: the search alone on every profile in ../shared/profiles, configs A, B and C.

After table_v and bert, the targets of #29 and whether they are met, judged on CPU seconds
(the machine is shared; wall clock beside them): every Table V cell in-process under 0.1 s and
as a default `dapple plan` process (text report) under 1 s; BERT-48 on 128x8 under 0.5 s
in-process and 2 s as a process.

Run: .venv/bin/python benchmarks/plan_speed.py [--only=table_v,bert,scaling,profiles]
     [--repeat=3] [--markdown]
"""
import argparse
import glob
import os
import re
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.simulate_table_v import CONFIGS, TABLE_V  # noqa: E402
from benchmarks.tables import print_table  # noqa: E402
from planner.estimate.pipeline_costs import PipelineCosts  # noqa: E402
from planner.search.exact_search import SearchStats  # noqa: E402
from planner.search.plan_space import plan_dapple  # noqa: E402
from planner.formats.profile_readers import load_profile  # noqa: E402
from planner.schedules import actions, by_name  # noqa: E402
from planner.schedules.by_name import build_schedule  # noqa: E402
from planner.search.schedule_choice import choose_schedule  # noqa: E402
from planner.estimate.simulator import simulate  # noqa: E402
from topology import parse_topology  # noqa: E402

PROFILES = os.environ.get("DAPPLE_PROFILES", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "profiles"))
# PipeDream files do not record their batch (profiles README): image models from Input bytes.
PIPEDREAM_BATCH = {"vgg16": 128, "resnet50": 128, "alexnet": 256, "resnet18": 256,
                   "densenet121": 64, "inception_v3": 128, "gnmt16": 64, "gnmt8": 64}
DAPPLE = os.path.join(os.path.dirname(sys.executable), "dapple")
BERT_128X8 = ("BERT-48", "dapple/bert-48-pbs-2.txt", 8192, "128x8,net=25Gbps")


def best_of(repeat, run):
    """(least seconds over `repeat` calls of run(), that call's result)."""
    best = (float("inf"), None)
    for _ in range(repeat):
        t = time.perf_counter()
        out = run()
        best = min(best, (time.perf_counter() - t, out), key=lambda b: b[0])
    return best


def forget_schedules():
    """Empty the process's schedule caches (built schedules by parameters, and through them
    their lowerings, which are remembered by the schedule's identity; interned actions and
    runs of actions), so a repeat is timed as the first plan of a process is."""
    by_name._built.cache_clear()
    actions.shared_action.cache_clear()
    actions.micro_batch_action_run.cache_clear()


def in_process(profile, topology, gbs):
    """(search seconds, choice seconds, plan, CPU seconds of both) of one cell, as the first
    plan of a process (`forget_schedules`; the search's caches are its own objects')."""
    forget_schedules()
    cpu, t = time.process_time(), time.perf_counter()
    plan = plan_dapple(profile, topology, gbs)
    t1 = time.perf_counter()
    chosen, _ = choose_schedule(plan, profile, topology, "auto")
    return t1 - t, time.perf_counter() - t1, chosen, time.process_time() - cpu


def as_process(path, cfg, gbs, *extra):
    """CPU seconds (user + system) of one `dapple plan --schedule=auto` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([DAPPLE, "plan", f"--profile={path}", f"--topology={cfg}",
                    f"--global_batch_size={gbs}", "--schedule=auto", *extra],
                   check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


# (table, what is timed, key of `cell_rows`' `record`, seconds): #29's targets.
TARGETS = [("table_v", "in-process", "in_process", 0.1),
           ("table_v", "`dapple plan` process, text report", "text", 1.0),
           ("bert", "in-process", "in_process", 0.5),
           ("bert", "`dapple plan` process, text report", "text", 2.0)]


def cell_rows(cells, repeat, record=None):
    """The table's rows; `record` (a list) gets {"in_process", "json", "text"}: (wall, CPU)
    seconds of each cell."""
    rows = []
    for model, relative, gbs, cfg in cells:
        path = os.path.join(PROFILES, relative)
        profile, topology = load_profile(path), parse_topology(cfg)
        timings = [in_process(profile, topology, gbs) for _ in range(repeat)]
        search, choice, plan, cpu = min(timings, key=lambda t: t[0] + t[1])
        json_s, json_cpu = best_of(repeat, lambda: as_process(path, cfg, gbs, "--format=json"))
        text_s, text_cpu = best_of(repeat, lambda: as_process(path, cfg, gbs))
        if record is not None:
            record.append({"in_process": (search + choice, cpu), "json": (json_s, json_cpu),
                            "text": (text_s, text_cpu)})
        rows.append([model, cfg, plan.shape(), str(plan.micro_batches), plan.schedule.name,
                     f"{search:.3f}", f"{choice:.3f}", f"{search + choice:.3f} ({cpu:.3f})",
                     f"{json_s:.2f} ({json_cpu:.2f})", f"{text_s:.2f} ({text_cpu:.2f})"])
    return ["model", "cfg", "plan", "M", "schedule", "search s", "choice s",
            "in-process: s (cpu)",
            "process, json: s (cpu)", "process, text: s (cpu)"], rows


def target_rows(timings):
    """One row per target of a table measured: the worst cell (CPU, wall) and whether met."""
    rows = []
    for table, what, column, limit in TARGETS:
        if table not in timings:
            continue
        cpu = max(t[column][1] for t in timings[table])
        wall = max(t[column][0] for t in timings[table])
        rows.append([table, what, f"< {limit:g}", f"{cpu:.2f}", f"{wall:.2f}",
                     "yes" if cpu < limit else "no",
                     f"{sum(t[column][1] < limit for t in timings[table])} of "
                     f"{len(timings[table])}"])
    return ["table", "timed", "target s", "worst cpu s", "worst wall s", "met (cpu)",
            "cells within"], rows


def scaling_rows(repeat, stages=16):
    costs = PipelineCosts([1.0] * stages, [2.0] * stages, [0.1] * (stages - 1),
                          [0.1] * (stages - 1), [0.5] * stages)
    rows = []
    for M in (8, 32, 128, 512):
        first, cpu = time.perf_counter(), time.process_time()
        result = simulate(build_schedule("1f1b", stages, M), costs)
        first, first_cpu = time.perf_counter() - first, time.process_time() - cpu
        again = again_cpu = float("inf")
        for _ in range(repeat):
            t, cpu = time.perf_counter(), time.process_time()
            simulate(build_schedule("1f1b", stages, M), costs)
            again = min(again, time.perf_counter() - t)
            again_cpu = min(again_cpu, time.process_time() - cpu)
        actions = sum(len(lst) for lst in result.schedule.lists)
        rows.append([str(M), str(actions), f"{1e6 * first / actions:.1f}",
                     f"{1e6 * first_cpu / actions:.1f}", f"{1e6 * again / actions:.1f}",
                     f"{1e6 * again_cpu / actions:.1f}"])
    return ["M", "actions", "first run us/action", "(cpu)", "again us/action", "(cpu)"], rows


def profile_rows():
    rows = []
    for path in sorted(glob.glob(f"{PROFILES}/*/*.txt")):
        name = os.path.basename(path)[:-4]
        m = re.search(r"-pbs-(\d+)", name)
        pbs = None if m else PIPEDREAM_BATCH.get(name, 32)
        profile = load_profile(path, batch_size=pbs)
        gbs = 2048 if profile.batch_size >= 32 else 128
        for cfg in "ABC":
            stats = SearchStats()
            t = time.perf_counter()
            plan = plan_dapple(profile, parse_topology(cfg), gbs, stats=stats)
            rows.append([path[len(PROFILES) + 1:], cfg, plan.shape()[:16],
                         f"{time.perf_counter() - t:.2f}", str(stats.complete)])
    return ["profile", "cfg", "plan", "search s", "complete"], rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="table_v,bert,scaling,profiles")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    timings = {}
    tables = {
        "table_v": lambda: cell_rows([(model, relative, gbs, cfg) for model, relative, gbs
                                      in TABLE_V for cfg in CONFIGS], args.repeat,
                                     timings.setdefault("table_v", [])),
        "bert": lambda: cell_rows([BERT_128X8], args.repeat, timings.setdefault("bert", [])),
        "scaling": lambda: scaling_rows(args.repeat),
        "profiles": profile_rows,
    }
    for name in args.only.split(","):
        print(f"\n{name}:")
        print_table(*tables[name](), markdown=args.markdown)
        sys.stdout.flush()
    if timings:
        print(f"\ntargets (#29; load average at the end {os.getloadavg()[0]:.1f}):")
        print_table(*target_rows(timings), markdown=args.markdown)


if __name__ == "__main__":
    main()
