"""`planner`, `topology` and `reports` never import TensorFlow or Horovod (planner-only
installs), dependencies point one way (reports -> planner -> topology), and `dapple plan` and
`dapple simulate` run to the end, reports included, without TensorFlow. Checked in a fresh
interpreter."""
import subprocess
import sys

import pytest


def _import_all(packages, forbidden):
    """Import every module of `packages` in a fresh interpreter; fail if any of `forbidden`
    (top-level package names) was imported."""
    code = ("import sys, pkgutil, importlib\n"
            f"for name in {packages!r}:\n"
            "    pkg = importlib.import_module(name)\n"
            "    for m in pkgutil.iter_modules(pkg.__path__):\n"
            "        importlib.import_module(name + '.' + m.name)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})\n"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_planner_and_topology_do_not_import_tensorflow_or_horovod():
    _import_all(("topology", "planner"),
                ("tensorflow", "horovod", "keras", "reports", "graph_rewrite", "dapple"))


def test_reports_do_not_import_tensorflow_or_horovod():
    _import_all(("reports",), ("tensorflow", "horovod", "keras", "graph_rewrite", "dapple"))


def test_dapple_cli_dispatch_for_planner_commands_does_not_import_tensorflow():
    code = ("import sys; sys.argv = ['dapple', 'plan']\n"
            "import dapple, dapple.cli\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'horovod'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# Runs a `dapple` command as the console script does (argv[0] ends in "dapple", which
# `import dapple` reads), then fails (exit 3) if TensorFlow, Horovod or Keras was imported at
# any point of it.
_RUN_AND_CHECK = """
import atexit, os, sys
sys.argv[0] = os.path.join(os.path.dirname(sys.executable), 'dapple')
def check():
    bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'horovod', 'keras'))
    if bad:
        sys.stderr.write('imported: ' + ' '.join(bad[:8]) + '\\n')
        os._exit(3)
atexit.register(check)
from dapple.cli import run
run(['dapple'] + sys.argv[1:])
"""


@pytest.mark.parametrize("command", ["plan-text", "plan-json", "plan-html-report",
                                     "simulate-auto", "simulate-json"])
def test_planner_commands_run_to_the_end_without_tensorflow(tmp_path, command):
    from planner.formats.profile_readers import load_profile
    from planner.search.plan_space import plan_dapple
    from tests.planner.test_plan_cli import write_profile
    from topology import parse_topology
    profile, _ = write_profile(tmp_path)
    where = [f"--profile={profile}", "--topology=2x2,net=10Gbps"]
    plan = tmp_path / "plan.json"
    args = {
        "plan-text": ["plan", *where, "--global_batch_size=64", "--schedule=auto"],
        "plan-json": ["plan", *where, "--global_batch_size=64", "--format=json",
                      f"--output={plan}"],
        "plan-html-report": ["plan", *where, "--global_batch_size=64",
                             f"--report={tmp_path / 'report.html'}"],
        "simulate-auto": ["simulate", f"--plan={plan}", *where, "--schedule=auto"],
        "simulate-json": ["simulate", f"--plan={plan}", *where, "--format=json",
                          f"--output={tmp_path / 'timeline.png'}"],
    }[command]
    if command.startswith("simulate"):     # the plan it replays, from the library
        plan_dapple(load_profile(profile), parse_topology("2x2,net=10Gbps"), 64).save(str(plan))
    result = subprocess.run([sys.executable, "-c", _RUN_AND_CHECK, *args], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    wrote = {"plan-json": "plan.json", "plan-html-report": "report.html",
             "simulate-json": "timeline.png"}.get(command)
    assert (tmp_path / wrote).stat().st_size > 0 if wrote else result.stdout.strip()
