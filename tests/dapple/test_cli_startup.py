"""The `dapple` command line starts light: plan, simulate, the report and every help screen
import no TensorFlow (even though it is installed here), seen in the interpreter's own import
log (`-X importtime`) of the console script and of `python -m dapple.cli`; and
`dapple CMD --help` lists the flags CMD defines, with their help, read from its source."""
import os
import re
import subprocess
import sys

import pytest

import dapple.commands
from dapple.cli import COMMANDS
from tests.planner.test_plan_cli import write_profile

SCRIPT = os.path.join(os.path.dirname(sys.executable), "dapple")
LAUNCHERS = {"script": [SCRIPT], "module": ["-m", "dapple.cli"]}


def run(launcher, *args):
    """(completed process, top-level packages it imported)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *LAUNCHERS[launcher], *args],
                          capture_output=True, text=True, timeout=300)
    imported = {m.group(1).split(".")[0] for m in
                re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", done.stderr, re.M)}
    return done, imported


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_plan_simulate_and_report_import_no_tensorflow(launcher, tmp_path):
    pytest.importorskip("tensorflow")       # the point: installed, yet not imported
    path, _ = write_profile(tmp_path)
    common = [f"--profile={path}", "--topology=2x2,net=10Gbps"]
    runs = {
        "plan": ("plan", *common, "--global_batch_size=64", "--schedule=auto",
                 f"--output={tmp_path / 'plan.json'}"),
        "report": ("plan", *common, "--global_batch_size=64",
                   f"--report={tmp_path / 'report.html'}", "--format=json"),
        "simulate": ("simulate", f"--plan={tmp_path / 'plan.json'}", *common,
                     "--format=json"),
    }
    for name, args in runs.items():
        done, imported = run(launcher, *args)
        assert done.returncode == 0, (name, done.stderr[-2000:])
        assert "planner" in imported and "absl" in imported       # the log is read right
        assert "tensorflow" not in imported, name


def defined_flags(command):
    """(name, first words of its help) of each flag the command's module defines."""
    # Read, not imported: two command modules may define a flag of one name.
    with open(os.path.join(os.path.dirname(dapple.commands.__file__), f"{command}.py")) as f:
        source = f.read()
    return re.findall(r'DEFINE_\w+\(\s*"(\w+)",[^"]*"([^"]{1,25})', source)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_help_lists_its_own_flags(command):
    done, imported = run("script", command, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tensorflow" not in imported
    flags = defined_flags(command)
    assert flags, command
    for name, help_start in flags:
        assert f"--{name}" in done.stdout or f"--[no]{name}" in done.stdout, (command, name)
        assert " ".join(help_start.split()) in " ".join(done.stdout.split()), (command, name)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_dapple_help_lists_every_command_without_tensorflow(launcher):
    done, imported = run(launcher, "--help")
    assert done.returncode == 0
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s", done.stdout, re.M), command
    assert "tensorflow" not in imported
