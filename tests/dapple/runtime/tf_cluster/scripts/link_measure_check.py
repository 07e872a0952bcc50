"""Under `dapple launch --runtime=tensorflow --hosts=localhost:3`: measure the cluster with
`dapple.tf_link_measure` (on one host: tasks 0 and 1), time tasks 1 and 2 (a pair without the
chief, as between hosts) the same way, then time whole transfers of a large message between
each pair another way (one transfer a call, the whole call timed), and print the bandwidths as
JSON: {"method", "pairs": [[first, second, measured, direct], ...]}."""
import json
import sys
import time

import dapple  # noqa: F401  (connects to the cluster)
import tensorflow as tf

from dapple import link_timing, tf_link_measure
from dapple.runtime.tf_cluster.cluster import task_device

NBYTES = 32 * 2 ** 20


def direct_bandwidth(first: int, second: int) -> float:
    """NBYTES over the whole time of one call moving them from `second` to `first` (call
    overhead included: a lower bound of the link's bandwidth)."""
    with tf.device(task_device(second)):
        message = tf.Variable(tf.ones([NBYTES], tf.uint8), trainable=False)

    @tf.function
    def fetch():
        with tf.device(task_device(second)):
            x = message + 1                    # made on `second`
        with tf.device(task_device(first)):
            return x[-1]                       # needs the whole tensor on `first`

    fetch().numpy()
    seconds = []
    for _ in range(5):
        began = time.perf_counter()
        fetch().numpy()
        seconds.append(time.perf_counter() - began)
    return NBYTES / min(seconds)


large = int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 2 ** 20
topology = tf_link_measure.measure(large)
pairs = [[0, 1, topology.intra_host_bandwidth, direct_bandwidth(0, 1)]]
timing = link_timing.time_link(lambda n, hops: tf_link_measure.bounce(1, 2, n, hops),
                               lambda value, tag: value, (1, 2), (0, 0), large,
                               tf_link_measure.HOPS, tf_link_measure.HOPS)
pairs.append([1, 2, timing.bandwidth, direct_bandwidth(1, 2)])
print(json.dumps({"method": topology.measured["method"], "pairs": pairs}), flush=True)
