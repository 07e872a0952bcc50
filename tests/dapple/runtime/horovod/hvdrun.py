"""Run a script under `horovodrun -np N -H localhost:N --gloo` on this machine, with a deadline.

Used by the multi-process tests. Ranks are kept light (one intra-op thread, no GPU, one logical
CPU device each) because the test machine has 2 cores. On timeout the whole process group that
horovodrun leads is killed, so a hung job never outlives its test.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")

LIGHT_RANK_ENV = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "2",
    "CUDA_VISIBLE_DEVICES": "",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "DAPPLE_NUM_CPU_DEVICES": "1",
    "PYTHONUNBUFFERED": "1",
    # A hang ends the job well before the test's own deadline, with the rank named.
    "DAPPLE_FIRST_STEP_TIMEOUT_SECONDS": "120",
    "DAPPLE_STEP_TIMEOUT_SECONDS": "60",
}


@dataclass
class RunResult:
    command: List[str]
    returncode: Optional[int]      # None when the deadline killed it
    output: str                    # stdout and stderr, interleaved as horovodrun prints them
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def results(self, tag: str = "DAPPLE_RESULT") -> Dict[int, str]:
        """`tag <json>` lines printed by ranks, by rank (horovodrun prefixes `[rank]<stdout>:`)."""
        found = {}
        for m in re.finditer(rf"^\[(\d+)\]<stdout>:{tag} (.*)$", self.output, re.M):
            found[int(m.group(1))] = m.group(2)
        return found


def light_rank_env(env: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, str]:
    """This process's environment with LIGHT_RANK_ENV, the repository on PYTHONPATH, and `env`
    on top (a None value removes that variable)."""
    run_env = dict(os.environ)
    run_env.update(LIGHT_RANK_ENV)
    run_env["PYTHONPATH"] = REPO + os.pathsep + run_env.get("PYTHONPATH", "")
    for key, value in (env or {}).items():
        if value is None:
            run_env.pop(key, None)
        else:
            run_env[key] = value
    return run_env


def horovodrun(np: int, argv: Sequence[str], timeout: float = 180,
               env: Optional[Dict[str, Optional[str]]] = None) -> RunResult:
    """`horovodrun -np np -H localhost:np --gloo <python> <argv...>`; argv[0] may be a script
    name in tests/dapple/runtime/horovod/scripts."""
    argv = list(argv)
    if not os.path.isabs(argv[0]) and os.path.exists(os.path.join(SCRIPTS, argv[0])):
        argv[0] = os.path.join(SCRIPTS, argv[0])
    command = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
               sys.executable] + argv
    run_env = light_rank_env(env)
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)     # horovodrun leads its own session
        rest, _ = proc.communicate()
        out = (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + rest
        code = None
    return RunResult(command, code, out, time.monotonic() - start)
