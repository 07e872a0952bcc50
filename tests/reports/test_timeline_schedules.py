"""Timeline pictures of the split backward and of interleaved plans, checked on the figure's
artists: I and W in the legend and apart on every row; one row per device of an interleaved
plan (not per chunk), its later chunks hatched."""
import pytest

from planner.estimate.pipeline_costs import PipelineCosts
from planner.formats.plan import Plan
from planner.schedules.by_name import build_schedule
from planner.estimate.simulator import simulate, simulate_plan
from reports.timeline import held_activations_figure, timeline_figure

pytest.importorskip("matplotlib")


def uniform(chunks, forward, backward):
    return PipelineCosts([forward] * chunks, [backward] * chunks, [0.0] * (chunks - 1),
                         [0.0] * (chunks - 1), [0.0] * chunks)


def test_split_backward_draws_I_and_W_apart():
    result = simulate(build_schedule("zb-h1", 2, 2), uniform(2, 1.0, 2.0))
    ax = timeline_figure(result).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward: input gradient (I)",
                      "backward: weight gradient (W)", "idle (bubble)"]
    # By hand (F = I = W = 1): stage 1 runs 1F0 [1,2) 1I0 [2,3) 1F1 [3,4) 1I1 [4,5) 1W0 [5,6)
    # 1W1 [6,7); the numbers sit at the box centres of row 1.
    row1 = sorted((t.get_position()[0], t.get_text()) for t in ax.texts
                  if round(t.get_position()[1]) == 1)
    assert row1 == [(1.5, "0"), (2.5, "0"), (3.5, "1"), (4.5, "1"), (5.5, "0"), (6.5, "1")]


def test_an_interleaved_plan_gets_one_row_per_device_and_hatched_later_chunks():
    plan = Plan.from_dict({"version": 2, "micro_batches": 2,
                           "schedule": {"name": "interleaved", "virtual_stages": 2},
                           "stages": [{"layers": [c, c], "devices": [c % 2]}
                                      for c in range(4)]})
    result = simulate_plan(plan, uniform(4, 0.5, 1.0))
    fig = timeline_figure(result, plan)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["dev 0 | stage 0",
                                                            "dev 1 | stage 1"]
    hatched = [c for c in ax.collections if c.get_hatch()]
    later = [e for e in result.events if e.kind in ("forward", "backward") and e.stage >= 2]
    assert len(hatched) == len(later) == 2 * 2 * 2       # 2 chunks x 2 micro-batches x F, B
    assert "hatched: later chunks of a device group" in ax.get_title()
    held_activations_figure({"interleaved": result}, stages=[0, 1])   # draws per device
