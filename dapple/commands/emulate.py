"""`dapple emulate`: run a command's ranks on an emulated cluster of this machine.

    dapple emulate --topology=2x2,net=200Mbps -- dapple topology --measure --format=json

Needs root, `ip` and `tc` (iproute2). Starts one network namespace per host, links them
through a bridge with each host's NIC shaped to the rate (`tc tbf`), and runs the command as
`horovodrun -H host0:2,host1:2 --gloo` would: one rank per slot, ranks host by host, one
TensorFlow thread each, pinned to a CPU. Rank output is prefixed `[rank]<stdout>:`. Exits with
the job's status (the first failing rank's) and always removes what it built (see
`dapple.emulate`, `dapple.emulated_network`). Never imports TensorFlow.

    dapple emulate --runtime=tensorflow --plan=plan.json --topology=2x1,net=1Gbps -- python train.py

runs the job `dapple launch --runtime=tensorflow` runs on the emulated hosts instead: a
TensorFlow server per slot, the command once as the chief in host 0 (docs/cluster.md). A command
that needs no plan goes without one, a task per slot, as `dapple launch --runtime=tensorflow
--hosts=...` allows:

    dapple emulate --runtime=tensorflow --topology=2x1,net=1Gbps -- dapple topology --measure
"""
from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("topology", None, "HOSTSxRANKS,net=RATE[,burst=SIZE], e.g. 2x2,net=200Mbps "
                    "(RANKS+RANKS for hosts of unequal size)")
flags.DEFINE_integer("threads_per_rank", 1, "TensorFlow intra-op and OpenMP threads per rank")
flags.DEFINE_bool("pin", True, "pin each rank to one CPU with taskset (rank r on CPU r mod n)")
flags.DEFINE_float("host_cpus", None, "CPUs' time each emulated host's processes may use "
                   "together, on any core (a cpu control group per host; root): hosts stop "
                   "borrowing each other's idle cores. Unset: no limit")
flags.DEFINE_enum("runtime", "horovod", ["horovod", "tensorflow"], "every rank runs the "
                  "command (horovodrun's environment), or TensorFlow servers driven by the "
                  "command run once, as the chief (as `dapple launch --runtime=tensorflow`)")
flags.DEFINE_string("plan", None, "--runtime=tensorflow: plan JSON file, checked against the "
                    "emulated hosts as `dapple launch --hosts` checks it; in DAPPLE_PLAN (none: "
                    "a task per slot, for a command that needs no plan)")


def main(argv):
    from dapple.emulate_spec import EmulateError, parse_emulated_cluster
    try:
        cluster = parse_emulated_cluster(FLAGS.topology)
        if FLAGS.plan and FLAGS.runtime != "tensorflow":
            raise EmulateError("--plan goes with --runtime=tensorflow (Horovod ranks read "
                               "their plan themselves)")
        plan = _plan() if FLAGS.plan else None
        from dapple.emulate import run_emulated
        return run_emulated(cluster, argv[1:], threads_per_rank=FLAGS.threads_per_rank,
                            pin=FLAGS.pin, plan=plan, plan_path=FLAGS.plan,
                            runtime=FLAGS.runtime, host_cpus=FLAGS.host_cpus)
    except EmulateError as e:
        print(f"dapple emulate: {e}", file=sys.stderr)
        return 2


def _plan():
    from dapple.emulate_spec import EmulateError
    from dapple.runtime.launch import LaunchError, load_plan
    try:
        return load_plan(FLAGS.plan)
    except LaunchError as e:
        raise EmulateError(str(e)) from None
