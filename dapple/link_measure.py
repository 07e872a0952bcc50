"""Timing the links between Horovod ranks with the collectives dapple's runtime uses.

Run by every rank (`dapple topology --measure` under horovodrun or `dapple emulate`):

* Layout: every rank's local rank and size are gathered; ranks are host by host, so this gives
  the ranks per host (`dapple.measured_topology.devices_per_host_of`).
* Links: for each pair of `pairs_to_measure` in turn (the other ranks wait at a barrier, so
  only one pair moves data at a time), the two ranks ping-pong a message back and forth with
  `hvd.alltoall` inside a process set of just the two, as a pipeline boundary does: one uint8
  row of S bytes, the sender's splits [0, 1] or [1, 0], the receiver's [0, 0]. A traced
  `tf.function` of `hops` dependent transfers (each takes the previous one's output, so none
  can start early) is timed after a warm-up call; seconds per transfer = median call / hops.
  Both a small and a large message are timed (latency and bandwidth); a link so fast that the
  large message takes less than the latency is timed again with a larger one.
* Allreduce: the whole world sums a float32 tensor of the large size (the data-parallel
  gradient collective); its time is recorded beside the links.

Needs TensorFlow and Horovod; HOROVOD_DYNAMIC_PROCESS_SETS=1 must be set before `hvd.init()`
(`dapple topology` sets it).
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Dict, List, Optional, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from dapple.measured_topology import (PairTiming, devices_per_host_of, measured_topology,
                                      pairs_to_measure)

SMALL_BYTES = 64
SMALL_HOPS, LARGE_HOPS = 16, 2
# Timed calls per message: at least MIN_REPEATS, more while under BUDGET_SECONDS (fast links
# take many cheap samples, so the median settles; a slow link's few calls are long already).
MIN_REPEATS, MAX_REPEATS, BUDGET_SECONDS = 3, 25, 1.0
# A fast link is re-timed with a message whose bytes take LATENCY_MULTIPLE per-transfer
# latencies, up to MAX_MESSAGE_BYTES (memory: a few copies per rank).
LATENCY_MULTIPLE, MAX_MESSAGE_BYTES = 2, 64 * 2 ** 20


def _barrier(tag: str) -> None:
    hvd.allreduce(tf.constant(0.0), name=f"dapple.measure.barrier.{tag}", op=hvd.Sum)


def _machine_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float(4 * 2 ** 30)


def layout() -> Tuple[List[int], float]:
    """(ranks per host, memory per rank: the smallest host RAM / its ranks)."""
    mine = {"local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "memory": _machine_memory() / hvd.local_size()}
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


def _timed(fn) -> float:
    began = time.perf_counter()
    fn().numpy()                                        # the clock stops when the value exists
    return time.perf_counter() - began


def _seconds_per_transfer(fn, hops: int, process_set, tag: str) -> Tuple[float, float]:
    """(median, fastest) seconds per transfer of `fn`'s calls: a warm-up call (tracing,
    negotiation), then as many calls as fit BUDGET_SECONDS (MIN..MAX_REPEATS). The ranks of
    the set agree on the count (the largest wish), or one would wait forever for the other's
    next call."""
    fn().numpy()
    calls = [_timed(fn)]
    wish = min(MAX_REPEATS, max(MIN_REPEATS, math.ceil(BUDGET_SECONDS / calls[0])))
    repeats = int(hvd.allreduce(tf.constant(wish), op=hvd.Max, process_set=process_set,
                                name=f"{tag}.repeats"))
    calls += [_timed(fn) for _ in range(repeats - 1)]
    return float(statistics.median(calls)) / hops, min(calls) / hops


def _process_set(pair: Tuple[int, int]):
    if hvd.size() == 2:
        return hvd.global_process_set                   # Horovod refuses to register it again
    return hvd.add_process_set(list(pair))


def time_pair(pair: Tuple[int, int], hosts: Tuple[int, int], process_set, large_bytes: int
              ) -> Optional[PairTiming]:
    """The pair's timings on its first rank; None on every other rank."""
    if hvd.rank() not in pair:
        return None
    tag = f"dapple.measure.{pair[0]}-{pair[1]}"
    small = _seconds_per_transfer(_pingpong(pair, process_set, SMALL_BYTES, SMALL_HOPS),
                                  SMALL_HOPS, process_set, f"{tag}.small")

    def large_transfer(nbytes: int) -> Tuple[float, float]:
        return _seconds_per_transfer(_pingpong(pair, process_set, nbytes, LARGE_HOPS),
                                     LARGE_HOPS, process_set, f"{tag}.{nbytes}")

    large = large_transfer(large_bytes)
    # On a fast link the large message may take less than the fixed per-transfer cost, and
    # the bandwidth (a small difference of two noisy times) would swing by 3x between runs:
    # re-time with a message whose bytes take about LATENCY_MULTIPLE latencies.
    rate = (large_bytes - SMALL_BYTES) / max(large[1] - small[1], 1e-6)
    wish = min(MAX_MESSAGE_BYTES, int(rate * small[0] * LATENCY_MULTIPLE))
    wish = max(large_bytes, 2 ** math.ceil(math.log2(max(wish, 1))))
    agreed = int(hvd.allreduce(tf.constant(min(wish, MAX_MESSAGE_BYTES)), op=hvd.Max,
                               process_set=process_set, name=f"{tag}.size"))
    if agreed > large_bytes:
        large_bytes, large = agreed, large_transfer(agreed)
    if hvd.rank() != pair[0]:
        return None
    return PairTiming(ranks=pair, hosts=hosts, small_bytes=SMALL_BYTES, small_seconds=small[0],
                      small_fastest=small[1], large_bytes=large_bytes, large_seconds=large[0],
                      large_fastest=large[1])


def time_allreduce(nbytes: int) -> Dict[str, float]:
    values = tf.ones([max(1, nbytes // 4)], tf.float32)

    @tf.function
    def reduce(v):
        return tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum, name="dapple.measure.allreduce")[:1])

    seconds, _ = _seconds_per_transfer(lambda: reduce(values), 1, hvd.global_process_set,
                                       "dapple.measure.allreduce")
    return {"ranks": hvd.size(), "bytes": int(values.shape[0]) * 4, "seconds": seconds}


def measure(large_bytes: int):
    """Every rank calls this; rank 0 gets the measured Topology, the others None."""
    counts, memory = layout()
    inside, between = pairs_to_measure(counts)
    starts = [sum(counts[:h]) for h in range(len(counts))]

    def host_of(rank: int) -> int:
        return max(h for h, s in enumerate(starts) if s <= rank)

    pairs = inside + between
    sets = [_process_set(p) for p in pairs]            # every rank registers every set
    mine = []
    for i, (pair, process_set) in enumerate(zip(pairs, sets)):
        timing = time_pair(pair, (host_of(pair[0]), host_of(pair[1])), process_set, large_bytes)
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
