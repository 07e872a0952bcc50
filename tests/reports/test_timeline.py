"""Timeline and held-activation pictures: rows, numbers and legend, checked on the figure's
artists against the plan's devices and hand-worked timelines."""
import json
import os
import subprocess
import sys

import pytest

from planner.estimate.pipeline_costs import PipelineCosts
from planner.formats.plan import straight_plan
from planner.schedules.by_name import pipeline_schedule
from planner.estimate.simulator import simulate, simulate_plan
from tests.paths import published_profile
from reports.timeline import (MAX_DEVICE_ROWS, figure_png, held_activations_figure,
                              save_figure, timeline_figure)


def costs(p, forward=10.0, backward=20.0, send=0.0, allreduce=0.0):
    return PipelineCosts([forward] * p, [backward] * p, [send] * (p - 1), [send] * (p - 1),
                         [allreduce] * p, [1.0] * p)


def test_one_row_per_device_with_numbered_boxes_and_a_legend():
    # 2:1 plan, M=2, F=10, B=20, allreduce 5 ms, no transfers.
    # Hand timeline (policy A, K=[2,1]): stage 0 F0[0,10] F1[10,20] B0[40,60] B1[70,90];
    # stage 1 F0[10,20] B0[20,40] F1[40,50] B1[50,70].
    plan = straight_plan([3], num_layers=5, micro_batches=2, replicas=[2, 1])
    result = simulate_plan(plan, costs(2, allreduce=5.0))
    fig = timeline_figure(result, plan, title="t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "dev 0 | stage 0", "dev 1 | stage 0", "dev 2 | stage 1"]
    numbers = sorted((round(t.get_position()[1]), t.get_position()[0], t.get_text())
                     for t in ax.texts)
    expected_stage0 = [(5, "0"), (15, "1"), (50, "0"), (80, "1")]
    expected_stage1 = [(15, "0"), (30, "0"), (45, "1"), (60, "1")]
    assert numbers == sorted([(row, x, n) for row in (0, 1) for x, n in expected_stage0] +
                             [(2, x, n) for x, n in expected_stage1])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "allreduce", "idle (bubble)"]
    assert ax.get_xlabel() == "time (ms)"


def test_links_get_rows_and_transfers_are_drawn_when_they_cost_time():
    plan = straight_plan([1, 2], num_layers=3, micro_batches=3)
    result = simulate_plan(plan, costs(3, send=4.0))
    ax = timeline_figure(result, plan).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["dev 0 | stage 0", "dev 1 | stage 1", "dev 2 | stage 2",
                      "link 0\u21941", "link 1\u21942"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "transfer: activations" in legend and "transfer: gradients" in legend


def test_large_plans_get_one_row_per_stage():
    plan = straight_plan([2], num_layers=4, micro_batches=2, replicas=[MAX_DEVICE_ROWS, 1])
    ax = timeline_figure(simulate_plan(plan, costs(2)), plan).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"dev 0-{MAX_DEVICE_ROWS - 1} (x{MAX_DEVICE_ROWS}) | stage 0",
        f"dev {MAX_DEVICE_ROWS} | stage 1"]


def test_held_activations_lines_follow_the_hand_worked_counts():
    # p=2, m=3, F=1, B=2, GPipe. Stage 0: F0[0,1] F1[1,2] F2[2,3], so it holds 1, 2, 3 from
    # t = 0, 1, 2. Stage 1: F0[1,2] F1[2,3] F2[3,4] B0[4,6] B1[6,8] B2[8,10]; then stage 0
    # runs B0[6,8] B1[8,10] B2[10,12], dropping to 2, 1, 0 at t = 8, 10, 12.
    schedule_costs = costs(2, forward=1.0, backward=2.0)
    gpipe = simulate(pipeline_schedule(2, 3, "gpipe"), schedule_costs)
    early = simulate(pipeline_schedule(2, 3, "A"), schedule_costs)
    fig = held_activations_figure({"GPipe": gpipe, "early": early}, stages=[0])
    lines = fig.axes[0].get_lines()
    xs, ys = list(lines[0].get_xdata()), list(lines[0].get_ydata())
    assert list(zip(xs, ys)) == [(0, 1), (1, 2), (2, 3), (8, 2), (10, 1), (12, 0), (12, 0)]
    assert max(lines[1].get_ydata()) == 2
    assert "peak 3" in lines[0].get_label() and "peak 2" in lines[1].get_label()


def test_pictures_are_written_as_png(tmp_path):
    plan = straight_plan([1], num_layers=2, micro_batches=4)
    result = simulate_plan(plan, costs(2, send=1.0))
    path = str(tmp_path / "t.png")
    save_figure(timeline_figure(result, plan), path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert figure_png(timeline_figure(result, plan))[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.pdf"):
        save_figure(timeline_figure(result, plan), str(tmp_path / "t.jpeg"))


def run_cli(*args):
    # The installed console script: `dapple simulate` runs planner-only (no TensorFlow).
    dapple = os.path.join(os.path.dirname(sys.executable), "dapple")
    return subprocess.run([dapple, "simulate", *args], capture_output=True, text=True,
                          timeout=120)


def test_simulate_command_prints_json_and_draws(tmp_path):
    plan = straight_plan([1], num_layers=2, micro_batches=2)
    plan_path, costs_path = str(tmp_path / "plan.json"), str(tmp_path / "costs.json")
    plan.save(plan_path)
    with open(costs_path, "w") as f:
        # Hand timeline (A, K=[2,1], F=1, B=2, sends 0): stage 0 F0[0,1] F1[1,2] B0[4,6]
        # B1[7,9]; allreduce 2 on stage 0 -> iteration 11.
        json.dump({"forward_ms": [1, 1], "backward_ms": [2, 2], "send_forward_ms": [0],
                   "send_backward_ms": [0], "allreduce_ms": [2, 0],
                   "activation_bytes": [5, 5]}, f)
    timeline_path, held_path = str(tmp_path / "t.png"), str(tmp_path / "h.png")
    done = run_cli(f"--plan={plan_path}", f"--costs={costs_path}", "--format=json",
                   f"--output={timeline_path}", f"--held_output={held_path}")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["iteration_ms"] == 11
    assert [s["busy_ms"] for s in out["stages"]] == [6, 6]
    assert [s["idle_ms"] for s in out["stages"]] == [3, 5]
    assert [s["peak_held_micro_batches"] for s in out["stages"]] == [2, 1]
    assert os.path.getsize(timeline_path) > 1000 and os.path.getsize(held_path) > 1000


# tests/planner/estimate/test_simulator.py's hand examples through the command line.
# Two stages (F=1, B=2, sends 0.5, allreduce 3 and 1, M=2, A): 13 ms; with rendezvous, send F1
# waits for stage 1's receive at 4.5: 13.5 ms.
TWO_STAGES = ([1], {"forward_ms": [1, 1], "backward_ms": [2, 2], "send_forward_ms": [0.5],
                    "send_backward_ms": [0.5], "allreduce_ms": [3, 1], "activation_bytes": [5, 5]})
# Three stages (M=2, A, F=B=1, send forward 2, backward 1): 14 ms on full-duplex links, 16 ms
# with one transfer per device at a time, 19 ms with rendezvous too (a plan for horovodrun).
THREE_STAGES = ([1, 2], {"forward_ms": [1, 1, 1], "backward_ms": [1, 1, 1],
                         "send_forward_ms": [2, 2], "send_backward_ms": [1, 1],
                         "allreduce_ms": [0, 0, 0], "activation_bytes": [5, 5, 5]})


@pytest.mark.parametrize("example,transfers,flags,plain_ms,flagged_ms,says", [
    (TWO_STAGES, "async", ["--rendezvous"], 13, 13.5, ["rendezvous transfers"]),
    (THREE_STAGES, "async", ["--link_duplex=serial"], 14, 16,
     ["one transfer at a time per device"]),
    (THREE_STAGES, "horovod", ["--link_duplex=full", "--norendezvous"], 19, 14,
     ["one transfer at a time per device", "rendezvous transfers"]),
])
def test_simulate_command_follows_the_hand_timelines(tmp_path, example, transfers, flags,
                                                     plain_ms, flagged_ms, says):
    boundaries, costs = example
    plan_path, costs_path = str(tmp_path / "plan.json"), str(tmp_path / "costs.json")
    plan = straight_plan(boundaries, num_layers=len(boundaries) + 1, micro_batches=2)
    plan.transfers = transfers
    plan.save(plan_path)
    with open(costs_path, "w") as f:
        json.dump(costs, f)
    for extra, want in (([], plain_ms), (flags, flagged_ms)):
        done = run_cli(f"--plan={plan_path}", f"--costs={costs_path}", "--format=json", *extra)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["iteration_ms"] == want
    text = run_cli(f"--plan={plan_path}", f"--costs={costs_path}",
                   *(flags if transfers == "async" else [])).stdout
    assert all(words in text for words in says)


def test_held_comparison_simulates_with_the_transfers_asked_for():
    # TWO_STAGES's plan (policy A): early backward 13 ms, 13.5 with rendezvous, as above.
    from reports.comparison import held_comparison
    boundaries, costs = TWO_STAGES
    plan = straight_plan(boundaries, num_layers=2, micro_batches=2, schedule="A")
    costs = PipelineCosts(**costs)
    for rendezvous, want in ((None, 13), (True, 13.5)):
        held = held_comparison(plan, costs, rendezvous=rendezvous)
        assert held["early backward (A)"].iteration_ms == want


def test_simulate_command_explains_missing_inputs(tmp_path):
    plan_path = str(tmp_path / "plan.json")
    straight_plan([1], num_layers=2, micro_batches=2).save(plan_path)
    done = run_cli(f"--plan={plan_path}")
    assert done.returncode == 2
    assert "pass --profile and --topology" in done.stderr
    done = run_cli(f"--plan={tmp_path / 'nope.json'}")
    assert done.returncode == 2 and "nope.json" in done.stderr


def test_simulate_command_with_profile_and_topology_matches_the_library(tmp_path):
    # The command must simulate the plan with the cost model's durations, nothing else.
    from planner.estimate.cost_model import pipeline_costs
    from planner.formats.profile_readers import load_profile
    from topology.parse import parse_topology
    profile_path = published_profile("dapple/bert-48-pbs-2.txt")
    profile, topology = load_profile(profile_path), parse_topology("A")
    plan = straight_plan([20], num_layers=profile.num_layers, micro_batches=4,
                         global_batch_size=64, replicas=[8, 8])
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    done = run_cli(f"--plan={plan_path}", f"--profile={profile_path}", "--topology=A",
                   "--format=json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    expected = simulate_plan(plan, pipeline_costs(plan, profile, topology))
    assert out["iteration_ms"] == pytest.approx(expected.iteration_ms)
    assert [s["peak_held_micro_batches"] for s in out["stages"]] == [2, 1]
