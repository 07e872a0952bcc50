"""A pipeline's steady periods as loops under `horovodrun` (`pipeline_loop=True`, issue #28).

Every rank cuts the whole plan's lists into the same warm-up, loops and cool-down, builds its own
units' tasks, and names a loop's transfers by their slot in the period. Checked as
test_transparency_horovod.py checks the unrolled step: each rank computes the plain Keras
model's gradients, loss and weights after 3 Adam steps itself (scripts/pipelined_rank.py), with
different data in every micro-batch, and reports that its step was built with loops. And the
traced step's collectives (scripts/step_graph_rank.py): a while loop holds the boundary
transfers, whose count is the same at M=4 and M=8 (unrolled, a rank has one per micro-batch and
direction).
"""
import json

import pytest

from hvdrun import horovodrun
from test_transparency_horovod import check_ranks

CASES = [
    # (id, ranks, script arguments)
    ("1f1b", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=A"]),
    ("gpipe", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=gpipe"]),
    ("zb-h1", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=zb-h1"]),
    # two chunks per rank; a period advances a group of micro-batches
    ("interleaved-v2", 2, ["--cuts=1,2,3", "--replicas=1,1", "--micro_batches=8",
                           "--virtual_stages=2", "--global_batch=32"]),
    # stage 0 on two ranks: one alltoall per slot splits the boundary's rows
    ("2:1", 3, ["--cuts=2", "--replicas=2,1", "--micro_batches=4", "--schedule=A"]),
    # stage 1 on two ranks: one send per slot serves both receivers
    ("1:2-gpipe", 3, ["--cuts=3", "--replicas=1,2", "--micro_batches=4", "--schedule=gpipe"]),
    # dict inputs, the second entering late (relayed across a cut), two outputs
    ("two_in_two_out-1:2:1", 4, ["--model=two_in_two_out", "--cuts=1,4", "--replicas=1,2,1",
                                 "--micro_batches=4", "--schedule=A"]),
]


# In the slow suite, for time: two_in_two_out-1:2:1 also sends one slot to two receivers,
# and gpipe loops GPipe.
SLOW_IDS = {"1:2-gpipe"}


@pytest.mark.horovod
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c[0] in SLOW_IDS
                                               else ()) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_looped_pipeline_trains_as_plain_keras(case):
    name, ranks, args = case
    result = horovodrun(ranks, ["pipelined_rank.py", "--pipeline_loop"] + args, timeout=300)
    reports = check_ranks(result, ranks)
    for rep in reports.values():
        assert rep["schedule_loops"] > 0, rep      # the step was built with its loops


def collectives(micro_batches):
    result = horovodrun(2, ["step_graph_rank.py", "--cuts=2", "--replicas=1,1",
                            f"--micro_batches={micro_batches}", "--global_batch=32",
                            "--pipeline_loop"], timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    found = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(found) == [0, 1], result.output[-4000:]
    return found


@pytest.mark.horovod
def test_looped_step_collectives_do_not_grow_with_micro_batches():
    few, many = collectives(4), collectives(8)
    for rank in (0, 1):
        for rep in (few[rank], many[rank]):
            assert rep["loops"] >= 1, rep
            assert rep["loop_ops"].get("HorovodAlltoall", 0) > 0, rep   # transfers in the loop
        assert few[rank]["ops"] == many[rank]["ops"], (few[rank], many[rank])
        # unrolled, M=8 alone needs 2 * 8 boundary transfers on each rank
        assert many[rank]["ops"]["HorovodAlltoall"] < 2 * 8, many[rank]
