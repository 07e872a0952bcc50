"""Timing the links between Horovod ranks with the collectives dapple's runtime uses.

Run by every rank (`dapple topology --measure` under horovodrun or `dapple emulate`):

* Layout: every rank's local rank and size are gathered; ranks are host by host, so this gives
  the ranks per host (`dapple.measured_topology.devices_per_host_of`).
* Links: for each pair of `pairs_to_measure` in turn (the other ranks wait at a barrier, so
  only one pair moves data at a time), the two ranks ping-pong a message back and forth with
  `hvd.alltoall` inside a process set of just the two, as a pipeline boundary does: one uint8
  row of S bytes, the sender's splits [0, 1] or [1, 0], the receiver's [0, 0]. A traced
  `tf.function` of `hops` dependent transfers (each takes the previous one's output, so none
  can start early) is timed as `dapple.link_timing` times every link (small and large
  message: latency and bandwidth), the two ranks agreeing on the repeats and sizes.
* Allreduce: the whole world sums a float32 tensor of the large size (the data-parallel
  gradient collective); its time is recorded beside the links.

Needs TensorFlow and Horovod; HOROVOD_DYNAMIC_PROCESS_SETS=1 must be set before `hvd.init()`
(`dapple topology` sets it).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from dapple.link_timing import machine_memory, seconds_per_transfer, time_link
from dapple.measured_topology import (PairTiming, devices_per_host_of, hosts_of,
                                      measured_topology, pairs_to_measure)

SMALL_HOPS, LARGE_HOPS = 16, 2


def _barrier(tag: str) -> None:
    hvd.allreduce(tf.constant(0.0), name=f"dapple.measure.barrier.{tag}", op=hvd.Sum)


def _agreeing(process_set, prefix: str):
    """`link_timing`'s agree: the largest of the set's ranks' values."""
    def agree(value: int, tag: str) -> int:
        return int(hvd.allreduce(tf.constant(value), op=hvd.Max, process_set=process_set,
                                 name=f"{prefix}.{tag}"))
    return agree


def layout() -> Tuple[List[int], float]:
    """(ranks per host, memory per rank: the smallest host RAM / its ranks)."""
    mine = {"local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "memory": machine_memory() / hvd.local_size()}
    everyone = hvd.allgather_object(mine, name="dapple.measure.layout")
    counts = devices_per_host_of([e["local_rank"] for e in everyone],
                                 [e["local_size"] for e in everyone])
    return counts, min(e["memory"] for e in everyone)


def _pingpong(pair: Tuple[int, int], process_set, nbytes: int, hops: int):
    """A tf.function moving one row of `nbytes` bytes `hops` times between the pair."""
    first = hvd.rank() == pair[0]
    tag = f"dapple.measure.{pair[0]}-{pair[1]}.{nbytes}"

    @tf.function
    def chain(x):
        for hop in range(hops):
            sending = (hop % 2 == 0) == first           # the pair's first rank sends first
            splits = ([0, 1] if first else [1, 0]) if sending else [0, 0]
            x, _ = hvd.alltoall(x, splits=tf.constant(splits, tf.int32), name=f"{tag}.{hop}",
                                ignore_name_scope=True, process_set=process_set)
        return tf.shape(x)[0]                           # depends on the last transfer

    start = tf.zeros([1 if first else 0, nbytes], tf.uint8)
    return lambda: chain(start)


def _process_set(pair: Tuple[int, int]):
    if hvd.size() == 2:
        return hvd.global_process_set                   # Horovod refuses to register it again
    return hvd.add_process_set(list(pair))


def time_pair(pair: Tuple[int, int], hosts: Tuple[int, int], process_set, large_bytes: int
              ) -> Optional[PairTiming]:
    """The pair's timings on its first rank; None on every other rank."""
    if hvd.rank() not in pair:
        return None
    timing = time_link(lambda nbytes, hops: _pingpong(pair, process_set, nbytes, hops),
                       _agreeing(process_set, f"dapple.measure.{pair[0]}-{pair[1]}"), pair, hosts,
                       large_bytes, SMALL_HOPS, LARGE_HOPS)
    return timing if hvd.rank() == pair[0] else None


def time_allreduce(nbytes: int) -> Dict[str, float]:
    values = tf.ones([max(1, nbytes // 4)], tf.float32)

    @tf.function
    def reduce(v):
        return tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum, name="dapple.measure.allreduce")[:1])

    seconds, _ = seconds_per_transfer(lambda: reduce(values), 1,
                                      _agreeing(hvd.global_process_set, "dapple.measure"),
                                      "allreduce")
    return {"ranks": hvd.size(), "bytes": int(values.shape[0]) * 4, "seconds": seconds}


def measure(large_bytes: int):
    """Every rank calls this; rank 0 gets the measured Topology, the others None."""
    counts, memory = layout()
    inside, between = pairs_to_measure(counts)
    pairs = inside + between
    sets = [_process_set(p) for p in pairs]            # every rank registers every set
    mine = []
    for i, (pair, process_set) in enumerate(zip(pairs, sets)):
        timing = time_pair(pair, hosts_of(counts, pair), process_set, large_bytes)
        if timing is not None:
            mine.append(timing)
        _barrier(str(i))                                # one pair on the wire at a time
    allreduce = time_allreduce(large_bytes) if hvd.size() > 1 else None
    gathered = hvd.allgather_object(mine, name="dapple.measure.results")
    if hvd.rank() != 0:
        return None
    timings = {t.ranks: t for part in gathered for t in part}
    details = {"method": "ping-pong hvd.alltoall between two ranks in their own process set "
                         "(one uint8 row per transfer, dependent transfers in one tf.function); "
                         "latency: median seconds per small transfer; bandwidth: extra bytes "
                         "of the large transfer over its extra seconds, fastest calls of each "
                         "(scheduling delays only add time)",
               "horovod_cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME")}
    if allreduce is not None:
        details["allreduce"] = allreduce
    return measured_topology(counts, memory, [timings[p] for p in inside],
                             [timings[p] for p in between], details=details)
