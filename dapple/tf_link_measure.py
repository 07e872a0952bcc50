"""Timing the links between the tasks of a TensorFlow cluster with its own Send/Recv.

Run by the chief (`dapple topology --measure` under `dapple launch --runtime=tensorflow`, so
`import dapple` has connected this process to the cluster, `dapple.runtime.tf_cluster.cluster`):

* Layout: the tasks' addresses (`DAPPLE_TF_CLUSTER`), host by host as the launcher numbers them;
  consecutive tasks with one host name share a host (on localhost all tasks are one host).
* Links: for each pair of `pairs_to_measure` in turn, a message (a uint8 vector held in a
  variable on the pair's first task) is bounced between the two tasks' devices inside one
  traced `tf.function`, as a pipeline boundary moves a tensor: each hop an identity on the other
  task, so TensorFlow partitions the graph by task and inserts its buffered Send/Recv between
  them. The hops depend on each other, and the result (the message's first byte, read on the
  last task) exists only once the last hop ended. `dapple.link_timing` times it: latency and
  bandwidth as for Horovod's ranks (`dapple.link_measure`).
* Both messages take the same number of hops, so the per-call cost (dispatching the function's
  pieces to the tasks, returning the result to the chief) is the same in both per-transfer
  times and drops out of the bandwidth; the latency includes 1/HOPS of it.
* Grappler is turned off in this process: its dependency optimizer removes identities, and
  with them the hops (six hops timed like two).
* On CPU tasks a transfer also takes compute from both its ends (`Topology.transfer_cpu_*`):
  the chief's own CPU time (all its threads) over chains between it and its first measured
  peer, where each hop is one end on the chief, a send or a receive. The fixed part is the
  extra CPU of HOPS more small hops, the per-byte part the large message's extra over the
  small one's: the per-call costs drop out of both. Tasks holding GPUs keep both at 0.

Needs TensorFlow and a connected cluster; only the chief runs, so `agree` is the identity.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from dapple.link_timing import SMALL_BYTES, machine_memory, time_link
from dapple.measured_topology import hosts_of, measured_topology, pairs_to_measure
from dapple.runtime.tf_cluster.cluster import (ClusterError, addresses_from_environment,
                                               connect_from_environment, task_device)
from topology.model import Topology

METHOD = "tensorflow send/recv"
HOPS = 16
CPU_CALLS = 20          # calls a CPU-time figure is averaged over


def devices_per_host(addresses: Sequence[str]) -> List[int]:
    """Tasks per host: runs of consecutive addresses with one host name."""
    counts: List[int] = []
    previous = None
    for address in addresses:
        host = address.rpartition(":")[0]
        if host == previous:
            counts[-1] += 1
        else:
            counts.append(1)
        previous = host
    return counts


def bounce(first: int, second: int, nbytes: int, hops: int):
    """A callable bouncing an `nbytes` message `hops` times between the two tasks."""
    with tf.device(task_device(first)):
        message = tf.Variable(tf.zeros([nbytes], tf.uint8), trainable=False)

    @tf.function
    def chain():
        with tf.device(task_device(first)):
            x = message.read_value()
        for hop in range(hops):
            with tf.device(task_device(second if hop % 2 == 0 else first)):
                x = tf.identity(x)
        with tf.device(task_device(second if hops % 2 else first)):
            return x[0]                                  # exists once the last hop ended

    return chain


def transfer_cpu(other: int, large_bytes: int) -> Tuple[float, float]:
    """(seconds, bytes/s; 0: no per-byte cost) a transfer end takes of a task's compute, from
    the chief's CPU time per hop of chains between it and task `other` (the module doc)."""
    def cpu_per_call(nbytes: int, hops: int) -> float:
        chain = bounce(0, other, nbytes, hops)
        chain().numpy()
        began = time.process_time()
        for _ in range(CPU_CALLS):
            chain().numpy()
        return (time.process_time() - began) / CPU_CALLS

    small = cpu_per_call(SMALL_BYTES, HOPS)
    fixed = max(cpu_per_call(SMALL_BYTES, 2 * HOPS) - small, 0.0) / HOPS
    extra = (cpu_per_call(large_bytes, HOPS) - small) / HOPS
    return fixed, ((large_bytes - SMALL_BYTES) / extra if extra > 0 else 0.0)


def holds_gpus(tasks: Sequence[int]) -> bool:
    names = [d.name for d in tf.config.list_logical_devices("GPU")]
    return any(f"/task:{t}/" in name for t in tasks for name in names)


def _connected(tasks: int) -> None:
    names = {d.name for d in tf.config.list_logical_devices()}
    if task_device(0) not in names:                      # DAPPLE_CONFIGURE_ON_IMPORT=0
        connect_from_environment()
        names = {d.name for d in tf.config.list_logical_devices()}
    missing = [t for t in range(tasks) if task_device(t) not in names]
    if missing:
        raise ClusterError(f"tasks {missing} of the cluster are not visible to this process")


def measure(large_bytes: int, addresses: Optional[Sequence[str]] = None) -> Topology:
    """The measured Topology of the cluster (`addresses`, default `DAPPLE_TF_CLUSTER`)."""
    addresses = list(addresses or addresses_from_environment() or [])
    if not addresses:
        raise ClusterError("not in a TensorFlow cluster: run under `dapple launch "
                           "--runtime=tensorflow`")
    _connected(len(addresses))
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    counts = devices_per_host(addresses)
    inside, between = pairs_to_measure(counts)

    def timing(pair):
        return time_link(lambda nbytes, hops: bounce(pair[0], pair[1], nbytes, hops),
                         lambda value, tag: value, pair, hosts_of(counts, pair), large_bytes,
                         HOPS, HOPS)

    timings = [timing(p) for p in inside], [timing(p) for p in between]
    peer = (inside or between or [None])[0]
    gpus = peer is not None and holds_gpus(peer)
    cpu = transfer_cpu(peer[1], large_bytes) if peer is not None and not gpus else (0.0, 0.0)
    details = {"method": METHOD,
               "how": f"a uint8 vector bounced between two tasks' devices, {HOPS} dependent "
                      f"transfers in one tf.function (an identity on the other task each), "
                      f"grappler off; latency: median seconds per small transfer; bandwidth: "
                      f"extra bytes of the large transfer over its extra seconds, fastest "
                      f"calls of each; ranks are task numbers",
               "tasks": addresses,
               "device_memory": "this host's memory over the most tasks on a host"}
    if peer is not None:
        details["transfer_cpu"] = {
            "ranks": list(peer), "latency": cpu[0], "bandwidth": cpu[1],
            "how": "GPU tasks: none" if gpus else
                   f"the chief's CPU time per hop of chains with task {peer[1]}, {CPU_CALLS} "
                   f"calls each: {HOPS} more {SMALL_BYTES}-byte hops (latency), a "
                   f"{large_bytes}-byte message's extra over the small one (bandwidth)"}
    return measured_topology(counts, machine_memory() / max(counts), *timings,
                             details=details, transfer_cpu=cpu)
