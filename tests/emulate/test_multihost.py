"""Across emulated hosts (2 hosts x 1 rank, a shaped link between them): a 2-stage pipeline,
one stage per host, computes the plain Keras model's gradients and, after 3 Adam steps, its
weights; and a rank that fails on one host ends the job within 60 s, named. The rank program
is the one of the single-machine Horovod tests (`tests/horovod/scripts/pipelined_rank.py`)."""
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
