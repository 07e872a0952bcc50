"""The planner-only install: `pip install .` in a fresh virtual environment brings the planner,
the reports and the `dapple plan` command, and no TensorFlow; `examples` is not installed."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(os.path.dirname(ROOT), "shared", "profiles", "dapple", "vgg-19-pbs-32.txt")


def run(*command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def planner_only_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("planner-only") / "venv"
    made = run(sys.executable, "-m", "venv", str(venv))
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    installed = run(python, "-m", "pip", "install", "--quiet", ROOT, env=env, cwd=str(venv))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def test_planner_only_install_plans_without_tensorflow(planner_only_venv, tmp_path):
    bin_dir = planner_only_venv / "bin"
    listed = run(str(bin_dir / "python"), "-m", "pip", "list", "--format=freeze")
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "dapple" in names and not {n for n in names if n.startswith("tensorflow")}, names
    out = tmp_path / "plan.json"
    planned = run(str(bin_dir / "dapple"), "plan", f"--profile={PROFILE}", "--topology=A",
                  "--global_batch_size=2048", f"--output={out}", cwd=str(tmp_path))
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert out.exists() and "Strategy" in planned.stdout


def test_only_dapples_packages_are_installed(planner_only_venv, tmp_path):
    probe = ("import importlib.util as u; "
             "print([m for m in ('topology', 'planner', 'reports', 'graph_rewrite', 'dapple', "
             "'dapple.commands', 'examples', 'tests') if u.find_spec(m) is None])")
    found = run(str(planner_only_venv / "bin" / "python"), "-c", probe, cwd=str(tmp_path))
    assert found.stdout.strip() == "['examples', 'tests']", found.stdout + found.stderr


def test_a_report_without_matplotlib_says_what_to_install(planner_only_venv, tmp_path):
    r = run(str(planner_only_venv / "bin" / "dapple"), "plan", f"--profile={PROFILE}",
            "--topology=A", "--global_batch_size=2048", f"--report={tmp_path / 'r.md'}",
            cwd=str(tmp_path))
    assert r.returncode == 2 and "pip install 'dapple[report]'" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
