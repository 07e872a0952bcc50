"""Dump what the planner returns, one file each, to check that a change to the planner's
speed leaves its output alone (`diff -r BEFORE AFTER`; docs/planner.md, "Speed"):

* in-process: the plan JSON (and the search statistics) of the 15 Table V cells and BERT-48
  on 128x8,net=25Gbps, in both plan spaces and with `bound_straight=False`, each paper plan
  under `choose_schedule(..., "auto")`; the 10 `-pbs-` dapple profiles on A, B and C at global
  batch 256; 25 random (profile, topology, global batch) instances with `auto`;
* processes: the stdout of `dapple plan --schedule=auto` (JSON and the text report) on the
  16 cells.

192 files. Run, in each tree: DAPPLE_PROFILES=../shared/profiles PYTHONPATH=$PWD
.venv/bin/python benchmarks/plan_dump.py OUTDIR [all|inproc|proc]
"""
import glob
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.plan_speed import BERT_128X8, PROFILES  # noqa: E402
from benchmarks.simulate_table_v import CONFIGS, TABLE_V  # noqa: E402
from planner.formats.profile_readers import load_profile  # noqa: E402
from planner.search.exact_search import SearchStats  # noqa: E402
from planner.search.plan_space import plan_dapple  # noqa: E402
from planner.search.schedule_choice import choose_schedule  # noqa: E402
from topology import parse_topology  # noqa: E402

RANDOM_TOPOLOGIES = ["A", "B", "C", "2x4", "4x2,net=10Gbps", "3x4,net=25Gbps",
                     "2x8,net=10Gbps", "8+4", "1x8"]


def main(out, what="all"):
    os.makedirs(out, exist_ok=True)

    def record(name, plan, stats=None):
        with open(os.path.join(out, name + ".json"), "w") as f:
            f.write(plan.to_json())
            if stats is not None:
                f.write("\n" + repr(stats) + "\n")

    def record_error(name, error):
        with open(os.path.join(out, name + ".err"), "w") as f:
            f.write(repr(error))

    cells = [(m, rel, g, c) for m, rel, g in TABLE_V for c in CONFIGS] + [BERT_128X8]
    if what in ("all", "inproc"):
        for m, rel, g, c in cells:
            profile, topo = load_profile(os.path.join(PROFILES, rel)), parse_topology(c)
            for space in ("paper", "full"):
                stats = SearchStats()
                plan = plan_dapple(profile, topo, g, stats=stats, plan_space=space)
                record(f"{m}-{c}-{space}", plan, stats)
                if space == "paper":
                    record(f"{m}-{c}-auto", choose_schedule(plan, profile, topo, "auto")[0])
                plan = plan_dapple(profile, topo, g, plan_space=space, bound_straight=False)
                record(f"{m}-{c}-{space}-unbounded", plan)
        profiles = sorted(glob.glob(os.path.join(PROFILES, "dapple", "*-pbs-*.txt")))
        for path in profiles:
            profile = load_profile(path)
            for c in CONFIGS:
                name = f"prof-{os.path.basename(path)}-{c}"
                try:
                    record(name, plan_dapple(profile, parse_topology(c), 256))
                except Exception as e:  # noqa: BLE001 (the error is the output compared)
                    record_error(name, e)
        rng = random.Random(29)
        for i in range(25):
            path, c = rng.choice(profiles), rng.choice(RANDOM_TOPOLOGIES)
            g = rng.choice([64, 128, 256, 512, 1024, 2048])
            profile, topo = load_profile(path), parse_topology(c)
            try:
                stats = SearchStats()
                plan = plan_dapple(profile, topo, g, stats=stats)
                record(f"rand{i}", plan, stats)
                record(f"rand{i}-auto", choose_schedule(plan, profile, topo, "auto")[0])
            except Exception as e:  # noqa: BLE001
                record_error(f"rand{i}", e)
    if what in ("all", "proc"):
        dapple = os.path.join(os.path.dirname(sys.executable), "dapple")
        tree = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        for m, rel, g, c in cells:
            for fmt in ("json", "text"):
                r = subprocess.run([dapple, "plan", f"--profile={os.path.join(PROFILES, rel)}",
                                    f"--topology={c}", f"--global_batch_size={g}",
                                    "--schedule=auto", f"--format={fmt}"],
                                   capture_output=True, text=True,
                                   env=dict(os.environ, PYTHONPATH=tree))
                with open(os.path.join(out, f"proc-{m}-{c}.{fmt}"), "w") as f:
                    f.write(r.stdout + r.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:3])
