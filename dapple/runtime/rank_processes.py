"""The processes of one job's ranks: started, their output streamed, watched, and ended.

Output lines are prefixed as horovodrun prefixes them, `[3]<stdout>:...` and `[3]<stderr>:...`,
so scripts and tests read either launcher's output the same way. Each rank leads its own
process group (a new session), so a terminal's Ctrl-C reaches only the launcher, which then
ends every rank's whole group itself: SIGTERM, then SIGKILL after a grace period.

A job ends when every rank has exited, when the first rank fails (the others are ended; the
job's status is the failing rank's, 128 + N for a rank killed by signal N), or when `stop` is
set (a signal to the launcher).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

GRACE_SECONDS = 3.0       # between SIGTERM and SIGKILL when ending ranks
POLL_SECONDS = 0.05


@dataclass
class Rank:
    rank: int
    host: int
    process: subprocess.Popen
    readers: List[threading.Thread] = field(default_factory=list)


@dataclass
class JobOutcome:
    status: int                          # the job's exit status
    failed_rank: Optional[int] = None    # the first rank that failed, if one did
    failed_host: Optional[int] = None
    signal_received: Optional[int] = None


def exit_status(returncode: int) -> int:
    """A Popen returncode as a shell would report it: -9 -> 137."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


class _Sink:
    """stdout or stderr of the launcher, written one whole line at a time."""
    lock = threading.Lock()

    def __init__(self, stream):
        self.stream = stream

    def write_line(self, text: str) -> None:
        with self.lock:
            self.stream.write(text)
            if not text.endswith("\n"):
                self.stream.write("\n")
            self.stream.flush()


def _pump(pipe, prefix: str, sink: _Sink) -> None:
    for raw in iter(pipe.readline, b""):
        sink.write_line(prefix + raw.decode("utf-8", errors="replace"))
    pipe.close()


def start_rank(rank: int, host: int, argv: Sequence[str], env: Dict[str, str]) -> Rank:
    process = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    started = Rank(rank, host, process)
    for pipe, name, stream in ((process.stdout, "stdout", sys.stdout),
                               (process.stderr, "stderr", sys.stderr)):
        reader = threading.Thread(target=_pump, args=(pipe, f"[{rank}]<{name}>:", _Sink(stream)),
                                  daemon=True, name=f"rank{rank}-{name}")
        reader.start()
        started.readers.append(reader)
    return started


def _signal_group(rank: Rank, signum: int) -> None:
    try:
        os.killpg(rank.process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def end_ranks(ranks: Sequence[Rank], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after `grace` seconds."""
    for r in ranks:
        _signal_group(r, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(r.process.poll() is None for r in ranks):
        time.sleep(POLL_SECONDS)
    for r in ranks:
        _signal_group(r, signal.SIGKILL)        # also children a finished rank left behind
        if r.process.poll() is None:
            r.process.kill()
    for r in ranks:
        r.process.wait()
        for reader in r.readers:
            reader.join(timeout=2.0)


def watch(ranks: Sequence[Rank], stop: "StopFlag", say) -> JobOutcome:
    """Wait for the job's end (see the module doc); ends the ranks before returning."""
    exited: List[Rank] = []                      # in the order their exits were seen
    outcome = None
    try:
        while outcome is None:
            for r in ranks:
                if r not in exited and r.process.poll() is not None:
                    exited.append(r)
            failed = [r for r in exited if r.process.returncode != 0]
            if stop.signum is not None:
                say(f"received {signal.Signals(stop.signum).name}; ending all ranks")
                outcome = JobOutcome(status=128 + stop.signum, signal_received=stop.signum)
            elif failed:
                first = failed[0]
                code = first.process.returncode
                say(f"rank {first.rank} (host {first.host}) {describe_exit(code)}; ending the "
                    f"other ranks")
                outcome = JobOutcome(status=exit_status(code), failed_rank=first.rank,
                                     failed_host=first.host)
            elif len(exited) == len(ranks):
                outcome = JobOutcome(status=0)
            else:
                time.sleep(POLL_SECONDS)
    finally:
        running = [r for r in ranks if r not in exited]
        end_ranks(ranks)
    if outcome.status != 0 and exited:
        # Every rank that ended by itself, in order, says more than the first alone: a
        # failing rank and the peer whose collective it broke often exit moments apart.
        by_itself = ", ".join(f"{r.rank} ({describe_exit(r.process.returncode)})"
                              for r in exited)
        ended = ", ".join(str(r.rank) for r in running)
        say(f"ranks that ended by themselves, in order: {by_itself}"
            + (f"; ended by the launcher: {ended}" if ended else ""))
    return outcome


class StopFlag:
    """Set by a signal handler: the number of the first signal received."""

    def __init__(self):
        self.signum: Optional[int] = None

    def __call__(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
