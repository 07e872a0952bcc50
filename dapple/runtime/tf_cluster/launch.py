"""`dapple launch --runtime=tensorflow`: a server per slot, the training script once, teardown.

    dapple launch --runtime=tensorflow --plan=plan.json --hosts=localhost:3 -- python train.py

* One task per slot, hosts in `--hosts` order (checked against the plan as for horovodrun:
  `dapple.runtime.launch.hosts_for_plan`), task t holding plan device t; with
  `--group_devices`, one task per host holding all its slots' devices (plan devices numbered
  host by host, as before), so transfers inside a host are device copies in one process. Task
  0 is the chief: the training script itself, run once, on this machine (so the first host
  must be this one). Every other task is a `tf.distribute.Server`
  (`dapple.runtime.tf_cluster.server`): a subprocess here, or over `ssh -tt` on another host
  (as horovodrun reaches hosts; the remote end is hung up, so its server ends, when the
  launcher ends the ssh).
* The chief's environment describes the cluster (`DAPPLE_TF_CLUSTER`, with `DAPPLE_PLAN`);
  `import dapple` connects to it and `PipelinedModel(model, plan)` picks this runtime.
* The job ends when the script ends (with its status), when a server exits (the task is named
  and the status is non-zero), or on SIGINT/SIGTERM (128 + the signal); then every process is
  ended, each with its whole process group (`dapple.runtime.rank_processes.end_ranks`). Output lines
  are prefixed `[task]<stdout>:` as horovodrun prefixes ranks'.
* `run_job` is the job itself (start, wait until serving, watch, teardown), shared with
  `dapple emulate --runtime=tensorflow` (`dapple.emulate`), which starts the same tasks inside
  emulated hosts' network namespaces. A task that hangs without exiting is the chief's to
  notice (`dapple.runtime.tf_cluster.watchdog`).

Plain Python (no TensorFlow import), so it is testable anywhere.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys
import time
from contextlib import nullcontext
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

from dapple.runtime.launch import Hosts, LaunchError, Ssh, hosts_for_plan
from dapple.runtime.rank_processes import (POLL_SECONDS, Rank, StopFlag, describe_exit, end_ranks,
                                   exit_status, start_rank)
from dapple.runtime.tf_cluster.cluster import ENV_CLUSTER, ENV_TASK_DEVICES
from planner.formats.plan import Plan

LOCAL_NAMES = ("localhost", "127.0.0.1", socket.gethostname())
DEFAULT_PORT = 2222          # remote hosts: task slots use ports DEFAULT_PORT + slot
READY_SECONDS = 120.0        # how long servers may take to accept connections
ENV_DEVICES = "DAPPLE_NUM_CPU_DEVICES"     # a task's own devices (`dapple.devices`)


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def task_addresses(hosts: Hosts, port: Optional[int] = None, group_devices: bool = False
                   ) -> List[Tuple[int, str]]:
    """(host index, host:port) of every task, host by host: one per slot, or one per host when
    `group_devices`; free ports on this machine, `port + slot` on other hosts."""
    if not is_local(hosts[0][0]):
        raise LaunchError(f"the training script runs here as task 0, so the first host must be "
                          f"this machine (localhost or {socket.gethostname()}), not "
                          f"{hosts[0][0]!r}: list this machine first in --hosts")
    out = []
    for h, (name, slots) in enumerate(hosts):
        for slot in range(1 if group_devices else slots):
            number = free_port() if is_local(name) and port is None else (
                (port or DEFAULT_PORT) + slot)
            out.append((h, f"{'localhost' if is_local(name) else name}:{number}"))
    return out


def task_devices(hosts: Hosts, group_devices: bool) -> List[int]:
    """Devices of each task of `task_addresses(hosts, group_devices=...)`."""
    return [slots for _, slots in hosts] if group_devices else [1] * sum(n for _, n in hosts)


def server_argv(addresses: Sequence[str], task: int, devices: int = 1,
                python: str = sys.executable) -> List[str]:
    return [python, "-m", "dapple.runtime.tf_cluster.server",
            f"--cluster={json.dumps(list(addresses))}", f"--task={task}", f"--devices={devices}"]


def remote(host: str, argv: Sequence[str], env: Dict[str, str], ssh: Ssh = Ssh()) -> List[str]:
    """`argv` on `host` over ssh, in this directory, with `env`; `-tt` so that ending the ssh
    hangs up the remote end and its server. No prompt can hold the launch, and a host not yet
    in known_hosts is accepted, as horovodrun's ssh does."""
    line = " ".join([f"cd {shlex.quote(os.getcwd())} &&", "env"]
                    + [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
                    + [shlex.quote(a) for a in argv])
    return (["ssh", "-tt", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
            + ssh.ssh_options() + [host, line])


SSH_FAILED = 255        # ssh's own status when it cannot connect or log in


def ended(task: Rank) -> str:
    """How a task's process ended, and what to check when it was an ssh that could not reach
    its host."""
    code, argv = task.process.returncode, task.process.args
    how = describe_exit(code)
    if code != SSH_FAILED or not argv or os.path.basename(argv[0]) != "ssh":
        return how
    host = argv[-2]                 # `remote` puts the host before the line
    return (f"{how}: ssh could not reach {host}; check that `ssh {host}` logs in without a "
            f"prompt, or give --ssh_port / --ssh_identity_file")


def wait_until_serving(servers: Sequence[Rank], addresses: Sequence[str], stop: StopFlag,
                       seconds: float = READY_SECONDS) -> Optional[str]:
    """None once every server accepts connections; else why not (one exited, or time)."""
    deadline = time.monotonic() + seconds
    waiting = list(servers)
    while waiting:
        for r in list(waiting):
            if r.process.poll() is not None:
                return f"the server of task {r.rank} {ended(r)}"
            host, _, port = addresses[r.rank].rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    waiting.remove(r)
            except OSError:
                pass
        if stop.signum is not None:
            return f"received {signal.Signals(stop.signum).name}"
        if waiting and time.monotonic() > deadline:
            return (f"tasks {[r.rank for r in waiting]} were not serving after {seconds:g} s")
        if waiting:
            time.sleep(0.2)
    return None


def watch(chief: Rank, servers: Sequence[Rank], stop: StopFlag, say: Callable[[str], None]
          ) -> int:
    """The job's status once it ends (see the module doc); ends every process first."""
    everyone = [chief] + list(servers)
    try:
        while True:
            if chief.process.poll() is not None:
                return exit_status(chief.process.returncode)
            dead = [r for r in servers if r.process.poll() is not None]
            if dead:
                say(f"task {dead[0].rank} (host {dead[0].host}, a tf.distribute.Server) "
                    f"{ended(dead[0])}; ending the job")
                return exit_status(dead[0].process.returncode) or 1
            if stop.signum is not None:
                say(f"received {signal.Signals(stop.signum).name}; ending every task")
                return 128 + stop.signum
            time.sleep(POLL_SECONDS)
    finally:
        end_ranks(everyone)


def run(plan: Optional[Plan], program: Sequence[str], hosts: Optional[Hosts],
        env: Dict[str, str], say: Callable[[str], None], port: Optional[int] = None,
        group_devices: bool = False, ssh: Ssh = Ssh()) -> int:
    """Start the servers, run `program` as the chief, tear everything down; its status. No plan:
    a task per slot of `hosts` (for a program that needs none, as `dapple topology`).
    `group_devices`: a task per host, holding its slots' devices."""
    if not program:
        raise LaunchError("nothing to run: put the training command after `--`, as in "
                          "`dapple launch --runtime=tensorflow --plan=plan.json -- python "
                          "train.py`")
    chosen = hosts_for_plan(plan, hosts) if plan is not None else list(hosts or [])
    tasks = task_addresses(chosen, port, group_devices)
    devices = task_devices(chosen, group_devices)
    base = job_environment(env)

    def server_command(task: int, host: int, argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
        if is_local(chosen[host][0]):
            return argv, dict(base)
        return remote(chosen[host][0], argv, dict(env, **{ENV_DEVICES: str(devices[task])}),
                      ssh), base

    stop = StopFlag()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_job([a for _, a in tasks], [h for h, _ in tasks], server_command,
                       list(program), base, stop, say, devices=devices)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def job_environment(env: Dict[str, str]) -> Dict[str, str]:
    """This process's environment with `env` on top, without a cluster of its own."""
    base = dict(os.environ)
    base.update(env)
    base.pop(ENV_CLUSTER, None)
    return base


ServerCommand = Callable[[int, int, List[str]], Tuple[List[str], Dict[str, str]]]


def run_job(addresses: Sequence[str], task_hosts: Sequence[int], server_command: ServerCommand,
            chief_argv: List[str], base: Dict[str, str], stop: StopFlag,
            say: Callable[[str], None], probing: Callable[[], ContextManager] = nullcontext,
            devices: Optional[Sequence[int]] = None) -> int:
    """Start tasks 1.. (`server_command(task, host, server argv)` gives the argv and
    environment that start it where it belongs), wait until they accept connections (made
    inside `probing()`: e.g. a network namespace that reaches them), run `chief_argv` as task
    0 with the cluster in its environment, and watch (see the module doc). Task t holds
    `devices[t]` devices (default one each). Ends every process it started, whatever happens;
    the job's status."""
    devices = list(devices) if devices is not None else [1] * len(addresses)
    servers: List[Rank] = []
    try:
        for t in range(1, len(addresses)):
            argv, task_env = server_command(t, task_hosts[t],
                                            server_argv(addresses, t, devices[t]))
            servers.append(start_rank(t, task_hosts[t], argv,
                                      dict(task_env, **{ENV_DEVICES: str(devices[t])})))
        with probing():
            why = wait_until_serving(servers, addresses, stop)
        if why is not None:
            say(f"{why}; ending every task")
            end_ranks(servers)
            return 128 + stop.signum if stop.signum else 1
        say(f"tasks {json.dumps(list(addresses))} serving; running the script as task 0")
        chief = start_rank(0, task_hosts[0], chief_argv,
                           dict(base, **{ENV_CLUSTER: json.dumps(list(addresses)),
                                         ENV_TASK_DEVICES: json.dumps(devices),
                                         ENV_DEVICES: str(devices[0])}))
        return watch(chief, servers, stop, say)
    except BaseException:
        end_ranks(servers)
        raise
