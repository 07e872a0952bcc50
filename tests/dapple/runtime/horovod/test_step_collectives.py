"""The collectives in a traced train step under horovodrun (issue #28): a replicated stage's
gradients are summed in one `hvd.grouped_allreduce` (not one allreduce per variable; a
data-parallel plan's in a few, `GRADIENT_GROUPS`, the same at every M), the loss of a
data-parallel plan rides in them (no collective of its own), and no collective sits in the
data-parallel lane's loop over micro-batches; a pipeline's loss allreduce is on no update's
critical path. Counted in the step's graph and its function library, and in what the
optimizer's updates depend on (scripts/step_graph_rank.py), after two steps ran."""
import json

import pytest

from hvdrun import horovodrun

GROUPS = 4      # dapple.runtime.horovod.transport.GRADIENT_GROUPS (not imported: Horovod)

GROUPED, SINGLE = "HorovodGroupedAllreduce", "HorovodAllreduce"


def reports(ranks, argv):
    result = horovodrun(ranks, ["step_graph_rank.py"] + argv, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    found = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(found) == list(range(ranks)), result.output[-4000:]
    return found


@pytest.mark.horovod
@pytest.mark.parametrize("micro_batches", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_data_parallel_step_is_a_few_grouped_allreduces(micro_batches):
    found = reports(2, ["--replicas=2", f"--micro_batches={micro_batches}"])
    for rank, rep in found.items():
        assert rep["ops"] == {GROUPED: GROUPS}, rep     # gradients and loss, nothing else
        assert rep["loops"] == (1 if micro_batches > 1 else 0), rep
        assert rep["loop_ops"] == {}, rep
        assert rep["gating"] == {GROUPED: GROUPS}, rep  # the update waits for them only
        # M = 1: the stage's calls inlined (its gradients appear one by one); M > 1: the loop
        assert rep["noinline_calls"] == (1 if micro_batches > 1 else 0), rep
        assert rep["losses"] == found[0]["losses"], (rank, rep)


@pytest.mark.horovod
@pytest.mark.parametrize("replicas", [(2, 1), pytest.param((1, 2), marks=pytest.mark.slow)],
                         ids=["2:1", "1:2"])
def test_replicated_stage_of_a_pipeline_is_one_grouped_allreduce(replicas):
    found = reports(3, ["--cuts=2", f"--replicas={replicas[0]},{replicas[1]}",
                        "--micro_batches=2"])
    for rank, rep in found.items():
        grouped = 1 if replicas[rep["stage"]] == 2 else 0
        assert rep["ops"].get(GROUPED, 0) == grouped, rep
        assert rep["ops"].get(SINGLE, 0) == 1, rep  # the global loss
        # The update waits for the replicas' sum and the boundary transfers, not the loss.
        assert rep["gating"].get(GROUPED, 0) == grouped, rep
        assert SINGLE not in rep["gating"], rep
        assert rep["gating"].get("HorovodAlltoall", 0) > 0, rep
        assert rep["losses"] == found[0]["losses"], (rank, rep)
