"""One task's `tf.distribute.Server`, as `dapple launch --runtime=tensorflow` starts it.

    python -m dapple.runtime.tf_cluster.server --cluster='["h1:2222","h1:2223"]' --task=1
        [--devices=N]

Holds N CPU devices (default 1; its GPUs, if any, as TensorFlow finds them). Serves until ended
(the launcher ends it when the training script ends). Its thread pools follow
`TF_NUM_INTRAOP_THREADS` and `TF_NUM_INTEROP_THREADS` when set, as TensorFlow's own
do in the chief.
"""
from __future__ import annotations

import argparse
import os
import sys


def config(devices: int = 1):
    import tensorflow as tf
    proto = tf.compat.v1.ConfigProto()
    proto.device_count["CPU"] = devices
    for env, field in (("TF_NUM_INTRAOP_THREADS", "intra_op_parallelism_threads"),
                       ("TF_NUM_INTEROP_THREADS", "inter_op_parallelism_threads")):
        if os.environ.get(env, "").isdigit():
            setattr(proto, field, int(os.environ[env]))
    return proto


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="JSON list of host:port, task 0 first")
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1, help="CPU devices this task holds")
    args = parser.parse_args(argv)
    from dapple.runtime.tf_cluster.cluster import JOB, parse_addresses
    tasks = parse_addresses(args.cluster)
    if not 0 < args.task < len(tasks):
        print(f"--task={args.task}: a server runs tasks 1..{len(tasks) - 1} (task 0 is the "
              f"chief, the training script)", file=sys.stderr)
        return 2
    if args.devices < 1:
        print(f"--devices={args.devices}: a task holds at least one device", file=sys.stderr)
        return 2
    import tensorflow as tf
    server = tf.distribute.Server(tf.train.ClusterSpec({JOB: tasks}), job_name=JOB,
                                  task_index=args.task, config=config(args.devices),
                                  start=True)
    print(f"dapple: task {args.task} serving at {tasks[args.task]}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
