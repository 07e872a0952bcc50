"""Run a script under `dapple launch --runtime=tensorflow` on this machine, with a deadline.

Used by the TensorFlow-cluster tests, as `tests/dapple/runtime/horovod/hvdrun.py` runs horovodrun: processes
kept light (one intra-op thread, no GPU), the whole launcher's process group killed on timeout,
output lines prefixed `[task]<stdout>:` as horovodrun's (so `RunResult.results()` reads them).
The plan the launcher gets is the one the script builds (`plan_file`), for its slot count.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "horovod"))
from hvdrun import REPO, RunResult, light_rank_env  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
HOROVOD_SCRIPTS = os.path.join(REPO, "tests", "dapple", "runtime", "horovod", "scripts")


def script_path(name: str) -> str:
    for folder in (SCRIPTS, HOROVOD_SCRIPTS):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return name


def plan_file(tmp_path, devices: int) -> str:
    """A plan on `devices` devices (data parallel over the 5-layer test MLP): what the launch
    reads is only its device count; the script builds its own plan on as many devices."""
    from planner.formats.plan import straight_plan
    path = str(tmp_path / f"plan{devices}.json")
    straight_plan([], 5, 1, 24, replicas=[devices]).save(path)
    return path


def start(plan: str, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
          hosts: Optional[str] = None, launch_args: Sequence[str] = ()) -> subprocess.Popen:
    argv = [script_path(argv[0])] + list(argv[1:])
    command = [sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
               f"--plan={plan}"] + ([f"--hosts={hosts}"] if hosts else []) + list(
                   launch_args) + ["--", sys.executable] + argv
    return subprocess.Popen(command, cwd=REPO, env=light_rank_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> RunResult:
    start_time = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    return RunResult(proc.args, code, out, time.monotonic() - start_time)


def tf_launch(plan: str, argv: Sequence[str], timeout: float = 240,
              env: Optional[Dict[str, str]] = None, hosts: Optional[str] = None,
              launch_args: Sequence[str] = ()) -> RunResult:
    return finish(start(plan, argv, env, hosts, launch_args), timeout)


def wait_for(proc: subprocess.Popen, text: str, seconds: float = 180) -> str:
    """Read the launcher's output until `text` appears; what was read."""
    seen, deadline = "", time.monotonic() + seconds
    while text not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert text in seen, seen[-3000:]
    return seen


def stop_server_and_finish(proc: subprocess.Popen, seen: str, server: str,
                           timeout: float = 60) -> Tuple[RunResult, float]:
    """SIGSTOP the one process whose command line contains `server` (it hangs: process and
    port stay), then finish the launch (a hang fails at `timeout`). The result, with `seen`
    in front of its output, and the seconds from the stop to the end. A stopped process the
    launch left behind is killed, then reported."""
    found = processes_with(server)
    assert len(found) == 1, found
    stopped = time.monotonic()
    os.kill(found[0], signal.SIGSTOP)
    try:
        result = finish(proc, timeout)
    finally:
        left = processes_with(server)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == [], "the stopped server outlived the launch"
    result.output = seen + result.output
    return result, time.monotonic() - stopped


def cluster_of(result: RunResult) -> Optional[str]:
    """The tasks' addresses as the launcher printed them (`tasks [...] serving`)."""
    m = re.search(r"tasks (\[.*?\]) serving", result.output)
    return m.group(1) if m else None


def processes_with(text: str) -> list:
    """Pids of the processes whose command line contains `text`."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    line = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in line and int(name) != os.getpid():
                pids.append(int(name))
    return pids
