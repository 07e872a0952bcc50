"""The collectives in a traced train step under horovodrun (issue #28): a replicated stage's
gradients are summed in one `hvd.grouped_allreduce` (not one allreduce per variable), the loss
of a data-parallel plan rides in it (no collective of its own), and no collective sits in the
data-parallel lane's loop over micro-batches. Counted in the step's graph and its function
library (scripts/step_graph_rank.py), after two steps ran."""
import json

import pytest

from hvdrun import horovodrun

GROUPED, SINGLE = "HorovodGroupedAllreduce", "HorovodAllreduce"


def reports(ranks, argv):
    result = horovodrun(ranks, ["step_graph_rank.py"] + argv, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    found = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(found) == list(range(ranks)), result.output[-4000:]
    return found


@pytest.mark.horovod
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_data_parallel_step_is_one_grouped_allreduce(micro_batches):
    found = reports(2, ["--replicas=2", f"--micro_batches={micro_batches}"])
    for rank, rep in found.items():
        assert rep["ops"] == {GROUPED: 1}, rep      # gradients and loss, one collective
        assert rep["loops"] == (1 if micro_batches > 1 else 0), rep
        assert rep["loop_ops"] == {}, rep
        assert rep["losses"] == found[0]["losses"], (rank, rep)


@pytest.mark.horovod
def test_replicated_stage_of_a_pipeline_is_one_grouped_allreduce():
    found = reports(3, ["--cuts=2", "--replicas=2,1", "--micro_batches=2"])
    for rank, rep in found.items():
        grouped = 1 if rep["stage"] == 0 else 0     # stage 0 has 2 replicas, stage 1 one
        assert rep["ops"].get(GROUPED, 0) == grouped, rep
        assert rep["ops"].get(SINGLE, 0) == 1, rep  # the global loss
        assert rep["losses"] == found[0]["losses"], (rank, rep)
