"""`dapple emulate`: run a command's ranks on an emulated cluster of this machine.

    dapple emulate --topology=2x2,net=200Mbps -- dapple topology --measure --format=json

Needs root, `ip` and `tc` (iproute2). Starts one network namespace per host, links them
through a bridge with each host's NIC shaped to the rate (`tc tbf`), and runs the command as
`horovodrun -H host0:2,host1:2 --gloo` would: one rank per slot, ranks host by host, one
TensorFlow thread each, pinned to a CPU. Rank output is prefixed `[rank]<stdout>:`. Exits with
the job's status (the first failing rank's) and always removes what it built (see
`dapple.emulate`, `dapple.emulated_network`). Never imports TensorFlow.
"""
from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", None, "HOSTSxRANKS,net=RATE[,burst=SIZE], e.g. 2x2,net=200Mbps "
                    "(RANKS+RANKS for hosts of unequal size)")
flags.DEFINE_integer("threads_per_rank", 1, "TensorFlow intra-op and OpenMP threads per rank")
flags.DEFINE_bool("pin", True, "pin each rank to one CPU with taskset (rank r on CPU r mod n)")


def main(argv):
    from dapple.emulate_spec import EmulateError, parse_emulated_cluster
    try:
        cluster = parse_emulated_cluster(FLAGS.topology)
        from dapple.emulate import run_emulated
        return run_emulated(cluster, argv[1:], threads_per_rank=FLAGS.threads_per_rank,
                            pin=FLAGS.pin)
    except EmulateError as e:
        print(f"dapple emulate: {e}", file=sys.stderr)
        return 2
