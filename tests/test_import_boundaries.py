"""`planner`, `topology` and `reports` never import TensorFlow or Horovod (planner-only
installs), dependencies point one way (reports -> planner -> topology), and `dapple plan` starts
without TensorFlow. Checked in a fresh interpreter."""
import subprocess
import sys


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
