"""Run a command's ranks with Horovod over Gloo on an emulated cluster (`dapple emulate`).

    run_emulated(parse_emulated_cluster("2x2,net=200Mbps"), ["dapple", "topology", "--measure"])

builds the network (`dapple.emulated_network`), starts Horovod's own rendezvous server inside
host 0's namespace, starts every rank inside its host's namespace with the environment
horovodrun's Gloo launcher gives it, streams their output (`dapple.runtime.rank_processes`), and
returns the job's exit status. Whatever happens (success, a failing or killed rank, SIGINT,
SIGTERM, SIGHUP, an error while building), the ranks are ended and the network is deleted.

Rank layout, as `horovodrun -H host0:D0,host1:D1 --gloo`: ranks are numbered host by host
(Horovod's own `get_host_assignments`), and each rank's HOROVOD_RANK/SIZE, LOCAL_RANK/SIZE,
CROSS_RANK/SIZE and HOROVOD_HOSTNAME come from Horovod's `create_slot_env_vars`, the rendezvous
address/port, controller and Gloo interface from `create_run_env_vars`: the ranks cannot tell
the difference from a horovodrun job across machines.

Each rank gets `threads_per_rank` TensorFlow/OpenMP threads (default 1) and, with `pin`, one
CPU (rank r on the r-th allowed CPU, modulo their number) through `taskset`, so ranks behave
like devices of their own rather than all sharing every core. With `host_cpus`, each host's
processes together get that many CPUs' time, on any core (`dapple.emulated_cpus`).

With `runtime="tensorflow"` (`dapple emulate --runtime=tensorflow [--plan=plan.json]`), the
job is the one `dapple launch --runtime=tensorflow` runs
(`dapple.runtime.tf_cluster.launch.run_job`, the same start, watch and teardown): a
`tf.distribute.Server` per slot but the first, each in its host's namespace at its host's
address, and the command once, as the chief (task 0), in host 0's.
A plan, when given, is checked against the hosts and passed on in DAPPLE_PLAN; without one the
tasks are the hosts' slots (for a command that needs no plan, as `dapple topology --measure`).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from typing import Dict, List, Optional, Sequence

from dapple.emulate_spec import EmulatedCluster, EmulateError
from dapple.emulated_cpus import HostCpuShares
from dapple.emulated_network import NIC, EmulatedNetwork, check_prerequisites
from dapple.runtime.rank_processes import StopFlag, end_ranks, start_rank, watch

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TF_PORT = 2222        # --runtime=tensorflow: a task's port is TF_PORT + its slot on its host


def say(message: str) -> None:
    print(f"dapple emulate: {message}", file=sys.stderr, flush=True)


def resolve_program(program: Sequence[str]) -> List[str]:
    """`program` with its executable found on PATH or beside this Python (a virtualenv's
    `dapple`, `python` or `horovodrun` even when the venv is not activated)."""
    if not program:
        raise EmulateError("nothing to run: put the command after `--`, as in `dapple emulate "
                           "--topology=2x2,net=200Mbps -- dapple topology --measure`")
    head = program[0]
    if os.sep in head:
        found = head if os.access(head, os.X_OK) else None
    else:
        found = shutil.which(head)
        beside = os.path.join(os.path.dirname(sys.executable), head)
        if found is None and os.access(beside, os.X_OK):
            found = beside
    if found is None:
        raise EmulateError(f"cannot run {head!r}: not an executable file, and not found on "
                           f"PATH or beside {sys.executable}")
    return [os.path.abspath(found)] + list(program[1:])


def host_assignments(cluster: EmulatedCluster):
    """Horovod's slot assignments (rank, local and cross ranks) for hosts host0, host1, ..."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    from dapple.runtime.launch import format_hosts
    return get_host_assignments(parse_hosts(format_hosts(emulated_hosts(cluster))),
                                cluster.num_ranks)


def thread_environment(threads_per_rank: int, base: Optional[Dict[str, str]] = None
                       ) -> Dict[str, str]:
    """`base` (os.environ) with one device and `threads_per_rank` threads per process."""
    env = dict(os.environ if base is None else base)
    env.setdefault("DAPPLE_NUM_CPU_DEVICES", "1")      # one rank is one device
    threads = str(threads_per_rank)
    env.update({"OMP_NUM_THREADS": threads, "TF_NUM_INTRAOP_THREADS": threads,
                "PYTHONUNBUFFERED": "1"})
    return env


def rank_environment(slot, rendezvous_address: str, rendezvous_port: int,
                     threads_per_rank: int, base: Optional[Dict[str, str]] = None
                     ) -> Dict[str, str]:
    """What horovodrun's Gloo launcher would set for `slot`, over `base` (os.environ)."""
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    env = thread_environment(threads_per_rank, base)
    run_vars = create_run_env_vars(rendezvous_address, [NIC], rendezvous_port)
    env.update({k: str(v) for k, v in run_vars.items()})
    env.update(create_slot_env_vars(slot))
    return env


def _cpu_for(rank: int) -> Optional[int]:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[rank % len(cpus)] if cpus else None


def _host_index(slot) -> int:
    return int(slot.hostname[len("host"):])


def run_emulated(cluster: EmulatedCluster, program: Sequence[str], threads_per_rank: int = 1,
                 pin: bool = True, plan=None, plan_path: Optional[str] = None,
                 runtime: Optional[str] = None, host_cpus: Optional[float] = None) -> int:
    """Run `program` as every rank of `cluster` (`runtime` "horovod"), or once as the chief of a
    TensorFlow cluster with a server per other slot ("tensorflow", `tf_cluster_job`; `plan`, if
    given, checked against the hosts); the job's exit status (see the module doc). `runtime`
    defaults to "tensorflow" given a plan, else "horovod". `host_cpus`: the CPUs each host's
    processes may use together (`dapple.emulated_cpus`; None: all of this machine's)."""
    if threads_per_rank < 1:
        raise EmulateError(f"--threads_per_rank must be >= 1, got {threads_per_rank}")
    runtime = runtime or ("tensorflow" if plan is not None else "horovod")
    if runtime not in ("horovod", "tensorflow") or (plan is not None and runtime != "tensorflow"):
        raise EmulateError(f"runtime {runtime!r}{' with a plan' if plan is not None else ''}: "
                           f"horovod (no plan) or tensorflow")
    check_prerequisites()
    argv = resolve_program(program)
    if plan is not None:
        check_plan(plan, cluster)
    taskset = shutil.which("taskset") if pin else None
    if pin and taskset is None:
        say("taskset not found: ranks run unpinned")

    network = EmulatedNetwork(cluster)
    shares = (HostCpuShares(cluster.num_hosts, host_cpus, network.prefix)
              if host_cpus is not None else None)

    def pinned(rank: int, host: int, command: List[str]) -> List[str]:
        """`command` in `host`'s CPU share and namespace, on one CPU when pinning."""
        cpu = _cpu_for(rank) if taskset else None
        return ((shares.exec_prefix(host) if shares else []) + network.exec_prefix(host)
                + ([taskset, "-c", str(cpu)] if cpu is not None else []) + command)

    stop = StopFlag()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, stop) for s in HANDLED_SIGNALS} if in_main_thread else {}
    try:
        say(f"{cluster.describe()}; namespaces {network.prefix}h0..h{cluster.num_hosts - 1}, "
            f"bridge {network.bridge_namespace}"
            + (f"; {host_cpus:g} CPUs a host ({shares.groups[0]}..)" if shares else ""))
        if shares:
            shares.create()
        network.create()
        if runtime == "tensorflow":
            return tf_cluster_job(cluster, network, argv, pinned, threads_per_rank, plan_path,
                                  stop)
        return horovod_job(cluster, network, argv, pinned, threads_per_rank, stop)
    finally:
        network.destroy()
        if shares:
            shares.destroy()
        for s, handler in previous.items():
            signal.signal(s, handler)


def horovod_job(cluster: EmulatedCluster, network: EmulatedNetwork, argv: List[str], pinned,
                threads_per_rank: int, stop: StopFlag) -> int:
    """Every rank runs `argv` with horovodrun's environment, Horovod's rendezvous server in
    host 0's namespace."""
    from horovod.runner.http.http_server import RendezvousServer
    slots = host_assignments(cluster)
    rendezvous, ranks = None, []
    try:
        with network.inside(0):              # its socket stays in host 0, reachable by all
            rendezvous = RendezvousServer()
            port = rendezvous.start()
        rendezvous.init(slots)
        for slot in slots:
            if stop.signum is not None:
                break
            host = _host_index(slot)
            env = rank_environment(slot, network.address(0), port, threads_per_rank)
            ranks.append(start_rank(slot.rank, host, pinned(slot.rank, host, argv), env))
        outcome = watch(ranks, stop, say)
        return outcome.status
    finally:
        end_ranks(ranks)
        if rendezvous is not None:
            rendezvous.stop()
            server = getattr(rendezvous, "_httpd", None)
            if server is not None:
                server.server_close()            # the socket pins host 0's namespace


def emulated_hosts(cluster: EmulatedCluster):
    """The emulated hosts as `--hosts` lists them: [("host0", slots), ...]."""
    return [(f"host{h}", n) for h, n in enumerate(cluster.ranks_per_host)]


def check_plan(plan, cluster: EmulatedCluster) -> None:
    """The plan fits the emulated hosts as `dapple launch --hosts` checks it; else why not."""
    from dapple.runtime.launch import LaunchError, format_hosts, hosts_for_plan
    try:
        hosts_for_plan(plan, emulated_hosts(cluster))
    except LaunchError as e:
        raise EmulateError(f"the plan does not fit the emulated hosts "
                           f"({format_hosts(emulated_hosts(cluster))}): {e}") from None


def tf_cluster_job(cluster: EmulatedCluster, network: EmulatedNetwork, argv: List[str], pinned,
                   threads_per_rank: int, plan_path: Optional[str], stop: StopFlag) -> int:
    """`dapple launch --runtime=tensorflow` on the emulated hosts: task t (plan device t, slots
    host by host) is a server in its host's namespace at that host's address, port
    TF_PORT + its slot on the host; task 0, `argv` itself, runs in host 0's namespace."""
    from dapple.runtime.tf_cluster.launch import job_environment, run_job
    task_hosts = [h for h, n in enumerate(cluster.ranks_per_host) for _ in range(n)]
    addresses = [f"{network.address(h)}:{TF_PORT + slot}"
                 for h, n in enumerate(cluster.ranks_per_host) for slot in range(n)]
    env = {"DAPPLE_PLAN": os.path.abspath(plan_path)} if plan_path else {}
    base = thread_environment(threads_per_rank, job_environment(env))

    def server_command(task: int, host: int, server_argv: List[str]):
        return pinned(task, host, server_argv), dict(base)

    return run_job(addresses, task_hosts, server_command, pinned(0, 0, argv), base, stop, say,
                   probing=lambda: network.inside(0))
