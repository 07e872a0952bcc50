"""Planning time of every profile in ../shared/profiles on configs A, B and C (and BERT-48 on
128 x 8), printed as a table. Run: python3 benchmarks/plan_speed.py"""
import glob
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from planner.profile_readers import load_profile  # noqa: E402
from planner.exact_search import SearchStats  # noqa: E402
from planner.plan_space import plan_dapple  # noqa: E402
from topology import parse_topology                 # noqa: E402

PROFILES = os.environ.get("DAPPLE_PROFILES", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "profiles"))
# PipeDream files do not record their batch (profiles README): image models from Input bytes.
PIPEDREAM_BATCH = {"vgg16": 128, "resnet50": 128, "alexnet": 256, "resnet18": 256,
                   "densenet121": 64, "inception_v3": 128, "gnmt16": 64, "gnmt8": 64}


def main():
    print(f"{'profile':32} {'cfg':>8} {'plan':>16} {'seconds':>8} complete")
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
            dt = time.perf_counter() - t
            print(f"{path[len(PROFILES) + 1:]:32} {cfg:>8} {plan.shape()[:16]:>16} {dt:8.2f} "
                  f"{stats.complete}", flush=True)
    profile = load_profile(f"{PROFILES}/dapple/bert-48-pbs-2.txt")
    stats = SearchStats()
    t = time.perf_counter()
    plan = plan_dapple(profile, parse_topology("128x8"), 8192, stats=stats)
    print(f"{'dapple/bert-48 gbs 8192':32} {'128x8':>8} {plan.shape()[:16]:>16} "
          f"{time.perf_counter() - t:8.2f} {stats.complete}")


if __name__ == "__main__":
    main()
