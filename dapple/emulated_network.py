"""A cluster's network on one machine: a network namespace per host, joined by shaped links.

    with EmulatedNetwork(cluster) as net:       # creates; always destroys on the way out
        net.exec_prefix(host=1)                 # ['ip', 'netns', 'exec', 'dpl-4242-h1']
        net.address(host=0)                     # '10.77.0.1'
        with net.inside(host=0): ...            # sockets made here live in host 0's namespace

What it builds (names start with `dpl-<pid>-`, so parallel runs and leftovers never collide):

* a namespace `dpl-<pid>-br` holding a bridge `br0`; it has no address (a bare switch);
* per host h a namespace `dpl-<pid>-h<h>` with its loopback up (the fast link inside the
  host: ranks of one host reach each other's addresses through `lo`) and an interface `eth0`
  addressed 10.77.0.(h+1)/24, the host's NIC;
* per host a file `/etc/netns/<namespace>/hosts`, which `ip netns exec` mounts over
  `/etc/hosts` for the rank: the machine's hostname resolves to that host's NIC address there
  (Horovod's Gloo devices are built from the hostname, not from HOROVOD_GLOO_IFACE, and the
  hostname would otherwise resolve to an address the other hosts cannot reach: docs/cluster.md,
  "An emulated cluster on one machine", has the versions and the source);
* a veth pair per host, `eth0` in the host and `h<h>` in the bridge's namespace (both made
  there directly, so the machine's own namespace never sees them), both ends shaped with
  `tc qdisc ... tbf` at the cluster's rate: tbf shapes what leaves an interface, so shaping
  both ends limits both directions.

Addresses exist only inside these namespaces; the machine's own network is untouched. Teardown
kills every process still inside the namespaces, then deletes them (which deletes their
interfaces and the bridge with them) and their hosts files; it runs even if creation failed
half-way.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
from typing import Iterator, List, Optional

from dapple.emulate_spec import QUEUE_LATENCY, EmulatedCluster, EmulateError

SUBNET = "10.77.0"          # private to this run's bridge: parallel runs have their own bridges
NIC = "eth0"                # every host's NIC has the same name, so one HOROVOD_GLOO_IFACE fits
BRIDGE = "br0"
CLONE_NEWNET = 0x40000000
ETC_NETNS = "/etc/netns"    # `ip netns exec NAME` mounts /etc/netns/NAME/* over /etc/*


def missing_prerequisites() -> List[str]:
    """What this machine lacks to emulate a cluster, in words; empty when nothing."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_SYS_ADMIN: run as root, e.g. sudo)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (install {package})")
    return missing


def check_prerequisites() -> None:
    missing = missing_prerequisites()
    if missing:
        raise EmulateError("cannot emulate a cluster here; missing: " + "; ".join(missing))


def _run(argv: List[str], what: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise EmulateError(f"{what} failed: `{' '.join(argv)}` said: "
                           f"{(result.stderr or result.stdout).strip()}")
    return result.stdout


def namespaces() -> List[str]:
    """Names of the machine's named network namespaces (`ip netns list`)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in_namespace(name: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


@contextlib.contextmanager
def inside_namespace(name: str) -> Iterator[None]:
    """Run the block with this thread in namespace `name`; sockets created in it stay there."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)    # this thread's own namespace
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise EmulateError(f"cannot enter network namespace {name}: {os.strerror(err)}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:      # never go on in the wrong namespace
                print(f"dapple emulate: cannot return from namespace {name}; exiting",
                      file=sys.stderr)
                os._exit(70)
    finally:
        os.close(target)
        os.close(home)


class EmulatedNetwork:
    """The namespaces, bridge and shaped links of one emulated cluster (see the module doc)."""

    def __init__(self, cluster: EmulatedCluster, prefix: Optional[str] = None):
        self.cluster = cluster
        self.prefix = prefix or f"dpl-{os.getpid()}-"
        self.bridge_namespace = f"{self.prefix}br"
        self.host_namespaces = [f"{self.prefix}h{h}" for h in range(cluster.num_hosts)]
        self._created: List[str] = []
        self._made_etc_netns = False

    # ---- what ranks need ---------------------------------------------------------
    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def exec_prefix(self, host: int) -> List[str]:
        """argv prefix that runs a program inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.host_namespaces[host]]

    def inside(self, host: int):
        return inside_namespace(self.host_namespaces[host])

    # ---- lifetime ------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        if self.cluster.num_hosts > 250:
            raise EmulateError(f"{self.cluster.num_hosts} hosts do not fit the /24 subnet "
                               f"{SUBNET}.0 this emulation uses; use at most 250")
        check_prerequisites()
        self._add_namespace(self.bridge_namespace)
        br = self.bridge_namespace
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"], "creating the bridge")
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"], "bringing the bridge up")
        for h, ns in enumerate(self.host_namespaces):
            self._add_namespace(ns)
            port = f"h{h}"
            _run(["ip", "link", "add", port, "netns", br, "type", "veth", "peer", "name", NIC,
                  "netns", ns], f"creating host {h}'s link (veth pair)")
            _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE, "up"],
                 f"plugging host {h}'s link into the bridge")
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", NIC],
                 f"addressing host {h}")
            _run(["ip", "-n", ns, "link", "set", NIC, "up"], f"bringing host {h}'s NIC up")
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], f"bringing host {h}'s loopback up")
            self._write_hosts_file(ns, self.address(h))
            for namespace, device in ((ns, NIC), (br, port)):
                self._shape(namespace, device, h)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name], f"creating network namespace {name}")
        self._created.append(name)

    def _write_hosts_file(self, namespace: str, address: str) -> None:
        """/etc/hosts as seen inside `namespace`: the machine's hostname is `address`."""
        machine = socket.gethostname()
        try:
            with open("/etc/hosts") as f:
                kept = [line for line in f if machine not in line.split("#")[0].split()[1:]]
        except FileNotFoundError:
            kept = ["127.0.0.1 localhost\n"]
        folder = os.path.join(ETC_NETNS, namespace)
        try:
            if not os.path.isdir(ETC_NETNS):
                os.makedirs(ETC_NETNS)
                self._made_etc_netns = True
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write(f"{address} {machine}\n" + "".join(kept))
        except OSError as e:
            raise EmulateError(f"cannot write {folder}/hosts (the hostname each emulated host "
                               f"resolves): {e}") from None

    def _shape(self, namespace: str, device: str, host: int) -> None:
        c = self.cluster
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
              "rate", c.tc_rate, "burst", str(c.burst_bytes), "latency", QUEUE_LATENCY],
             f"shaping host {host}'s link with tc tbf (is the sch_tbf kernel module available?)")

    def destroy(self) -> None:
        """Kill what still runs inside, delete the namespaces; never raises, idempotent."""
        for name in self._created:
            for pid in pids_in_namespace(name):
                if pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
        for name in reversed(self._created):
            result = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if result.returncode != 0 and name in namespaces():
                print(f"dapple emulate: could not delete namespace {name}: "
                      f"{result.stderr.strip()}; remove it with `ip netns del {name}`",
                      file=sys.stderr)
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        if self._made_etc_netns:
            with contextlib.suppress(OSError):
                os.rmdir(ETC_NETNS)       # only if empty: other runs' files stay
        self._created = []
