"""`planner` and `topology` never import TensorFlow or Horovod (planner-only installs), and
`dapple plan` starts without them. Checked in a fresh interpreter."""
import subprocess
import sys


def test_planner_and_topology_do_not_import_tensorflow_or_horovod():
    code = ("import sys, planner, topology, planner.plan, planner.schedule, planner.costs\n"
            "import pkgutil, importlib\n"
            "for pkg in (planner, topology):\n"
            "    for m in pkgutil.iter_modules(pkg.__path__):\n"
            "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'horovod', 'keras'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dapple_cli_dispatch_for_planner_commands_does_not_import_tensorflow():
    code = ("import sys; sys.argv = ['dapple', 'plan']\n"
            "import dapple, dapple.cli\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'horovod'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
