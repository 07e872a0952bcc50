"""The chief's watchdog over the other tasks: a task that stops answering ends the job.

A server that dies ends the job through its launcher, which sees the process exit. One that
hangs (stopped, livelocked, its host unreachable) keeps its process and TCP port, and the
chief's step would wait on its Send/Recv forever. So the chief (`connect_from_environment`)
starts a thread that asks every other task for its status (`WorkerService.GetStatus`, an empty
request a `tf.distribute.Server` answers from its worker's thread pool, without touching any
step) every PERIOD_SECONDS, one task after another. A task that has not answered for
`DAPPLE_TF_TASK_TIMEOUT_SECONDS` (default 30; 0 turns the watchdog off) is named on stderr and
the chief exits with status 75 (as the Horovod runtime's step watchdog); its launcher then ends
every task.

The probe is plain gRPC (grpcio, which TensorFlow itself depends on); nothing of TensorFlow is
patched or imported. Its requests are blocking calls, which this thread completes itself: a
future needs gRPC to start a polling thread, which Python refuses once the interpreter is ending,
and the request left behind makes closing its channel wait forever.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

ENV_TASK_TIMEOUT = "DAPPLE_TF_TASK_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_SECONDS = 30.0
PERIOD_SECONDS = 2.0
EXIT_STATUS = 75
GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def timeout_from_environment() -> float:
    raw = os.environ.get(ENV_TASK_TIMEOUT, "")
    if not raw:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise ValueError(f"{ENV_TASK_TIMEOUT}={raw!r}: expected seconds >= 0 (0 turns the "
                         f"watchdog over the cluster's tasks off)")
    return seconds


class TaskWatchdog:
    """Asks tasks 1.. of `addresses` for their status; calls `on_silent(task, address,
    seconds)` once when one has not answered for `timeout` seconds (the default ends the
    process)."""

    def __init__(self, addresses: Sequence[str], timeout: float,
                 on_silent: Optional[Callable[[int, str, float], None]] = None):
        import grpc
        self.addresses = list(addresses)
        self.timeout = timeout
        self.on_silent = on_silent or end_the_chief
        self._stop = threading.Event()
        # Straight to the task: a proxy from the environment has no business in a cluster.
        self._channels = {t: grpc.insecure_channel(a, options=[("grpc.enable_http_proxy", 0)])
                          for t, a in enumerate(self.addresses) if t > 0}
        self._calls = {t: c.unary_unary(GET_STATUS) for t, c in self._channels.items()}
        self.last_answer: Dict[int, float] = {t: time.monotonic() for t in self._calls}
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="dapple-task-watchdog")

    def start(self) -> "TaskWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for channel in self._channels.values():
            channel.close()                   # a pending request ends at once
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=PERIOD_SECONDS + 1)

    def _round(self) -> None:
        """One status request to every task in turn; their answers' times recorded."""
        deadline = min(PERIOD_SECONDS * 2, max(self.timeout / 2, 0.5))
        for t, call in self._calls.items():
            if self._stop.is_set():
                return
            asked = time.monotonic()
            try:
                call(b"", timeout=deadline)
                self.last_answer[t] = asked
            except Exception:       # grpc.RpcError: no answer in time, or no connection
                pass

    def silent(self, now: Optional[float] = None) -> List[int]:
        """Tasks that have not answered for longer than the timeout, longest silent first (a
        round slowed by tasks that do not answer may leave a live one's answer old too)."""
        now = time.monotonic() if now is None else now
        quiet = [t for t, seen in self.last_answer.items() if now - seen > self.timeout]
        return sorted(quiet, key=lambda t: self.last_answer[t])

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._round()
            if self._stop.is_set():
                return
            quiet = self.silent()
            if quiet:
                t = quiet[0]
                self.on_silent(t, self.addresses[t], time.monotonic() - self.last_answer[t])
                return
            self._stop.wait(max(0.0, PERIOD_SECONDS - (time.monotonic() - started)))


def end_the_chief(task: int, address: str, seconds: float) -> None:
    print(f"dapple: task {task} ({address}) has not answered a status request for "
          f"{seconds:.0f} s ({ENV_TASK_TIMEOUT}); it is stopped, hung or unreachable: ending "
          f"the job", file=sys.stderr, flush=True)
    os._exit(EXIT_STATUS)


_running: Optional[TaskWatchdog] = None


def watch_tasks(addresses: Sequence[str]) -> Optional[TaskWatchdog]:
    """Start the watchdog over `addresses` (task 0 is this process) unless turned off."""
    global _running
    timeout = timeout_from_environment()
    if timeout == 0 or len(addresses) < 2 or _running is not None:
        return _running
    _running = TaskWatchdog(addresses, timeout).start()
    atexit.register(_running.stop)       # no request in flight while the interpreter ends
    return _running
