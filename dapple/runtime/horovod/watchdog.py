"""No rank waits forever: a per-process deadline on every collective step.

Why our own: a rank blocked in a collective whose peers never submit it can wait
indefinitely, and Horovod's own stall check did not end such a job (docs/cluster.md, "Failures
and timeouts", says with which versions and how it was tried). A rank that *raises* is handled
by horovodrun (it terminates the others when one process exits non-zero); a rank that *hangs*
is what this catches.

A daemon thread checks the armed deadline; when a step overruns it, the rank prints which rank,
stage and step stalled and ends its process with exit status `STALL_EXIT_CODE`, and horovodrun
then terminates the remaining ranks. The deadline is `DAPPLE_STEP_TIMEOUT_SECONDS` (default
600 s per step; the first step of each compiled function also traces and compiles, so it gets
`DAPPLE_FIRST_STEP_TIMEOUT_SECONDS`, default 1800 s). `0` turns the watchdog off.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Optional

ENV_STEP_TIMEOUT = "DAPPLE_STEP_TIMEOUT_SECONDS"
ENV_FIRST_STEP_TIMEOUT = "DAPPLE_FIRST_STEP_TIMEOUT_SECONDS"
DEFAULT_STEP_TIMEOUT = 600.0
DEFAULT_FIRST_STEP_TIMEOUT = 1800.0
STALL_EXIT_CODE = 75


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 turns the watchdog off), got {value}")
    return value


class StepWatchdog:
    """`with watchdog.step("train step 3", first=False): ...` ends the process on overrun."""

    def __init__(self, who: str, timeout: Optional[float] = None,
                 first_timeout: Optional[float] = None, exit_fn=os._exit):
        self.who = who
        self.timeout = _seconds(ENV_STEP_TIMEOUT, DEFAULT_STEP_TIMEOUT) if timeout is None \
            else timeout
        self.first_timeout = (_seconds(ENV_FIRST_STEP_TIMEOUT, DEFAULT_FIRST_STEP_TIMEOUT)
                              if first_timeout is None else first_timeout)
        self._exit = exit_fn
        self._lock = threading.Lock()
        self._deadline: Optional[float] = None
        self._what = ""
        self._limit = 0.0
        self._thread: Optional[threading.Thread] = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                deadline, what, limit = self._deadline, self._what, self._limit
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(
                    f"dapple: {self.who}: {what} did not finish within {limit:g} s (a peer "
                    f"rank failed or stalled, or the step is slower than "
                    f"{ENV_STEP_TIMEOUT}); ending this rank so that horovodrun ends the job\n")
                sys.stderr.flush()
                sys.stdout.flush()
                self._exit(STALL_EXIT_CODE)
                return

    @contextlib.contextmanager
    def step(self, what: str, first: bool = False):
        limit = self.first_timeout if first else self.timeout
        if limit <= 0:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="dapple-watchdog",
                                            daemon=True)
            self._thread.start()
        with self._lock:
            self._deadline, self._what, self._limit = time.monotonic() + limit, what, limit
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None
