"""`dapple emulate --host_cpus=C`: each host's processes together get at most C CPUs' time.

The control-group files are checked on fake roots (version 1 and 2); the limit itself on this
machine's groups, as root, by processes that would use both cores without it."""
import json
import os
import re
import subprocess
import sys

import pytest

from dapple.emulate_spec import EmulateError
from dapple.emulated_cpus import PERIOD_US, HostCpuShares, cpu_controller
from emulaterun import emulate, leftovers

PY = sys.executable


def fake_v1(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    return str(tmp_path)


def fake_v2(tmp_path, controllers="cpuset cpu io memory pids"):
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    return str(tmp_path)


def test_the_groups_go_where_the_machines_cpu_controller_is(tmp_path):
    v1, v2, none = tmp_path / "v1", tmp_path / "v2", tmp_path / "none"
    for d in (v1, v2, none):
        d.mkdir()
    assert cpu_controller(fake_v1(v1)) == str(v1 / "cpu")
    assert cpu_controller(fake_v2(v2)) == str(v2)
    assert cpu_controller(str(none)) is None
    assert cpu_controller(fake_v2(none, controllers="memory pids")) is None   # v2 without cpu


@pytest.mark.parametrize("version", [1, 2])
def test_each_host_gets_its_quota_of_the_period(tmp_path, version):
    root = fake_v1(tmp_path) if version == 1 else fake_v2(tmp_path)
    shares = HostCpuShares(num_hosts=2, cpus=1.5, prefix="dpl-7-", root=root)
    shares.create()
    quota = round(1.5 * PERIOD_US)
    for h in range(2):
        group = os.path.join(root, "cpu" if version == 1 else "", f"dpl-7-h{h}")
        if version == 1:
            assert open(f"{group}/cpu.cfs_quota_us").read() == str(quota)
            assert open(f"{group}/cpu.cfs_period_us").read() == str(PERIOD_US)
        else:
            assert open(f"{group}/cpu.max").read() == f"{quota} {PERIOD_US}"
    if version == 2:        # the root delegates the controller to its groups
        assert open(os.path.join(root, "cgroup.subtree_control")).read() == "+cpu"


def test_a_program_joins_its_hosts_group_then_runs(tmp_path):
    shares = HostCpuShares(num_hosts=2, cpus=1, prefix="dpl-7-", root=fake_v1(tmp_path))
    shares.create()
    run = subprocess.run(shares.exec_prefix(1) + [PY, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    procs = os.path.join(shares.groups[1], "cgroup.procs")
    assert open(procs).read().strip() == run.stdout.strip()     # exec kept the pid
    assert not os.path.exists(os.path.join(shares.groups[0], "cgroup.procs"))


def test_bad_shares_say_what_is_expected(tmp_path):
    with pytest.raises(EmulateError, match="expected the CPUs each host may use, > 0"):
        HostCpuShares(2, 0.0, "dpl-7-", root=fake_v1(tmp_path))
    with pytest.raises(EmulateError, match="needs Linux control groups' cpu controller"):
        HostCpuShares(2, 1.0, "dpl-7-", root=str(tmp_path / "nothing"))


# Two processes spin for SECONDS of wall time each: without a limit they use both cores.
BURN = """
import json, os, time
SECONDS = 1.5
start = time.monotonic()
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - start < SECONDS:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
t = os.times()
print("BURN " + json.dumps({"cpu": t.children_user + t.children_system,
                            "wall": time.monotonic() - start,
                            "cgroup": open("/proc/self/cgroup").read()}))
"""


def test_a_hosts_processes_use_at_most_its_cpus(can_emulate):
    if cpu_controller() is None:
        pytest.skip("no writable cpu control groups here (dapple emulate --host_cpus refuses)")
    result = emulate("2x1,net=1Gbps", [PY, "-c", BURN], timeout=120,
                     flags=["--host_cpus=0.5", "--pin=false"])
    assert result.returncode == 0, result.output[-3000:]
    burns = {r: json.loads(t) for r, t in result.results("BURN").items()}
    assert sorted(burns) == [0, 1], result.output[-3000:]
    for rank, burn in burns.items():
        assert f"h{rank}" in burn["cgroup"], burn["cgroup"]
        # Half a CPU over the wall time, with a period's slack: 2 unlimited spinners take 2x.
        assert burn["cpu"] <= 0.5 * burn["wall"] * 1.2 + 0.05, (rank, burn)
    assert leftovers(result) == []
    prefix = re.search(r"namespaces (dpl-\d+-)h0", result.output).group(1)
    left = [n for n in os.listdir(cpu_controller()) if n.startswith(prefix)]
    assert left == [], "a host's group outlived the run"
