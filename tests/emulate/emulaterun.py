"""Run `dapple emulate` from the tests, with a deadline, and say why emulation is impossible.

Ranks are kept light as in `tests/dapple/runtime/horovod/hvdrun.py` (its LIGHT_RANK_ENV). On timeout the
launcher's whole session is killed; its namespaces would then be left behind, which the tests
check for (`namespaces()` before and after).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, Optional, Sequence

from tests.dapple.runtime.horovod.hvdrun import REPO, SCRIPTS, RunResult, light_rank_env

DAPPLE = os.path.join(os.path.dirname(sys.executable), "dapple")


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def leftovers(result: RunResult):
    """Namespaces and /etc/netns folders of the run that printed `result` still present (its
    names start with the prefix it announced; other runs on the machine do not count)."""
    m = re.search(r"namespaces (dpl-\d+-)h0", result.output)
    assert m, "the launcher did not announce its namespaces:\n" + result.output[-2000:]
    prefix = m.group(1)
    folders = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    return ([n for n in namespaces() if n.startswith(prefix)] +
            [f"/etc/netns/{f}" for f in folders if f.startswith(prefix)])


def why_emulation_is_impossible() -> Optional[str]:
    """None when this machine can create network namespaces; else the reason, in words."""
    from dapple.emulated_network import missing_prerequisites
    missing = missing_prerequisites()
    if missing:
        return "cannot emulate a cluster here: missing " + "; ".join(missing)
    probe = f"dpl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def emulate(topology: str, program: Sequence[str], timeout: float = 180,
            env: Optional[Dict[str, str]] = None, signal_after: Optional[float] = None,
            signum: int = signal.SIGTERM, flags: Sequence[str] = ()) -> RunResult:
    """`dapple emulate --topology=topology [flags] -- program...`; a program starting with a
    script of tests/dapple/runtime/horovod/scripts runs it with this Python. `signal_after`
    sends the launcher `signum` after that many seconds."""
    start = time.monotonic()
    proc = start_emulate(topology, program, env, flags)
    command = proc.args
    try:
        if signal_after is not None:
            try:
                out, _ = proc.communicate(timeout=signal_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signum)
        out, _ = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        out = (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + rest
        code = None
    return RunResult(command, code, out, time.monotonic() - start)


def start_emulate(topology: str, program: Sequence[str], env: Optional[Dict[str, str]] = None,
                  flags: Sequence[str] = ()) -> subprocess.Popen:
    """The launcher of `emulate`, started (its output a text pipe, in a session of its own)."""
    program = list(program)
    if not os.path.isabs(program[0]) and os.path.exists(os.path.join(SCRIPTS, program[0])):
        program = [sys.executable, os.path.join(SCRIPTS, program[0])] + program[1:]
    command = [DAPPLE, "emulate", f"--topology={topology}"] + list(flags) + ["--"] + program
    return subprocess.Popen(command, cwd=REPO, env=light_rank_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
