"""`dapple simulate` and `dapple plan` with --schedule: the issue's targets read from the JSON
the command prints (each stage's idle_ms), plans under each schedule equal to the library's,
and clear errors. Expected values are computed by hand (see test_simulator_schedules.py for the
working) or by the library called directly."""
import json
import os
import subprocess
import sys

import pytest

from planner.estimate.cost_model import pipeline_costs
from planner.formats.plan import Plan
from planner.search.plan_space import plan_dapple
from planner.search.schedule_choice import choose_schedule
from planner.estimate.simulator import simulate_plan
from tests.planner.search.test_schedule_choice import toy_profile
from topology import parse_topology


def dapple(command, *args):
    exe = os.path.join(os.path.dirname(sys.executable), "dapple")
    return subprocess.run([exe, command, *args], capture_output=True, text=True, timeout=120)


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def uniform_files(tmp_path, chunks, forward, backward, virtual_stages=None):
    """A hand-written plan of `chunks` one-layer stages on 4 devices and its costs."""
    schedule = {"name": "interleaved", "virtual_stages": virtual_stages} if virtual_stages \
        else {"name": "1f1b"}
    plan = {"version": 2, "micro_batches": 8, "schedule": schedule,
            "stages": [{"layers": [c, c], "devices": [c % 4]} for c in range(chunks)]}
    costs = {"forward_ms": [forward] * chunks, "backward_ms": [backward] * chunks,
             "send_forward_ms": [0] * (chunks - 1), "send_backward_ms": [0] * (chunks - 1),
             "allreduce_ms": [0] * chunks}
    return (f"--plan={write(tmp_path / f'plan{chunks}.json', plan)}",
            f"--costs={write(tmp_path / f'costs{chunks}.json', costs)}")


def simulated(*args):
    done = dapple("simulate", *args, "--format=json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_issue_targets_through_dapple_simulate(tmp_path):
    # p = 4, m = 8, F = 1, B = 2 (I = W = 1), no communication. By hand: 1F1B idles 9 per
    # device, ZB-H1 3 = (p-1)(F+I-W), interleaved v = 2 (chunks F = 0.5, B = 1) 4.5.
    straight = uniform_files(tmp_path, 4, 1, 2)
    one = simulated(*straight)
    zero = simulated(*straight, "--schedule=zb-h1")
    inter = simulated(*uniform_files(tmp_path, 8, 0.5, 1, virtual_stages=2))
    assert (one["schedule"]["name"], zero["schedule"]["name"]) == ("1f1b", "zb-h1")
    assert inter["schedule"] == {"name": "interleaved", "virtual_stages": 2}
    idle = {name: [s["idle_ms"] for s in out["stages"]]
            for name, out in (("1f1b", one), ("zb-h1", zero), ("interleaved", inter))}
    assert idle == {"1f1b": [9.0] * 4, "zb-h1": [3.0] * 4, "interleaved": [4.5] * 4}
    for s in range(4):
        assert idle["zb-h1"][s] <= 0.4 * idle["1f1b"][s]
        assert idle["interleaved"][s] <= 0.55 * idle["1f1b"][s]
    held = [s["peak_held_micro_batches"] for s in zero["stages"]]
    assert held == [s["peak_held_micro_batches"] for s in one["stages"]] == [4, 3, 2, 1]
    assert [s["chunks"] for s in inter["stages"]] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_simulate_refuses_a_recut_without_the_cost_model(tmp_path):
    done = dapple("simulate", *uniform_files(tmp_path, 4, 1, 2), "--schedule=interleaved")
    assert done.returncode == 2 and "pass --profile and --topology instead of --costs" \
        in done.stderr
    done = dapple("simulate", *uniform_files(tmp_path, 4, 1, 2), "--virtual_stages=2")
    assert done.returncode == 2 and "--virtual_stages applies to" in done.stderr


def toy_files(tmp_path):
    profile = toy_profile()
    layers = [{"name": n, "type": "Dense", "forward_ms": l.forward_ms,
               "backward_ms": l.backward_ms, "output_bytes": l.output_bytes,
               "parameter_bytes": l.parameter_bytes, "inputs": [i - 1]}
              for i, (n, l) in enumerate(zip(profile.layer_names, profile.layers))]
    path = write(tmp_path / "toy.json", {"format": "dapple-profile", "version": 1,
                                         "name": "toy", "batch_size": 8, "layers": layers})
    return path, profile


@pytest.mark.parametrize("schedule,virtual_stages", [("zb-h1", None), ("interleaved", 2),
                                                     ("interleaved", 3), ("auto", None)])
def test_plan_under_each_schedule_equals_the_library(tmp_path, schedule, virtual_stages):
    path, profile = toy_files(tmp_path)
    topology = "2x2,net=1Gbps"            # the toy model plans 2:2 (replicated stages), M = 4
    args = [f"--profile={path}", f"--topology={topology}", "--global_batch_size=64",
            f"--schedule={schedule}", "--format=json"]
    if virtual_stages:
        args.append(f"--virtual_stages={virtual_stages}")
    done = dapple("plan", *args)
    assert done.returncode == 0, done.stderr
    got = Plan.from_json(done.stdout)
    topo = parse_topology(topology)
    searched = plan_dapple(profile, topo, 64)
    assert (searched.shape(), searched.micro_batches) == ("2:2", 4)
    want = choose_schedule(searched, profile, topo, schedule, virtual_stages)[0]
    assert (got.schedule, got.virtual_stages) == (want.schedule, want.virtual_stages)
    assert [s.layers for s in got.stages] == [s.layers for s in want.stages]
    assert got.estimate.latency_ms == pytest.approx(want.estimate.latency_ms)


def test_plan_for_horovodrun_simulates_horovods_transfers(tmp_path):
    # The toy model on 2 hosts over 1 Gbps: each interleaved chunk boundary crosses the network.
    path, profile = toy_files(tmp_path)
    args = [f"--profile={path}", "--topology=2x2,net=1Gbps", "--global_batch_size=64",
            "--schedule=interleaved", "--format=json"]
    plans = {}
    for transfers in ("async", "horovod"):
        done = dapple("plan", *args, f"--transfers={transfers}")
        assert done.returncode == 0, done.stderr
        plans[transfers] = Plan.from_json(done.stdout)
    assert (plans["async"].transfers, plans["horovod"].transfers) == ("async", "horovod")
    topo = parse_topology("2x2,net=1Gbps")
    costs = pipeline_costs(plans["horovod"], profile, topo)
    # The interleaved estimate is the simulated iteration, with the plan's transfer model.
    assert plans["horovod"].estimate.latency_ms == pytest.approx(simulate_plan(
        plans["horovod"], costs, link_duplex="serial", rendezvous=True).iteration_ms)
    assert plans["async"].estimate.latency_ms == pytest.approx(simulate_plan(
        plans["async"], costs, link_duplex="full", rendezvous=False).iteration_ms)
    assert plans["horovod"].estimate.latency_ms > plans["async"].estimate.latency_ms


def test_plan_report_shows_the_schedules_side_by_side(tmp_path):
    path, _ = toy_files(tmp_path)
    done = dapple("plan", f"--profile={path}", "--topology=2x2,net=1Gbps",
                  "--global_batch_size=64")
    assert done.returncode == 0, done.stderr
    assert "| schedule | simulated ms | bubble per device group | peak memory per device " \
           "group | fits | dapple runtime |" in done.stdout
    for name in ("| gpipe |", "| 1f1b |", "| interleaved (v = 2) |", "| zb-h1 |"):
        assert name in done.stdout
    assert "planned and simulated only" not in done.stdout      # the runtime runs them all


@pytest.mark.parametrize("args,words", [
    (["--schedule=1f1b", "--virtual_stages=2"], "--virtual_stages applies to"),
    (["--schedule=zigzag"], "zigzag"),
    (["--schedule=interleaved", "--virtual_stages=9"], "18 chunks need at least 18 layers"),
])
def test_plan_schedule_flags_are_checked(tmp_path, args, words):
    path, _ = toy_files(tmp_path)
    done = dapple("plan", f"--profile={path}", "--topology=2x2,net=1Gbps",
                  "--global_batch_size=64", *args)
    assert done.returncode != 0 and words in done.stderr


def test_evaluate_keeps_the_plans_schedule(tmp_path):
    path, _ = toy_files(tmp_path)
    plan = write(tmp_path / "p.json", {"version": 2, "micro_batches": 4, "global_batch_size": 32,
                                       "schedule": {"name": "zb-h1"},
                                       "stages": [{"layers": [0, 3], "devices": [0]},
                                                  {"layers": [4, 7], "devices": [1]}]})
    done = dapple("plan", f"--evaluate={plan}", f"--profile={path}", "--topology=1x2",
                  "--format=json")
    assert done.returncode == 0, done.stderr
    out = Plan.from_json(done.stdout)
    assert out.schedule == "zb-h1" and out.estimate.method == "simulated"
    done = dapple("plan", f"--evaluate={plan}", f"--profile={path}", "--topology=1x2",
                  "--schedule=1f1b")
    assert done.returncode == 2 and "--evaluate keeps the plan's schedule" in done.stderr
