"""`dapple launch --runtime=tensorflow` ends every process it started: after the script
succeeds (status 0), fails (its status, 1), is interrupted (Ctrl-C: 130), and when a server
dies mid-training (non-zero within 60 s, naming the task); a server on another host is
started over ssh and ended with the job. Tests never assert times beyond a deadline that a hang
would exceed."""
import os
import re
import signal
import socket

import pytest

from dapple.runtime.tf_cluster.launch import DEFAULT_PORT
from tfrun import (REPO, cluster_of, finish, plan_file, processes_with, start,
                   stop_server_and_finish, wait_for)

pytestmark = pytest.mark.horovod


def chief_pid(output: str) -> int:
    return int(re.search(r"chief pid (\d+)", output).group(1))


def assert_nothing_left(result):
    cluster = cluster_of(result)
    assert cluster is not None, result.output[-3000:]
    assert processes_with(f"--cluster={cluster}") == [], "a server outlived the launch"
    pid = chief_pid(result.output)
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read(
    ).lower(), "the chief outlived the launch"


def test_success_exits_0_and_ends_the_servers(tmp_path):
    result = finish(start(plan_file(tmp_path, 2), ["fault_task.py", "--mode=ok"]))
    assert result.returncode == 0, result.output[-3000:]
    assert "step 2 done" in result.output
    assert_nothing_left(result)


def test_a_failing_script_gives_its_status_and_ends_the_servers(tmp_path):
    result = finish(start(plan_file(tmp_path, 2), ["fault_task.py", "--mode=fail"]))
    assert result.returncode == 1, result.output[-3000:]
    assert "injected failure in step 2" in result.output
    assert_nothing_left(result)


def test_ctrl_c_ends_every_process(tmp_path):
    proc = start(plan_file(tmp_path, 2), ["fault_task.py", "--mode=loop"])
    seen = wait_for(proc, "step 1 done")
    proc.send_signal(signal.SIGINT)            # a terminal's Ctrl-C reaches the launcher
    result = finish(proc, timeout=60)
    result.output = seen + result.output
    assert result.returncode == 130, result.output[-3000:]
    assert "received SIGINT" in result.output
    assert_nothing_left(result)


def test_a_killed_server_ends_the_job_naming_its_task(tmp_path):
    proc = start(plan_file(tmp_path, 3), ["fault_task.py", "--mode=loop",
                                                     "--replicas=2,1"])
    seen = wait_for(proc, "step 1 done")
    cluster = re.search(r"tasks (\[.*?\]) serving", seen).group(1)
    servers = processes_with(f"--cluster={cluster} --task=2")
    assert len(servers) == 1, servers
    os.kill(servers[0], signal.SIGKILL)
    result = finish(proc, timeout=60)          # a hang fails here
    result.output = seen + result.output
    assert result.returncode not in (0, None), result.output[-3000:]
    assert "task 2" in result.output and "SIGKILL" in result.output, result.output[-3000:]
    assert_nothing_left(result)


def test_a_hung_server_ends_the_job_within_60_s_naming_its_task(tmp_path):
    """SIGSTOP keeps the server's process and port: only its silence tells. The chief's
    watchdog (`dapple.runtime.tf_cluster.watchdog`, default 30 s) names it and exits 75."""
    proc = start(plan_file(tmp_path, 3), ["fault_task.py", "--mode=loop", "--replicas=2,1"])
    seen = wait_for(proc, "step 1 done")
    cluster = re.search(r"tasks (\[.*?\]) serving", seen).group(1)
    result, seconds = stop_server_and_finish(proc, seen, f"--cluster={cluster} --task=2")
    assert result.returncode == 75, result.output[-3000:]
    print(f"the job ended {seconds:.1f} s after the stop")
    assert seconds < 60
    assert re.search(r"\[0\]<stderr>:dapple: task 2 \(localhost:\d+\) has not answered a status "
                     r"request for \d+ s", result.output), result.output[-3000:]
    assert_nothing_left(result)


STAND_IN_SSH = """#!/bin/sh
# ssh [options] HOST LINE, run here as a fresh ssh session would: in HOME, with no environment
# but HOME and PATH
echo "$*" >> {log}
while [ "$1" = "-tt" ] || [ "$1" = "-o" ] || [ "$1" = "-p" ] || [ "$1" = "-i" ]; do
    [ "$1" = "-tt" ] || shift
    shift
done
shift                                   # the host
cd "$HOME" && exec env -i HOME="$HOME" PATH="$PATH" /bin/sh -c "$*"
"""


def with_ssh(tmp_path, script: str) -> dict:
    """The launcher's environment with `script` as the `ssh` first on its PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(script)
    (bin_dir / "ssh").chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_a_server_on_another_host_starts_over_ssh_and_ends_with_the_job(tmp_path):
    """127.0.0.2 is this machine's loopback but not a name the launcher takes for this machine,
    so task 1 is started with the command line a real host would get over `ssh -tt`; a
    stand-in `ssh` runs that line here, from HOME, with no environment but HOME and PATH."""
    with socket.socket() as probe:      # task 1 listens on every interface, at 2222 + slot
        try:
            probe.bind(("", DEFAULT_PORT))
        except OSError:
            pytest.fail(f"port {DEFAULT_PORT} is taken: the other host's task needs it")
    log = tmp_path / "ssh.log"
    result = finish(start(plan_file(tmp_path, 2), ["fault_task.py", "--mode=ok"],
                          env=with_ssh(tmp_path, STAND_IN_SSH.format(log=log)),
                          hosts="localhost:1,127.0.0.2:1", launch_args=["--ssh_port=2022"]))
    assert result.returncode == 0, result.output[-3000:]
    assert "step 2 done" in result.output
    assert f"127.0.0.2:{DEFAULT_PORT}" in cluster_of(result)
    (line,) = log.read_text().splitlines()
    assert f" -p 2022 127.0.0.2 cd {REPO} && env " in line and "--task=1" in line, line
    assert_nothing_left(result)


def test_a_host_ssh_cannot_reach_is_named_with_what_to_check(tmp_path):
    refusing = ('#!/bin/sh\necho "ssh: connect to host 127.0.0.2 port 22: Connection refused" '
                '>&2\nexit 255\n')
    result = finish(start(plan_file(tmp_path, 2), ["fault_task.py", "--mode=ok"],
                          env=with_ssh(tmp_path, refusing),
                          hosts="localhost:1,127.0.0.2:1"), timeout=120)
    assert result.returncode == 1, result.output[-3000:]
    assert ("the server of task 1 exited with status 255: ssh could not reach 127.0.0.2; "
            "check that `ssh 127.0.0.2` logs in without a prompt") in result.output
    assert "step 0 done" not in result.output
