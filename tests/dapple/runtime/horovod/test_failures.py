"""Failures end the whole job: non-zero exit, the failing rank and its error in the output, and
no rank left waiting. Each job runs under a 60 s deadline (the issue's bound); a job that
outlives it is killed and the test fails."""
import pytest

from hvdrun import horovodrun

DEADLINE = 60


@pytest.mark.horovod
def test_plain_horovod_rank_raising_in_step_2_ends_the_job():
    """What horovodrun itself does (no dapple): the reference for the runtime's behaviour."""
    result = horovodrun(2, ["plain_horovod_fail.py", "--fail_rank=1"], timeout=DEADLINE)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert "[1]<stderr>:RuntimeError: injected failure on rank 1 in step 2" in result.output
    assert "rank 0 step 2" not in result.output     # the peer never finished step 2


@pytest.mark.horovod
def test_pipelined_rank_raising_in_step_2_ends_the_job():
    result = horovodrun(3, ["pipelined_rank.py", "--cuts=2", "--replicas=1,2",
                            "--fail_step=2", "--fail_rank=1"], timeout=DEADLINE)
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert ("[1]<stderr>:dapple: rank 1 (stage 1, replica 0) failed: RuntimeError: injected "
            "failure in step 2") in result.output, result.output[-3000:]
    assert "DAPPLE_RESULT" not in result.output


@pytest.mark.horovod
def test_pipelined_rank_hanging_in_step_2_ends_the_job():
    """A rank that hangs (no exception): its peers' watchdogs end the job, naming themselves
    and the stalled step."""
    result = horovodrun(2, ["pipelined_rank.py", "--cuts=2", "--replicas=1,1",
                            "--stall_step=2", "--stall_rank=0"], timeout=DEADLINE,
                        env={"DAPPLE_STEP_TIMEOUT_SECONDS": "10"})
    assert not result.timed_out, result.output[-3000:]
    assert result.returncode != 0
    assert ("[1]<stderr>:dapple: rank 1 (stage 1, replica 0): gradients step did not finish "
            "within 10 s") in result.output, result.output[-3000:]
