"""The relaxed schedules on TensorFlow's distributed runtime: under `dapple launch
--runtime=tensorflow`, PipeDream, PipeDream-2BW and AvgPipe train by their rules. The script
(`tests/dapple/runtime/horovod/scripts/relaxed_rank.py`, run once, as the chief) compares every
weight with the schedule's rule computed on the plain Keras model (`tests/relaxed_rules.py`)
within 1e-5, and with synchronous training on the same data, from which it must be far; plain
SGD for 5 steps cut into runs of 2 and 3 global batches (or by `fit`), M = 4."""
import json

import pytest

from tfrun import cluster_of, plan_file, processes_with, tf_launch

TOLERANCE = 1e-5
FAR = 1e-3

CASES = [
    # (id, processes, script arguments, default suite)
    ("2bw-2", 2, ["--schedule=2bw", "--cuts=2", "--replicas=1,1"], True),
    ("pipedream-2", 2, ["--schedule=pipedream", "--cuts=2", "--replicas=1,1"], True),
    ("pipedream-3-vsync", 3, ["--schedule=pipedream", "--cuts=1,3", "--replicas=1,1,1",
                              "--vertical_sync", "--runs=1,4"], False),
    ("pipedream-2:1", 3, ["--schedule=pipedream", "--cuts=2", "--replicas=2,1"], False),
    ("avgpipe-2x2", 4, ["--schedule=avgpipe", "--cuts=2", "--replicas=2,2", "--advance=1"],
     False),
    # Keras's own fit, runs of 2, 2 and 1 global batches a Keras step.
    ("2bw-2-fit", 2, ["--schedule=2bw", "--cuts=2", "--replicas=1,1", "--fit=2"], True),
    # Looped (`pipeline_loop=True`): PipeDream's updates inside the loop's body.
    ("pipedream-2-looped", 2, ["--schedule=pipedream", "--cuts=2", "--replicas=1,1", "--loop"],
     True),
]


@pytest.mark.horovod
@pytest.mark.parametrize("processes, args", [
    pytest.param(n, a, marks=() if default else pytest.mark.slow, id=c)
    for c, n, a, default in CASES])
def test_weights_follow_the_rule(tmp_path, processes, args):
    result = tf_launch(plan_file(tmp_path, processes), ["relaxed_rank.py"] + args, timeout=420)
    assert result.returncode == 0, result.output[-4000:]
    reports = [json.loads(t) for t in result.results().values()]
    assert len(reports) == 1, result.output[-4000:]      # the script ran once, as the chief
    assert reports[0]["rule_diff"] < TOLERANCE, reports[0]
    assert reports[0]["sync_diff"] > FAR, reports[0]
    assert (reports[0]["schedule_loops"] > 0) == ("--loop" in args), reports[0]
    assert processes_with(f"--cluster={cluster_of(result)}") == [], "a server outlived the job"
