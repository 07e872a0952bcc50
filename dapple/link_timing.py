"""Timing one link, as both `dapple topology --measure` methods do (no TensorFlow import).

A method (`dapple.link_measure`: Horovod's alltoall; `dapple.tf_link_measure`: TensorFlow's
Send/Recv) supplies

* `transfer(nbytes, hops)`: a callable running `hops` dependent transfers of an `nbytes`
  message back and forth between the pair (each takes the previous one's output, so none can
  start early), in one traced `tf.function`, returning a tensor that exists only once the last
  transfer ended;
* `agree(value, tag)`: the value both ends of the pair use, when each end times on its own
  (Horovod: the larger of the two ranks' values; a single process: the value itself).

`time_link` times a small and a large message (latency and bandwidth,
`dapple.measured_topology.PairTiming`): each after a warm-up call, calls repeated for about
BUDGET_SECONDS; a link so fast that the large message takes less than the latency is timed
again with a larger one.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable, Tuple

from dapple.measured_topology import Pair, PairTiming

Transfer = Callable[[int, int], Callable[[], object]]
Agree = Callable[[int, str], int]

SMALL_BYTES = 64
# Timed calls per message: at least MIN_REPEATS, more while under BUDGET_SECONDS (fast links
# take many cheap samples, so the median settles; a slow link's few calls are long already).
MIN_REPEATS, MAX_REPEATS, BUDGET_SECONDS = 3, 25, 1.0
# A fast link is re-timed with a message whose bytes take LATENCY_MULTIPLE per-transfer
# latencies, up to MAX_MESSAGE_BYTES (memory: a few copies per rank).
LATENCY_MULTIPLE, MAX_MESSAGE_BYTES = 2, 64 * 2 ** 20


def machine_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float(4 * 2 ** 30)


def timed(fn) -> float:
    began = time.perf_counter()
    fn().numpy()                                        # the clock stops when the value exists
    return time.perf_counter() - began


def seconds_per_transfer(fn, hops: int, agree: Agree, tag: str) -> Tuple[float, float]:
    """(median, fastest) seconds per transfer of `fn`'s calls: a warm-up call (tracing,
    negotiation), then as many calls as fit BUDGET_SECONDS (MIN..MAX_REPEATS). Both ends agree
    on the count, or one would wait forever for the other's next call."""
    fn().numpy()
    calls = [timed(fn)]
    wish = min(MAX_REPEATS, max(MIN_REPEATS, math.ceil(BUDGET_SECONDS / calls[0])))
    repeats = agree(wish, f"{tag}.repeats")
    calls += [timed(fn) for _ in range(repeats - 1)]
    return float(statistics.median(calls)) / hops, min(calls) / hops


def time_link(transfer: Transfer, agree: Agree, ranks: Pair, hosts: Pair, large_bytes: int,
              small_hops: int, large_hops: int) -> PairTiming:
    """The pair's timings (see the module doc); both ends of the pair call it."""
    small = seconds_per_transfer(transfer(SMALL_BYTES, small_hops), small_hops, agree, "small")

    def large_transfer(nbytes: int) -> Tuple[float, float]:
        return seconds_per_transfer(transfer(nbytes, large_hops), large_hops, agree,
                                    str(nbytes))

    large = large_transfer(large_bytes)
    # On a fast link the large message may take less than the fixed per-transfer cost, and
    # the bandwidth (a small difference of two noisy times) would swing by 3x between runs:
    # re-time with a message whose bytes take about LATENCY_MULTIPLE latencies.
    rate = (large_bytes - SMALL_BYTES) / max(large[1] - small[1], 1e-6)
    wish = min(MAX_MESSAGE_BYTES, int(rate * small[0] * LATENCY_MULTIPLE))
    wish = max(large_bytes, 2 ** math.ceil(math.log2(max(wish, 1))))
    agreed = agree(min(wish, MAX_MESSAGE_BYTES), "size")
    if agreed > large_bytes:
        large_bytes, large = agreed, large_transfer(agreed)
    return PairTiming(ranks=ranks, hosts=hosts, small_bytes=SMALL_BYTES, small_seconds=small[0],
                      small_fastest=small[1], large_bytes=large_bytes, large_seconds=large[0],
                      large_fastest=large[1])
