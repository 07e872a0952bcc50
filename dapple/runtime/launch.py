"""The `horovodrun` command for a plan: one process per plan device, ranks host by host.

`dapple launch --plan=plan.json [--hosts=h1:8,h2:8] -- python train.py ...` prints, then runs:

    DAPPLE_PLAN=plan.json HOROVOD_DYNAMIC_PROCESS_SETS=1 ... \
        horovodrun -np 16 -H h1:8,h2:8 --gloo python train.py ...

* `-np` is the plan's device count; `-H` lists hosts in device order, because horovodrun numbers
  ranks host by host in `-H` order and rank r runs plan device r. Without `--hosts`, a plan
  made for one host (its `topology` has one entry in `devices_per_host`, or none) runs on
  `localhost`; a plan made for several hosts needs their names, with the slot counts the plan
  was made for (checked, so a plan for 8+8 devices is not silently run as 12+4).
* The environment carries `DAPPLE_PLAN` (scripts may read their plan from it), the step
  watchdog's deadlines (`dapple.runtime.horovod.watchdog`), and `HOROVOD_DYNAMIC_PROCESS_SETS=1`
  so that a script that calls `hvd.init()` itself can still get the plan's process sets.
  horovodrun passes the launching environment to every rank.
* Other hosts are reached over ssh; `Ssh` carries its port and identity file, given to
  horovodrun as `--ssh-port` and `--ssh-identity-file` (and to the TF runtime's own ssh).
* A plain `horovodrun -np N -H ... python train.py` works as well: `PipelinedModel` detects
  horovodrun and initializes Horovod itself; `dapple launch` only saves writing the numbers.

Plain Python (no TensorFlow or Horovod import), so it is testable anywhere.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from planner.schedules.actions import ScheduleError
from planner.formats.plan import Plan, PlanError
from planner.schedules.by_name import require_runtime_support

Hosts = List[Tuple[str, int]]
CONTROLLERS = ("gloo", "mpi")


class LaunchError(ValueError):
    """The launch cannot be built as asked; the message says what and how to fix it."""


@dataclass(frozen=True)
class Ssh:
    """How other hosts are reached, for either runtime: ssh's port and identity file
    (horovodrun's `--ssh-port` and `--ssh-identity-file`); None: ssh's own defaults."""
    port: Optional[int] = None
    identity_file: Optional[str] = None

    def __post_init__(self):
        if self.port is not None and not 0 < self.port < 65536:
            raise LaunchError(f"--ssh_port={self.port} is not a port: give 1 to 65535")
        if self.identity_file is not None and not os.path.isfile(self.identity_file):
            raise LaunchError(f"--ssh_identity_file={self.identity_file}: no such file")

    def ssh_options(self) -> List[str]:
        return self._options("-p", "-i")

    def horovodrun_options(self) -> List[str]:
        return self._options("--ssh-port", "--ssh-identity-file")

    def _options(self, port_flag: str, identity_flag: str) -> List[str]:
        return ([port_flag, str(self.port)] if self.port is not None else []) + (
            [identity_flag, self.identity_file] if self.identity_file is not None else [])


def parse_hosts(text: str) -> Hosts:
    """`h1:8,h2:8` -> [("h1", 8), ("h2", 8)]; a host without `:slots` has one slot (as in
    horovodrun)."""
    hosts: Hosts = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise LaunchError(f"--hosts={text!r} has an empty entry; write host:slots,host:slots")
        name, _, slots = part.partition(":")
        if not name:
            raise LaunchError(f"--hosts entry {part!r} has no host name")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            raise LaunchError(f"--hosts entry {part!r}: slots must be a whole number, as in "
                              f"{name}:8") from None
        if count < 1:
            raise LaunchError(f"--hosts entry {part!r}: a host needs at least one slot")
        if any(h == name for h, _ in hosts):
            raise LaunchError(f"--hosts names {name!r} twice; list each host once with its "
                              f"slot count")
        hosts.append((name, count))
    return hosts


def plan_devices_per_host(plan: Plan) -> Optional[List[int]]:
    """Device counts per host of the topology the plan was made for, if it records them."""
    topo = plan.topology or {}
    counts = topo.get("devices_per_host")
    if counts is None:
        return None
    try:
        return [int(c) for c in counts]
    except (TypeError, ValueError):
        raise LaunchError(f"the plan's topology has devices_per_host {counts!r}; expected a "
                          f"list of device counts such as [8, 8]") from None


def hosts_for_plan(plan: Plan, hosts: Optional[Hosts] = None) -> Hosts:
    """The `-H` hosts for `plan`: `hosts` checked against it, or localhost for a one-host plan."""
    try:
        require_runtime_support(plan)
    except ScheduleError as e:
        raise LaunchError(str(e)) from None
    n = plan.num_devices
    used = sorted({d for s in plan.stages for d in s.devices})   # interleaved: repeated
    if used != list(range(n)):
        raise LaunchError(f"the plan uses device ids {used}; under horovodrun rank r runs device "
                          f"r, so a plan for {n} processes must use devices 0..{n - 1}")
    per_host = plan_devices_per_host(plan)
    if hosts is None:
        if per_host is not None and len(per_host) > 1:
            example = ",".join(f"host{i + 1}:{c}" for i, c in enumerate(per_host))
            raise LaunchError(f"the plan was made for {len(per_host)} hosts with {per_host} "
                              f"devices; name them in that order with --hosts={example}")
        return [("localhost", n)]
    total = sum(c for _, c in hosts)
    if total != n:
        raise LaunchError(f"--hosts provide {total} slots ({format_hosts(hosts)}) but the plan "
                          f"uses {n} devices: give the hosts exactly {n} slots (one process per "
                          f"plan device), or use a plan made for {total} devices")
    if per_host is not None and sum(per_host) == n and [c for _, c in hosts] != per_host:
        raise LaunchError(f"--hosts have {[c for _, c in hosts]} slots per host but the plan was "
                          f"made for {per_host} devices per host; ranks are numbered host by "
                          f"host, so the stages would land on other devices than planned")
    return list(hosts)


def format_hosts(hosts: Hosts) -> str:
    return ",".join(f"{h}:{c}" for h, c in hosts)


def default_horovodrun() -> str:
    """The horovodrun next to this Python (a virtualenv's), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if os.path.exists(beside):
        return beside
    return shutil.which("horovodrun") or "horovodrun"


def launch_env(plan_path: Optional[str], step_timeout: Optional[float] = None,
               first_step_timeout: Optional[float] = None) -> Dict[str, str]:
    """Environment variables the launch adds (horovodrun passes them on to every rank)."""
    from dapple.runtime.horovod.watchdog import ENV_FIRST_STEP_TIMEOUT, ENV_STEP_TIMEOUT
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    if plan_path:
        env["DAPPLE_PLAN"] = os.path.abspath(plan_path)
    if step_timeout is not None:
        env[ENV_STEP_TIMEOUT] = f"{step_timeout:g}"
    if first_step_timeout is not None:
        env[ENV_FIRST_STEP_TIMEOUT] = f"{first_step_timeout:g}"
    return env


def horovodrun_command(plan: Plan, program: Sequence[str], hosts: Optional[Hosts] = None,
                       horovodrun: str = "horovodrun", controller: str = "gloo",
                       network_interface: Optional[str] = None, ssh: Ssh = Ssh()) -> List[str]:
    """The argv of the horovodrun command that runs `program` with one rank per plan device."""
    if not program:
        raise LaunchError("nothing to run: put the training command after `--`, as in "
                          "`dapple launch --plan=plan.json -- python train.py`")
    if controller not in CONTROLLERS:
        raise LaunchError(f"--controller must be one of {CONTROLLERS}, got {controller!r}")
    chosen = hosts_for_plan(plan, hosts)
    command = [horovodrun, "-np", str(plan.num_devices), "-H", format_hosts(chosen),
               f"--{controller}"]
    if network_interface:
        command += ["--network-interface", network_interface]
    return command + ssh.horovodrun_options() + list(program)


def shell_line(command: Sequence[str], env: Dict[str, str]) -> str:
    """The command as one copyable shell line, environment first."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (prefix + " " if prefix else "") + shlex.join(command)


def run(command: Sequence[str], env: Dict[str, str]) -> int:
    """Run horovodrun; its exit status (non-zero when any rank failed)."""
    full_env = dict(os.environ)
    full_env.update(env)
    try:
        return subprocess.call(list(command), env=full_env)
    except FileNotFoundError:
        raise LaunchError(f"{command[0]!r} was not found: install Horovod (see docs/cluster.md) "
                          f"or pass --horovodrun=/path/to/horovodrun"
                          ) from None


def load_plan(path: str) -> Plan:
    try:
        return Plan.load(path).validate()
    except FileNotFoundError:
        raise LaunchError(f"plan file {path!r} does not exist") from None
    except PlanError as e:
        raise LaunchError(str(e)) from None
