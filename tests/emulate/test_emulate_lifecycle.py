"""`dapple emulate`: ranks get horovodrun's layout inside their hosts' namespaces, the job's
status is the first failing rank's, and whatever ends the job (success, a failing or killed
rank, SIGTERM to the launcher) no namespace, hosts file or rank process is left behind.

The rank programs here are a few lines of Python (no TensorFlow), so each run takes seconds."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from emulaterun import emulate, leftovers
from tests.paths import REPO

PY = sys.executable

REPORT_LAYOUT = """
import json, os, socket
keys = ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER",
        "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_IFACE", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
        "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"]
print("LAYOUT " + json.dumps({"env": {k: os.environ.get(k) for k in keys},
                              "cpus": len(os.sched_getaffinity(0)),
                              "hostname_is": socket.gethostbyname(socket.gethostname())}))
"""

# rank -> (host name, local rank, cross rank, the machine's hostname resolves to): as
# `horovodrun -H host0:2,host1:2` numbers them, host by host
LAYOUT_2X2 = {
    0: ("host0", "0", "0", "10.77.0.1"),
    1: ("host0", "1", "0", "10.77.0.1"),
    2: ("host1", "0", "1", "10.77.0.2"),
    3: ("host1", "1", "1", "10.77.0.2"),
}

# Every rank prints its pid, then: rank FAIL_RANK does ACTION, the others sleep 10 minutes.
FAIL_ONE = """
import os, signal, sys, time
rank = int(os.environ["HOROVOD_RANK"])
print("PID", os.getpid(), flush=True)
time.sleep(1.0)
if rank == {rank}:
    {action}
time.sleep(600)
"""


def pids(result):
    return [int(line.split()[-1]) for line in result.output.splitlines()
            if "<stdout>:PID " in line]


def assert_all_gone(result, ranks):
    assert leftovers(result) == [], result.output[-2000:]
    found = pids(result)
    assert len(found) == ranks, result.output[-2000:]
    for pid in found:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ranks_get_the_horovodrun_layout_and_nothing_is_left(can_emulate):
    result = emulate("2x2,net=100Mbps", [PY, "-c", REPORT_LAYOUT], timeout=60)
    assert result.returncode == 0, result.output[-3000:]
    reports = {r: json.loads(t) for r, t in result.results("LAYOUT").items()}
    assert sorted(reports) == [0, 1, 2, 3], result.output
    for rank, (host, local_rank, cross_rank, address) in LAYOUT_2X2.items():
        rep = reports[rank]
        assert rep["env"] == {
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": local_rank,
            "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": cross_rank,
            "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": host, "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.77.0.1", "OMP_NUM_THREADS": "1",
            "TF_NUM_INTRAOP_THREADS": "1"}, rank
        assert rep["hostname_is"] == address
        if shutil.which("taskset"):
            assert rep["cpus"] == 1              # pinned
    assert leftovers(result) == []


def test_the_job_status_is_the_failing_ranks_and_the_others_are_ended(can_emulate):
    program = FAIL_ONE.format(rank=2, action="sys.exit(3)")
    result = emulate("2x2,net=100Mbps", [PY, "-c", program], timeout=60)
    assert result.returncode == 3, result.output[-3000:]
    assert "dapple emulate: rank 2 (host 1) exited with status 3; ending the other ranks" \
        in result.output
    assert result.seconds < 30
    assert_all_gone(result, 4)


def test_a_killed_rank_ends_the_job_within_seconds(can_emulate):
    program = FAIL_ONE.format(rank=1, action="os.kill(os.getpid(), signal.SIGKILL)")
    result = emulate("2x2,net=100Mbps", [PY, "-c", program], timeout=60)
    assert result.returncode == 137, result.output[-3000:]
    assert "dapple emulate: rank 1 (host 0) was killed by SIGKILL" in result.output
    assert result.seconds < 30
    assert_all_gone(result, 4)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_ends_every_rank_and_tears_down(can_emulate, signum):
    """SIGINT is Ctrl-C's signal (the ranks lead their own sessions: only the launcher gets
    it from a terminal, and ends them)."""
    program = FAIL_ONE.format(rank=-1, action="pass")
    result = emulate("2x1,net=100Mbps", [PY, "-c", program], timeout=60, signal_after=4,
                     signum=signum)
    assert result.returncode == 128 + signum, result.output[-3000:]
    assert f"dapple emulate: received {signum.name}; ending all ranks" in result.output
    assert_all_gone(result, 2)


def test_bad_commands_are_refused_before_anything_is_built(can_emulate):
    from dapple.emulate import resolve_program
    from dapple.emulate_spec import EmulateError
    with pytest.raises(EmulateError, match="nothing to run: put the command after `--`"):
        resolve_program([])
    result = emulate("2x1,net=100Mbps", ["no-such-program-x"])
    assert result.returncode == 2
    assert "dapple emulate: cannot run 'no-such-program-x'" in result.output
    assert "namespaces" not in result.output


def test_without_root_or_iproute2_it_says_what_is_missing(monkeypatch):
    from dapple import emulated_network
    from dapple.emulate_spec import EmulateError
    monkeypatch.setattr(emulated_network.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(emulated_network.shutil, "which", lambda name: None)
    with pytest.raises(EmulateError) as e:
        emulated_network.check_prerequisites()
    message = str(e.value)
    assert "missing: root" in message and "the `ip` command" in message
    assert "the `tc` command" in message and "iproute2" in message


def test_the_emulate_command_never_imports_tensorflow():
    """It only starts processes: TensorFlow's seconds of start-up and memory stay in the
    ranks."""
    code = ("import sys; sys.argv = ['dapple', 'emulate']\n"
            "import dapple, dapple.cli, dapple.commands.emulate, dapple.emulate\n"
            "from dapple.emulate import host_assignments, rank_environment\n"
            "from dapple.emulate_spec import parse_emulated_cluster\n"
            "slots = host_assignments(parse_emulated_cluster('2x1,net=1Gbps'))\n"
            "rank_environment(slots[1], '10.77.0.1', 1234, 1)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
