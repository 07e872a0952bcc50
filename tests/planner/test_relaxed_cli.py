"""`dapple simulate` and `dapple plan` with the relaxed schedules: the issue's bubble target read
from the JSON the command prints (the working by hand is in test_simulator_multi_batch.py), a
plan equal to the library's, the report's alternatives, and clear errors."""
import json

import pytest

from planner.formats.plan import Plan
from planner.search.plan_space import plan_dapple
from planner.search.schedule_choice import choose_schedule
from tests.planner.test_schedule_cli import dapple, simulated, toy_files, uniform_files, write
from topology import parse_topology


def test_issue_target_through_dapple_simulate(tmp_path):
    # p = 4, m = 8, F = 1, B = 2: 1F1B (a flush every batch) idles 9 of 33 per batch; 2BW and
    # PipeDream over k = 4 batches idle 9 of 105: bubble 3/11 against 3/35.
    straight = uniform_files(tmp_path, 4, 1, 2)
    one = simulated(*straight)
    assert (one["iteration_ms"], one["bubble_fraction"]) == (33.0, pytest.approx(3 / 11))
    for name, copies, stale in [("2bw", [2] * 4, [1] * 4),
                                ("pipedream", [4, 3, 2, 1], [3, 2, 1, 0])]:
        out = simulated(*straight, f"--schedule={name}", "--batches=4")
        assert out["schedule"] == {"name": name, "warmup": [4, 3, 2, 1], "batches": 4}
        assert (out["iteration_ms"], out["batches"], out["batch_ms"]) == (105.0, 4, 26.25)
        assert [s["idle_ms"] for s in out["stages"]] == [9.0] * 4
        assert one["bubble_fraction"] - out["bubble_fraction"] == pytest.approx(72 / 385)
        assert [s["weight_copies"] for s in out["stages"]] == copies
        assert [s["staleness"] for s in out["stages"]] == stale


def test_avgpipe_plans_run_a_pipeline_per_replica(tmp_path):
    # 2 stages on 2 devices each, M = 4, 2 batches: each pipeline runs the same lists with the
    # costs given (one pipeline's); 2 pipelines consume 4 global batches in the run.
    plan = write(tmp_path / "avg.json", {
        "version": 2, "micro_batches": 4, "schedule": {"name": "avgpipe", "batches": 2},
        "stages": [{"layers": [0, 0], "devices": [0, 1]}, {"layers": [1, 1], "devices": [2, 3]}]})
    costs = write(tmp_path / "c.json", {"forward_ms": [1, 1], "backward_ms": [2, 2],
                                        "send_forward_ms": [0], "send_backward_ms": [0],
                                        "allreduce_ms": [0.5, 0.5]})
    out = simulated(f"--plan={plan}", f"--costs={costs}")
    # Per batch 1F1B on 2 stages, 4 micro-batches: (4 + 1) x 3 = 15, then the update and the
    # allreduce of the updates (0.5) on each stage before the next batch: 15.5 + 15 + 0.5 = 31.
    assert (out["iteration_ms"], out["pipelines"], out["batch_ms"]) == (31.0, 2, 31.0 / 4)
    assert [s["weight_copies"] for s in out["stages"]] == [2, 2]
    assert [s["allreduce_ms"] for s in out["stages"]] == [1.0, 1.0]


def test_plan_under_a_relaxed_schedule_equals_the_library(tmp_path):
    path, profile = toy_files(tmp_path)
    done = dapple("plan", f"--profile={path}", "--topology=2x2,net=1Gbps",
                  "--global_batch_size=64", "--schedule=2bw", "--batches=3", "--format=json")
    assert done.returncode == 0, done.stderr
    got = Plan.from_json(done.stdout)
    topo = parse_topology("2x2,net=1Gbps")
    want = choose_schedule(plan_dapple(profile, topo, 64), profile, topo, "2bw", batches=3)[0]
    assert (got.schedule, got.batches, got.warmup) == ("2bw", 3, want.warmup)
    assert got.estimate.latency_ms == pytest.approx(want.estimate.latency_ms)
    assert json.loads(done.stdout)["schedule"]["name"] == "2bw"


def test_plan_report_lists_the_relaxed_schedules_with_their_staleness(tmp_path):
    path, _ = toy_files(tmp_path)
    done = dapple("plan", f"--profile={path}", "--topology=2x2,net=1Gbps",
                  "--global_batch_size=64", "--schedule=auto")
    assert done.returncode == 0, done.stderr
    assert "| schedule (opt-in) | ms per global batch |" in done.stdout
    for words in ("| pipedream (4 batches) |", "| 2bw (4 batches) |",
                  "| avgpipe (2 pipeline(s), advance", "stage s K_s - 1 updates stale",
                  "1 update stale on every stage", "z <- z + (1/N) sum_i Delta_i",
                  "`--schedule=auto` never takes one"):
        assert words in done.stdout, words
    assert "schedule auto" not in done.stdout
    plan_line = next(l for l in done.stdout.splitlines() if l.startswith("Plan **"))
    assert not any(f"schedule {n}" in plan_line for n in ("pipedream", "2bw", "avgpipe"))


@pytest.mark.parametrize("command,args,words", [
    ("plan", ["--schedule=1f1b", "--batches=2"], "--batches applies to --schedule=pipedream"),
    ("simulate", ["--batches=2"], "--batches applies to the relaxed schedules"),
    ("simulate", ["--schedule=2bw", "--batches=0"], "must be a positive integer"),
])
def test_batches_flags_are_checked(tmp_path, command, args, words):
    if command == "plan":
        path, _ = toy_files(tmp_path)
        base = [f"--profile={path}", "--topology=2x2,net=1Gbps", "--global_batch_size=64"]
    else:
        base = list(uniform_files(tmp_path, 4, 1, 2))
    done = dapple(command, *base, *args)
    assert done.returncode == 2 and words in done.stderr, done.stderr
