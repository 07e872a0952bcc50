"""Across emulated hosts (a shaped link between them): a 2-stage pipeline, one stage per host
(2 hosts x 1 rank), and a replicated one (2 x 2: two replicas a stage, either each stage on a
host of its own, so the boundary crosses the hosts, or each stage's replicas on both hosts, so
its allreduce does) compute the plain Keras model's gradients and, after 3 Adam steps, its
weights; and a rank that fails on one host ends the job within 60 s, named. The rank program
is the one of the single-machine Horovod tests (`tests/dapple/runtime/horovod/scripts/pipelined_rank.py`)."""
import json
import re

import pytest

from emulaterun import emulate, leftovers

TOLERANCE = 1e-5
DEADLINE = 60
CLUSTER = "2x1,net=1Gbps"


@pytest.mark.horovod
def test_two_stage_pipeline_across_hosts_equals_the_plain_model(can_emulate):
    result = emulate(CLUSTER, ["pipelined_rank.py", "--cuts=2", "--replicas=1,1",
                               "--micro_batches=4", "--schedule=A"], timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    reports = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(reports) == [0, 1], result.output[-4000:]
    for rank, rep in reports.items():
        assert rep["stage"] == rank                      # stage s on host s
        assert rep["own_gradients"] == rep["stage_variables"] > 0, rep
        assert rep["grad_diff"] < TOLERANCE, rep
        assert rep["loss_diff"] < TOLERANCE, rep
        assert rep["weight_diff"] < TOLERANCE, rep
    assert leftovers(result) == []


@pytest.mark.horovod
@pytest.mark.parametrize("stage_devices", ["0,1/2,3", "0,2/1,3"],
                         ids=["boundary_crosses_hosts", "allreduce_crosses_hosts"])
def test_replicated_pipeline_across_hosts_equals_the_plain_model(can_emulate, stage_devices):
    # Host 0 holds ranks 0 and 1, host 1 ranks 2 and 3.
    result = emulate("2x2,net=1Gbps", ["pipelined_rank.py", "--cuts=2", "--replicas=2,2",
                                       f"--stage_devices={stage_devices}", "--micro_batches=2",
                                       "--schedule=A"], timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    reports = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(reports) == [0, 1, 2, 3], result.output[-4000:]
    for stage, ranks in enumerate(stage_devices.split("/")):
        for replica, rank in enumerate(int(r) for r in ranks.split(",")):
            rep = reports[rank]
            assert (rep["stage"], rep["replica"]) == (stage, replica), rep
            assert rep["own_gradients"] == rep["stage_variables"] > 0, rep
            assert rep["grad_diff"] < TOLERANCE, rep
            assert rep["loss_diff"] < TOLERANCE, rep
            assert rep["weight_diff"] < TOLERANCE, rep
    assert leftovers(result) == []


@pytest.mark.horovod
def test_a_rank_failing_on_one_host_ends_the_job_naming_it(can_emulate):
    result = emulate(CLUSTER, ["pipelined_rank.py", "--cuts=2", "--replicas=1,1",
                               "--fail_step=2", "--fail_rank=1"], timeout=DEADLINE)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert ("[1]<stderr>:dapple: rank 1 (stage 1, replica 0) failed: RuntimeError: injected "
            "failure in step 2") in result.output, result.output[-3000:]
    # The launcher names the first rank it saw exit: the failing one, or its peer whose
    # collective Horovod shut down (whichever process ends first).
    assert re.search(r"dapple emulate: rank [01] \(host [01]\) exited with status 1; ending",
                     result.output), result.output[-3000:]
    assert "DAPPLE_RESULT" not in result.output
    assert leftovers(result) == []
