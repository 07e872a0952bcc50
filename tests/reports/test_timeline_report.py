"""The HTML/markdown strategy report: table cells and speedups against hand-computed values."""
import base64
import re

import pytest

from planner.estimate.pipeline_costs import PipelineCosts
from planner.formats.plan import Estimate, straight_plan
from reports.comparison import Candidate, ReportRow, speedups
from reports.html_report import stage_notation, table_rows, write_report
from planner.estimate.simulator import simulate_plan


def estimate(ms):
    return Estimate(latency_ms=ms, warmup_ms=0.0, steady_ms=0.0, ending_ms=0.0, pivot_stage=0)


def row(gbs=64):
    best = straight_plan([3], num_layers=6, micro_batches=2, global_batch_size=gbs,
                         replicas=[2, 2])
    best.estimate = estimate(20.0)
    dp = straight_plan([], num_layers=6, micro_batches=2, global_batch_size=gbs, replicas=[4])
    dp.estimate = estimate(40.0)
    # Hand timeline of `best` (A, K=[2,1], F=1, B=2, free sends, allreduce 3 on stage 0):
    # stage 0 F0[0,1] F1[1,2] B0[4,6] B1[7,9], allreduce [9,12] -> 12 ms.
    simulation = simulate_plan(best, PipelineCosts([1, 1], [2, 2], [0], [0], [3, 0], [1, 1]))
    return ReportRow(gbs, [Candidate("DAPPLE", best, simulation=simulation),
                           Candidate("best DP", dp),
                           Candidate("PipeDream", None, note="crashed")],
                     single_device_ms=100.0)


def test_stage_notation_is_table_vii_form():
    plan = straight_plan([17], num_layers=26, micro_batches=2, replicas=[14, 2])
    assert stage_notation(plan) == "(0, 16) @ [0-13]; (17, 25) @ [14, 15]"


def test_speedups_over_one_device_and_over_a_named_baseline():
    # DAPPLE was simulated (12 ms, see row()); best DP only has its formula (40 ms).
    r = row()
    assert speedups(r) == {"DAPPLE": 100 / 12, "best DP": 2.5, "PipeDream": None}
    assert speedups(r, baseline="best DP") == {"DAPPLE": 40 / 12, "best DP": 1.0,
                                                "PipeDream": None}
    with pytest.raises(ValueError, match="baseline 'DP' is not a candidate"):
        speedups(r, baseline="DP")


def test_table_has_formula_simulated_and_speedup_cells():
    table = table_rows([row()])
    header, dapple, dp, pipedream = table
    cell = dict(zip(header, dapple))
    assert cell["shape"] == "2:2" and cell["formula ms"] == "20"
    assert cell["simulated ms"] == "12" and cell["sim / formula"] == "0.6"
    assert cell["speedup"] == "8.33"
    assert dict(zip(header, dp))["simulated ms"] == "-"
    assert dict(zip(header, pipedream))["note"] == "crashed"


def test_html_report_embeds_png_pictures(tmp_path):
    path = str(tmp_path / "report.html")
    assert write_report(path, [row(64), row(128)], title="toy model") == [path]
    text = open(path, encoding="utf-8").read()
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    # speedup bars + one timeline per global batch size
    assert len(images) == 3
    assert all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert text.count("<tr>") == 1 + 2 * 3


def test_markdown_report_writes_pictures_next_to_it(tmp_path):
    path = str(tmp_path / "report.md")
    written = write_report(path, [row()])
    assert written == [path, str(tmp_path / "report_0.png"), str(tmp_path / "report_1.png")]
    text = open(path, encoding="utf-8").read()
    assert "![speedups](report_0.png)" in text
    with pytest.raises(ValueError, match=r"must end in \.html"):
        write_report(str(tmp_path / "report.txt"), [row()])
    with pytest.raises(ValueError, match="does not exist; create it first"):
        write_report(str(tmp_path / "missing" / "report.md"), [row()])


def tiny_profile():
    from planner.formats.profile import Layer, Profile
    layers = [Layer(name=f"l{i}", type="Dense", forward_ms=f, backward_ms=2 * f,
                    output_bytes=1000.0, parameter_bytes=4000.0,
                    inputs=(i - 1,))
              for i, f in enumerate([2.0, 3.0, 3.0, 2.0])]
    return Profile(name="tiny", batch_size=4, layers=layers, input_bytes=1000.0)


def test_single_device_reference_runs_every_micro_batch_on_one_device():
    from planner.estimate.cost_model import SMALL_BATCH_HALF_SAMPLES as H, TASK_OVERHEAD_MS
    from reports.comparison import single_device_ms
    from topology.parse import parse_topology
    # The cost model's documented task time: t(b) = T_profile (b + H) / (pbs + H) + overhead.
    # The tiny profile (batch 4) has F = 10 ms, B = 20 ms; global batch 8 in M micro-batches
    # of 8/M samples, M forwards and M backwards, the best M.
    expected = min(M * ((10.0 + 20.0) * (8 / M + H) / (4 + H) + 2 * TASK_OVERHEAD_MS)
                   for M in (1, 2, 4, 8))
    assert single_device_ms(tiny_profile(), parse_topology("1x2"), 8) == pytest.approx(expected)


def test_alternatives_are_keyed_by_enum_in_order_with_none_where_infeasible():
    from reports.comparison import BASELINES, Alternative, alternatives
    from topology.parse import parse_topology
    assert Alternative.other_space("paper") is Alternative.FULL_SPACE
    assert Alternative.other_space("full") is Alternative.PAPER_SPACE
    which = (*BASELINES, Alternative.FULL_SPACE)
    # A global batch of 1 cannot feed two data-parallel replicas; one stage a device can.
    alts = alternatives(tiny_profile(), parse_topology("1x2"), 1, which)
    assert list(alts) == list(which)
    assert alts[Alternative.DATA_PARALLEL] is None
    assert alts[Alternative.STRAIGHT].shape() == "straight"


def test_strategy_row_simulates_every_candidate_and_names_infeasible_ones():
    from planner.formats.plan import PlanError
    from reports.comparison import strategy_row
    from topology.parse import parse_topology

    def refuses(profile, topology, gbs):
        raise PlanError("does not fit; more detail")

    def two_stage(profile, topology, gbs):
        from planner.search.plan_finishing import finish_plan
        return finish_plan(straight_plan([2], num_layers=4, micro_batches=2,
                                         global_batch_size=gbs), profile, topology)

    r = strategy_row(tiny_profile(), parse_topology("1x2"), 8,
                     planners=[("two stages", two_stage), ("refuses", refuses)])
    assert [c.name for c in r.candidates] == ["DAPPLE", "two stages", "refuses"]
    default = strategy_row(tiny_profile(), parse_topology("1x2"), 8, with_held=False)
    assert [c.name for c in default.candidates] == [
        "DAPPLE", "best data parallel", "best straight", "PipeDream"]
    assert r.candidates[2].plan is None and r.candidates[2].note == "does not fit"
    two = r.candidates[1]
    assert two.simulation.num_stages == 2 and two.formula_ms() > 0
    assert r.held is not None or r.candidates[0].plan.num_stages == 1


def test_plan_command_writes_the_report(tmp_path):
    import os
    import subprocess
    import sys
    profile_path = tmp_path / "tiny-pbs-4.txt"
    nodes = [f"node{i} -- Dense{i} -- forward_compute_time={f}, backward_compute_time={2 * f}, "
             f"activation_size=1000.0, parameter_size=4000.0" for i, f in enumerate([2, 3, 3, 2])]
    edges = [f"\tnode{i} -- node{i + 1}" for i in range(3)]
    profile_path.write_text("\n".join(nodes + edges) + "\n")
    report = tmp_path / "report.html"
    dapple = os.path.join(os.path.dirname(sys.executable), "dapple")
    done = subprocess.run([dapple, "plan", f"--profile={profile_path}", "--topology=1x2",
                           "--global_batch_size=8,16", f"--report={report}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = report.read_text(encoding="utf-8")
    # speedup bars + a timeline per global batch size (a held picture only for pipelines)
    assert text.count("data:image/png;base64,") >= 3
    for name in ("DAPPLE", "best data parallel", "best straight", "PipeDream"):
        assert f"<td>{name}</td>" in text
    bad = subprocess.run([dapple, "plan", f"--profile={profile_path}", "--topology=1x2",
                          "--global_batch_size=8", f"--report={tmp_path / 'report.pdf'}"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "must end in .html" in bad.stderr
