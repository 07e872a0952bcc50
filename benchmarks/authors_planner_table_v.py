"""What the DAPPLE authors' own planner (HPGO) plans for the 15 cells of the paper's Table V.

Not part of dapple and not run by the tests: it needs Python 3.7 and the authors' binary wheel
(HPGO 0.9.2, the only version on PyPI; their PLANNER_REPRODUCTION.md pins 0.9.3), which does
not install on our Python 3.11. One way to get them on a machine with pyenv's 3.7:

    ~/.pyenv/versions/3.7.16/bin/python -m venv /tmp/hpgo
    /tmp/hpgo/bin/pip install HPGO==0.9.2 graphviz
    RAYON_NUM_THREADS=2 /tmp/hpgo/bin/python benchmarks/authors_planner_table_v.py \
        [--models=bert,xlnet] [--profiles=../shared/profiles/dapple]

For each cell it calls `HPGO.conductor_from_torch_graph_and_seps(profile, pbs, gbs, seps)` and
`py_orchestrate()` (the calls their reproduction notes use) and prints the plan's shape, the
split in HPGO's own state numbering and HPGO's speedup estimate, next to the paper's shape.
Config A is `seps=[8, 16]` (two hosts of 8); B and C are flat (`seps=[1, ..., 16]`).

HPGO compiles its network constants in: Ethernet 3e9 B/s (about 24 Gbit/s, used both for
point-to-point transfers and for allreduce), NVLink 25e9 B/s. So B runs the wheel as shipped,
and C (10 Gbit/s) runs a copy of the extension in a temporary directory with that one double
changed to 1.25e9 B/s; the script finds it by value and refuses to run if it is not there
exactly once. Each cell runs in its own process, because the extension is loaded once per
process. GNMT-16 takes minutes per cell (its DAG has 1495 states; the others take seconds).

The results and what they show are in docs/reproductions.md ("Table V", "The authors' planner").
"""
import argparse
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROFILES = os.path.join(HERE, "..", "..", "shared", "profiles", "dapple")
# Model, profile file, profile batch, Table V global batch, the paper's shapes on A, B, C.
TABLE_V = [
    ("vgg", "vgg-19-pbs-32.txt", 32, 2048, ("DP", "DP", "15:1")),
    ("gnmt", "gnmt-16-pbs-64.txt", 64, 1024, ("8:8", "8:8", "straight")),
    ("bert", "bert-48-pbs-2.txt", 2, 64, ("8:8", "straight", "straight")),
    ("xlnet", "xlnet-36-pbs-1.txt", 1, 128, ("8:8", "8:8", "straight")),
    ("amoeba", "amoeba-36-pbs-1.txt", 1, 128, ("8:8", "11:5", "11:5")),
]
SHIPPED_ETHERNET = 3e9      # bytes/s, as compiled into the HPGO 0.9.2 wheel
CONFIG_C_ETHERNET = 1.25e9  # 10 Gbit/s, the paper's config C


def shape(stages):
    replicas = [len(devices) for (_, _, _, devices) in stages]
    if len(replicas) == 1:
        return "DP"
    if all(r == 1 for r in replicas):
        return "straight"
    return ":".join(str(r) for r in replicas)


def patched_extension(directory):
    """Copy HPGO's extension into `directory` with the Ethernet bandwidth set to config C's."""
    origin = importlib.util.find_spec("HPGO").origin
    data = bytearray(open(origin, "rb").read())
    old, new = struct.pack("<d", SHIPPED_ETHERNET), struct.pack("<d", CONFIG_C_ETHERNET)
    count = data.count(old)
    if count != 1:
        raise SystemExit("%s: expected the Ethernet constant %g exactly once, found it %d times; "
                         "this script knows HPGO 0.9.2 only" % (origin, SHIPPED_ETHERNET, count))
    at = data.find(old)
    data[at:at + 8] = new
    with open(os.path.join(directory, os.path.basename(origin)), "wb") as out:
        out.write(data)


def run_one(profile, pbs, gbs, config):
    """Plan one cell in this process and print `shape|split|speedup|seconds`."""
    import io
    import contextlib
    import HPGO
    seps = [8, 16] if config == "A" else list(range(1, 17))
    start = time.time()
    # HPGO prints every graph node while importing; keep our output to the result line.
    with contextlib.redirect_stdout(io.StringIO()):
        conductor = HPGO.conductor_from_torch_graph_and_seps(profile, pbs, gbs, seps)
        speedup, stages = conductor.py_orchestrate()
    split = [last - first for (first, last, _, _) in stages]
    print("%s|%s|%.3f|%.1f" % (shape(stages), split, speedup, time.time() - start))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", default=DEFAULT_PROFILES)
    parser.add_argument("--models", default="", help="comma list of vgg,gnmt,bert,xlnet,amoeba")
    parser.add_argument("--one", nargs=4, metavar=("PROFILE", "PBS", "GBS", "CONFIG"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        profile, pbs, gbs, config = args.one
        return run_one(profile, int(pbs), int(gbs), config)

    wanted = set(filter(None, args.models.split(",")))
    patched_dir = tempfile.mkdtemp(prefix="hpgo-config-c-")
    try:
        patched_extension(patched_dir)
        print("| model | cfg | paper | HPGO 0.9.2 | split (HPGO states) | HPGO speedup | s |")
        print("|---|---|---|---|---|---|---|")
        matches = total = 0
        for key, filename, pbs, gbs, paper in TABLE_V:
            if wanted and key not in wanted:
                continue
            for config, paper_shape in zip("ABC", paper):
                env = dict(os.environ)
                if config == "C":
                    env["PYTHONPATH"] = patched_dir + os.pathsep + env.get("PYTHONPATH", "")
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--one",
                     os.path.join(args.profiles, filename), str(pbs), str(gbs), config],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    universal_newlines=True)
                lines = done.stdout.strip().splitlines()
                if done.returncode != 0 or not lines:
                    raise SystemExit("HPGO failed on %s %s:\n%s" % (filename, config,
                                                                   done.stderr[-2000:]))
                got, split, speedup, seconds = lines[-1].split("|")
                total += 1
                matches += got == paper_shape
                print("| %s | %s | %s | %s | %s | %s | %s |" % (
                    filename, config, paper_shape, got, split, speedup, seconds), flush=True)
        print("HPGO matches the paper's shape in %d of %d cells" % (matches, total))
    finally:
        shutil.rmtree(patched_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
