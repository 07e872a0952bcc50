"""Each emulated host's share of this machine's CPUs (`dapple emulate --host_cpus=C`).

    shares = HostCpuShares(num_hosts=2, cpus=1.0, prefix="dpl-4242-")
    shares.create()
    shares.exec_prefix(host=1) + ["ip", "netns", "exec", ...]   # joins host 1's group, then runs
    shares.destroy()

The emulated hosts share this machine's cores, and real hosts do not: a rank whose neighbours
idle takes their cores (TensorFlow's inter-op pool runs a layer's input and weight gradients at
once), so a plan that leaves one host idle measures faster than that host's own CPUs would
allow. Pinning each rank to a CPU (`--pin`) bounds that, but also makes a runtime's helper
threads wait behind its busy compute thread. A CPU quota per host does neither: every process
of host h (and its children) joins the control group `<prefix>h<h>`, whose processes together
get at most C CPUs' time every PERIOD_US, on whichever cores are free.

Linux control groups, version 1 (the `cpu` controller's `cpu.cfs_quota_us`) or version 2
(`cpu.max`); root only. A process joins before it enters its host's network namespace, whose
own /sys does not show the machine's groups.
"""
from __future__ import annotations

import os
import time
from typing import List, Optional

from dapple.emulate_spec import EmulateError

PERIOD_US = 10_000        # short: a host over its quota waits at most the rest of 10 ms
CGROUP_ROOT = "/sys/fs/cgroup"


def cpu_controller(root: str = CGROUP_ROOT) -> Optional[str]:
    """The folder new cpu control groups go in, or None when this machine has none writable."""
    v2 = os.path.join(root, "cgroup.controllers")
    if os.path.exists(v2):
        with open(v2) as f:
            listed = "cpu" in f.read().split()
        return root if listed and os.access(root, os.W_OK) else None
    v1 = os.path.join(root, "cpu")
    if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")) and os.access(v1, os.W_OK):
        return v1
    return None


class HostCpuShares:
    """A control group per host, each allowed `cpus` CPUs' time (see the module doc)."""

    def __init__(self, num_hosts: int, cpus: float, prefix: str, root: str = CGROUP_ROOT):
        if not cpus > 0:
            raise EmulateError(f"--host_cpus={cpus}: expected the CPUs each host may use, > 0 "
                               f"(e.g. 1 for a core a host; leave it out for no limit)")
        self.cpus = cpus
        self.controller = cpu_controller(root)
        if self.controller is None:
            raise EmulateError(
                f"--host_cpus needs Linux control groups' cpu controller, writable: neither "
                f"{root}/cgroup.controllers listing cpu (version 2) nor {root}/cpu (version 1) "
                f"is, here (run as root, or leave --host_cpus out)")
        self.version = 2 if self.controller == root else 1
        self.groups = [os.path.join(self.controller, f"{prefix}h{h}") for h in range(num_hosts)]

    def create(self) -> None:
        quota = max(1000, round(self.cpus * PERIOD_US))
        if self.version == 2:
            self._delegate_cpu()
        for group in self.groups:
            os.makedirs(group, exist_ok=True)
            if self.version == 2:
                _write(os.path.join(group, "cpu.max"), f"{quota} {PERIOD_US}")
            else:
                _write(os.path.join(group, "cpu.cfs_period_us"), str(PERIOD_US))
                _write(os.path.join(group, "cpu.cfs_quota_us"), str(quota))

    def _delegate_cpu(self) -> None:
        """Version 2 gives a group `cpu.max` only when its parent delegates the controller."""
        control = os.path.join(self.controller, "cgroup.subtree_control")
        if os.path.exists(control):
            with open(control) as f:
                if "cpu" in f.read().split():
                    return
        try:
            _write(control, "+cpu")
        except OSError as e:
            raise EmulateError(f"--host_cpus: cannot delegate the cpu controller ({control}: "
                               f"{e.strerror}); leave --host_cpus out") from None

    def exec_prefix(self, host: int) -> List[str]:
        """argv prefix that moves the program into `host`'s group, then runs it (exec)."""
        procs = os.path.join(self.groups[host], "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]

    def destroy(self, wait_seconds: float = 5.0) -> None:
        """Remove the groups (a group goes once its last process has exited)."""
        for group in self.groups:
            deadline = time.monotonic() + wait_seconds
            while os.path.isdir(group):
                try:
                    os.rmdir(group)
                except OSError:
                    if time.monotonic() > deadline:
                        print(f"dapple emulate: could not remove {group} (processes still in "
                              f"it); remove it with rmdir once they end", flush=True)
                        break
                    time.sleep(0.1)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
