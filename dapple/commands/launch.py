"""`dapple launch`: run a training script with one process per plan device.

    dapple launch --plan=plan.json [--hosts=h1:8,h2:8] -- python train.py --epochs=3

`--runtime=horovod` (the default): prints the horovodrun command (with the environment it
adds), then runs it and exits with its status. `-np` and `-H` come from the plan (see
`dapple.runtime.launch`); `--dry_run` only prints. `--runtime=tensorflow`: a
`tf.distribute.Server` per slot and the script once, as the chief
(`dapple.runtime.tf_cluster.launch`; `--group_devices`: a process per host instead); with
`--hosts` it needs no plan, for a command that
uses none (`dapple topology --measure`).
"""
from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("runtime", "horovod", ["horovod", "tensorflow"], "horovodrun ranks, or "
                  "TensorFlow servers driven by one chief (docs/cluster.md)")
flags.DEFINE_bool("group_devices", False, "--runtime=tensorflow: one process per host holding "
                  "all its slots' devices (transfers inside a host are device copies), instead "
                  "of one process per slot")
flags.DEFINE_integer("port", None, "--runtime=tensorflow: task ports are port + slot (default: "
                     "free ports here, 2222 + slot on other hosts)")
flags.DEFINE_string("plan", None, "plan JSON file (its device count gives -np; "
                    "--runtime=tensorflow with --hosts: optional)")
flags.DEFINE_string("hosts", None, "host:slots,host:slots in device order (default: localhost "
                    "for a plan made for one host)")
flags.DEFINE_string("horovodrun", None, "horovodrun executable (default: the one beside this "
                    "Python, else on PATH)")
flags.DEFINE_integer("ssh_port", None, "ssh port of the other hosts (horovodrun's --ssh-port; "
                     "default: ssh's own)")
flags.DEFINE_string("ssh_identity_file", None, "ssh identity file for the other hosts "
                    "(horovodrun's --ssh-identity-file)")
flags.DEFINE_enum("controller", "gloo", ["gloo", "mpi"], "horovodrun controller")
flags.DEFINE_string("network_interface", None, "network interface(s) for horovodrun, e.g. eth0")
flags.DEFINE_float("step_timeout", None, "seconds a training step may take before the job is "
                   "ended (DAPPLE_STEP_TIMEOUT_SECONDS; default 600)")
flags.DEFINE_float("first_step_timeout", None, "the same for a function's first step, which "
                   "also compiles (DAPPLE_FIRST_STEP_TIMEOUT_SECONDS; default 1800)")
flags.DEFINE_bool("dry_run", False, "print the command without running it")


def main(argv):
    from dapple.runtime import launch

    program = list(argv[1:])
    try:
        if not FLAGS.plan and not (FLAGS.runtime == "tensorflow" and FLAGS.hosts):
            raise launch.LaunchError("--plan=plan.json is required (with --runtime=tensorflow, "
                                     "--hosts alone will do for a command that needs no plan, "
                                     "as `dapple topology --measure`)")
        plan = launch.load_plan(FLAGS.plan) if FLAGS.plan else None
        ssh = launch.Ssh(FLAGS.ssh_port, FLAGS.ssh_identity_file)
        hosts = launch.parse_hosts(FLAGS.hosts) if FLAGS.hosts else None
        if FLAGS.runtime == "tensorflow":
            return _tensorflow(plan, program, hosts, ssh)
        if FLAGS.group_devices:
            raise launch.LaunchError("--group_devices goes with --runtime=tensorflow (horovodrun "
                                     "runs one rank per device)")
        command = launch.horovodrun_command(
            plan, program, hosts=hosts,
            horovodrun=FLAGS.horovodrun or launch.default_horovodrun(),
            controller=FLAGS.controller, network_interface=FLAGS.network_interface, ssh=ssh)
        env = launch.launch_env(FLAGS.plan, FLAGS.step_timeout, FLAGS.first_step_timeout)
        print(launch.shell_line(command, env), flush=True)
        if FLAGS.dry_run:
            return 0
        return launch.run(command, env)
    except launch.LaunchError as e:
        print(f"dapple launch: {e}", file=sys.stderr)
        return 2


def _tensorflow(plan, program, hosts, ssh) -> int:
    import os
    from dapple.runtime.tf_cluster import launch as tf_launch
    if FLAGS.dry_run:
        raise tf_launch.LaunchError("--dry_run prints horovodrun's command; "
                                    "--runtime=tensorflow runs no single command")
    env = {"DAPPLE_PLAN": os.path.abspath(FLAGS.plan)} if FLAGS.plan else {}
    return tf_launch.run(plan, program, hosts, env, port=FLAGS.port,
                         group_devices=FLAGS.group_devices, ssh=ssh,
                         say=lambda m: print(f"dapple launch: {m}", file=sys.stderr, flush=True))
