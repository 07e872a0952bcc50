"""`dapple topology --measure`: measure the links between a job's processes, write the topology.

    dapple emulate --topology=2x2,net=200Mbps -- dapple topology --measure --format=json
    horovodrun -np 16 -H h1:8,h2:8 --gloo dapple topology --measure --output=topology.json
    dapple launch --runtime=tensorflow --hosts=h1:8,h2:8 -- \
        dapple topology --measure --output=topology.json

The method follows the environment: under `dapple launch --runtime=tensorflow` the chief times
TensorFlow's Send/Recv between the cluster's tasks (`dapple.tf_link_measure`); under horovodrun
or `dapple emulate` every rank takes part and times Horovod's collectives
(`dapple.link_measure`); elsewhere there are no links to time, and it says so. Rank 0 (the
chief) prints the result, as text (default) or the topology JSON (`--format=json`), and with
`--output` writes the JSON atomically (a temporary file renamed into place). The JSON is
`Topology.to_dict()` with a `measured` record (when, how, every measured pair), so `dapple plan
--topology=topology.json` plans on the measured links and its report says they were measured.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("measure", False, "measure the links between this job's processes (Horovod "
                  "ranks, or the tasks of `dapple launch --runtime=tensorflow`)")
flags.DEFINE_enum("format", "text", ["text", "json"], "rank 0 prints a summary or the JSON")
flags.DEFINE_string("output", None, "also write the topology JSON to this file (rank 0)")
flags.DEFINE_string("message_size", "8MiB", "large message for bandwidth (several MB, so the "
                    "per-transfer latency is small beside it)")


def _fail(message: str) -> int:
    print(f"dapple topology: {message}", file=sys.stderr)
    return 2


def write_atomically(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".topology-", suffix=".json", dir=folder)
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _message_bytes(text: str) -> int:
    from topology.errors import TopologyError
    from topology.units import parse_memory
    try:
        return int(parse_memory(text))          # binary units: 8MiB, 8MB alike
    except TopologyError as e:
        raise ValueError(f"--message_size={text}: {e}") from None


NO_LINKS = ("--measure times the links between a job's processes, and this one is alone: run "
            "it under `dapple launch --runtime=tensorflow --hosts=host:slots,... "
            "-- dapple topology --measure` (TensorFlow's Send/Recv between the tasks), or under "
            "horovodrun or `dapple emulate` (Horovod's collectives between the ranks)")


def _measure_horovod(large: int):
    """Every rank measures; rank 0 gets the Topology, the others None."""
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"   # one process set per measured pair
    import horovod.tensorflow as hvd
    from dapple import link_measure
    hvd.init()
    return link_measure.measure(large)


def main(argv):
    if len(argv) > 1:
        return _fail(f"unexpected arguments {argv[1:]}")
    if not FLAGS.measure:
        return _fail("say what to do: --measure (under horovodrun, dapple emulate or dapple "
                     "launch --runtime=tensorflow)")
    try:
        large = _message_bytes(FLAGS.message_size)
    except ValueError as e:
        return _fail(str(e))
    if large < 1024:
        return _fail(f"--message_size={FLAGS.message_size} is too small to time bandwidth; "
                     f"use several MB")
    if FLAGS.output and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.output))):
        return _fail(f"--output={FLAGS.output}: its directory does not exist")
    from dapple.runtime.tf_cluster.cluster import in_cluster
    if in_cluster():
        from dapple import tf_link_measure
        topology = tf_link_measure.measure(large)
    elif "HOROVOD_RANK" in os.environ:
        topology = _measure_horovod(large)
        if topology is None:                           # not rank 0
            return 0
    else:
        return _fail(NO_LINKS)
    from dapple.measured_topology import summary_lines
    text = json.dumps(topology.to_dict(), indent=2)
    if FLAGS.output:
        write_atomically(FLAGS.output, text + "\n")
    if FLAGS.format == "json":
        print(json.dumps(topology.to_dict()))          # one line: easy to cut out of rank logs
    else:
        print("\n".join(summary_lines(topology)))
        if FLAGS.output:
            print(f"topology written to {FLAGS.output}")
    return 0
