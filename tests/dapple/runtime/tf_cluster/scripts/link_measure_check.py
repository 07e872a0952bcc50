"""Under `dapple launch --runtime=tensorflow --hosts=localhost:2`: measure the link between the
two tasks with `dapple.tf_link_measure`, then time whole transfers of a large message from
task 1 to this process another way (one transfer a call, the whole call timed), and print both
bandwidths as JSON."""
import json
import statistics
import sys
import time

import dapple  # noqa: F401  (connects to the cluster)
import tensorflow as tf

from dapple import tf_link_measure
from dapple.runtime.tf_cluster.cluster import task_device

NBYTES = 32 * 2 ** 20


def direct_bandwidth() -> float:
    """NBYTES over the whole time of one call moving them from task 1 to task 0 (call overhead
    included: a lower bound of the link's bandwidth)."""
    with tf.device(task_device(1)):
        message = tf.Variable(tf.ones([NBYTES], tf.uint8), trainable=False)

    @tf.function
    def fetch():
        with tf.device(task_device(1)):
            x = message + 1                    # made on task 1
        with tf.device(task_device(0)):
            return x[-1]                       # needs the whole tensor here

    fetch().numpy()
    seconds = []
    for _ in range(5):
        began = time.perf_counter()
        fetch().numpy()
        seconds.append(time.perf_counter() - began)
    return NBYTES / min(seconds)


topology = tf_link_measure.measure(int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 2 ** 20)
print(json.dumps({"measured": topology.intra_host_bandwidth, "direct": direct_bandwidth(),
                  "method": topology.measured["method"]}), flush=True)
