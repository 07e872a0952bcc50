"""`dapple plan` from the command line: text report, `--format=json` (stdout is the Plan JSON
and nothing else), a comma list of global batches (one row each), `--evaluate` filling
`estimate` and `warmup` of a hand-written plan, `--even_slices`, and clear errors for bad input.
Expected values come from the library called directly (the CLI must not re-plan differently)
or from the hand-written plan."""
import json
import os
import subprocess
import sys

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan
from planner.formats.profile import parse_native_json
from planner.search.plan_space import plan_dapple
from topology import parse_topology

LAYERS = [(2.0, 4.0, 4e6, 8e6), (3.0, 6.0, 2e6, 4e7), (1.0, 2.0, 1e6, 2e8), (2.0, 4.0, 1e5, 4e6)]


def write_profile(tmp_path):
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": f, "backward_ms": b,
               "output_bytes": o, "parameter_bytes": p, "inputs": [i - 1]}
              for i, (f, b, o, p) in enumerate(LAYERS)]
    text = json.dumps({"format": "dapple-profile", "version": 1, "name": "toy", "batch_size": 4,
                       "input_bytes": 1e5, "layers": layers})
    path = tmp_path / "toy.json"
    path.write_text(text)
    return str(path), parse_native_json(text)


def dapple(*args):
    exe = os.path.join(os.path.dirname(sys.executable), "dapple")
    return subprocess.run([exe, "plan", *args], capture_output=True, text=True, timeout=120)


def test_json_output_is_only_the_plan_and_equals_the_library(tmp_path):
    path, profile = write_profile(tmp_path)
    r = dapple(f"--profile={path}", "--topology=2x2,net=10Gbps", "--global_batch_size=64",
               "--format=json")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)            # the whole stdout parses as one Plan
    expected = plan_dapple(profile, parse_topology("2x2,net=10Gbps"), 64)
    assert [s.layers for s in plan.stages] == [s.layers for s in expected.stages]
    assert [s.devices for s in plan.stages] == [s.devices for s in expected.stages]
    assert plan.micro_batches == expected.micro_batches
    assert plan.estimate.latency_ms == pytest.approx(expected.estimate.latency_ms)


def test_text_report_names_plan_and_alternatives(tmp_path):
    path, profile = write_profile(tmp_path)
    r = dapple(f"--profile={path}", "--topology=1x2", "--global_batch_size=32")
    assert r.returncode == 0, r.stderr
    expected = plan_dapple(profile, parse_topology("1x2"), 32)
    assert f"Plan **{expected.shape()}**" in r.stdout
    assert "best data parallel" in r.stdout and "PipeDream" in r.stdout
    assert f"{expected.estimate.latency_ms:.1f}" in r.stdout


def test_comma_separated_batches_print_one_row_each(tmp_path):
    path, profile = write_profile(tmp_path)
    r = dapple(f"--profile={path}", "--topology=1x2", "--global_batch_size=16,32,64")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[2:]]
    assert [int(row[0]) for row in rows] == [16, 32, 64]
    for row in rows:
        expected = plan_dapple(profile, parse_topology("1x2"), int(row[0]))
        assert row[1] == expected.shape() and int(row[2]) == expected.micro_batches
        assert float(row[3]) == pytest.approx(expected.estimate.latency_ms, abs=0.06)


def test_evaluate_fills_estimate_and_warmup(tmp_path):
    path, profile = write_profile(tmp_path)
    hand = {"version": 1, "micro_batches": 4, "global_batch_size": 32, "schedule": "A",
            "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [2, 3], "devices": [1]}]}
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(hand))
    r = dapple(f"--evaluate={plan_file}", f"--profile={path}", "--topology=1x2",
               "--format=json")
    assert r.returncode == 0, r.stderr
    out = Plan.from_json(r.stdout)
    assert out.warmup == [2, 1]                      # policy A, S = 2: K = min(S - i, M)
    # eq. 1 by hand for this two-stage plan (transfer stage between): pivot is the max.
    t = parse_topology("1x2")
    costs = cm.pipeline_costs(Plan.from_dict(hand), profile, t)
    F = [costs.forward_ms[0], costs.send_forward_ms[0], costs.forward_ms[1]]
    B = [costs.backward_ms[0], costs.send_backward_ms[0], costs.backward_ms[1]]
    # eq. 1 plus the pivot's round-trip wait (cost_model.round_trip_phases): K of the
    # sending stage, trip = F + B of every later stage, no allreduce: Te = B_q .. B_0.
    K = [2, 2, 1]
    trip = [sum(F[j] + B[j] for j in range(q + 1, 3)) for q in range(3)]
    latency = max(sum(F[:q + 1]) + max(0, trip[q] - (K[q] - 1) * F[q])
                  + 3 * max(F[q] + B[q], (F[q] + B[q] + trip[q]) / K[q]) + sum(B[:q + 1])
                  for q in range(3))
    assert out.estimate.latency_ms == pytest.approx(latency)


def test_even_slices_flag_and_uneven_note(tmp_path):
    path, profile = write_profile(tmp_path)
    # 3 devices, global batch 20: data parallel slices 7/7/6 are uneven.
    args = [f"--profile={path}", "--topology=1x3,mem=64GB", "--global_batch_size=20"]
    plain = plan_dapple(profile, parse_topology("1x3,mem=64GB"), 20)
    r = dapple(*args)
    assert r.returncode == 0, r.stderr
    uneven = any(len(set(plain.slice_sizes(i))) > 1 for i in range(plain.num_stages))
    assert ("--even_slices" in r.stdout) == uneven
    r = dapple(*args, "--even_slices", "--format=json")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)
    assert all(len(set(plan.slice_sizes(i))) == 1 for i in range(plan.num_stages))


@pytest.mark.parametrize("args, words", [
    (["--topology=Z", "--global_batch_size=8"], "unknown topology preset"),
    (["--topology=2x2,net=0Gbps", "--global_batch_size=8"], "zero"),
    # 8 devices, 4 layers: some stage is replicated, and a batch of 1 cannot be split.
    (["--topology=2x4", "--global_batch_size=1"], "global batch of 1"),
    (["--topology=2x2", "--global_batch_size=eight"], "must be integers"),
])
def test_bad_input_is_a_clear_error(tmp_path, args, words):
    path, _ = write_profile(tmp_path)
    r = dapple(f"--profile={path}", *args)
    assert r.returncode == 2
    assert words in r.stderr and r.stdout == ""


def test_truncated_profile_and_bad_hand_plans(tmp_path):
    path, _ = write_profile(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(open(path).read()[:80])
    r = dapple(f"--profile={bad}", "--topology=1x2", "--global_batch_size=8")
    assert r.returncode == 2 and "bad.json" in r.stderr
    for stages, words in (
            ([{"layers": [0, 1], "devices": [0]}, {"layers": [2, 3], "devices": [0]}],
             "device 0 is used by stage 0 and stage 1"),
            ([{"layers": [0, 1], "devices": [0]}, {"layers": [3, 3], "devices": [1]}],
             "leaves out layers 2..2")):
        f = tmp_path / "hand.json"
        f.write_text(json.dumps({"version": 1, "micro_batches": 2, "global_batch_size": 8,
                                 "stages": stages}))
        r = dapple(f"--evaluate={f}", f"--profile={path}", "--topology=1x2")
        assert r.returncode == 2 and words in r.stderr, r.stderr


def test_data_parallel_batch_smaller_than_replicas(tmp_path):
    from planner.formats.plan import PlanError
    from planner.search.baselines import best_data_parallel_plan
    _, profile = write_profile(tmp_path)
    with pytest.raises(PlanError, match="global batch 3 is smaller than the 4 replicas"):
        best_data_parallel_plan(profile, parse_topology("2x2"), 3)


def test_plan_space_flag_and_the_report_names_the_other_space():
    # AmoebaNet-36 on config B: the paper's space gives the straight pipeline, the full space
    # a deeper replicated one that the model rates faster; the report must say so.
    from tests.paths import PROFILES
    from planner.formats.profile_readers import load_profile
    path = os.path.join(PROFILES, "dapple", "amoeba-36-pbs-1.txt")
    profile, topo = load_profile(path), parse_topology("B")
    r = dapple(f"--profile={path}", "--topology=B", "--global_batch_size=128",
               "--format=json", "--plan_space=full")
    assert r.returncode == 0, r.stderr
    got = Plan.from_json(r.stdout)
    want = plan_dapple(profile, topo, 128, plan_space="full")
    assert [s.devices for s in got.stages] == [s.devices for s in want.stages]
    assert [s.layers for s in got.stages] == [s.layers for s in want.stages]
    paper = plan_dapple(profile, topo, 128)
    assert paper.estimate.latency_ms > want.estimate.latency_ms
    r = dapple(f"--profile={path}", "--topology=B", "--global_batch_size=128")
    assert r.returncode == 0, r.stderr
    assert f"Plan **{paper.shape()}**" in r.stdout
    row = [l for l in r.stdout.splitlines() if l.startswith("| full plan space")]
    ratio = paper.estimate.latency_ms / want.estimate.latency_ms
    assert row and want.shape() in row[0] and f"{ratio:.2f}x faster" in row[0]
    assert "The full plan space has a deeper plan" in r.stdout
    r = dapple(f"--profile={path}", "--topology=B", "--global_batch_size=128",
               "--plan_space=deep")
    assert r.returncode != 0 and "plan_space" in r.stderr


def test_compute_dtype_flag_plans_with_halved_activations(tmp_path):
    path, profile = write_profile(tmp_path)
    half = profile.with_compute_dtype("float16")
    topo = parse_topology("2x2,net=10Gbps")
    r = dapple(f"--profile={path}", "--topology=2x2,net=10Gbps", "--global_batch_size=64",
               "--format=json", "--compute_dtype=float16")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)
    expected = plan_dapple(half, topo, 64)
    assert [s.layers for s in plan.stages] == [s.layers for s in expected.stages]
    assert plan.estimate.latency_ms == pytest.approx(expected.estimate.latency_ms)
    assert plan.profile["compute_dtype"] == "float16"
    assert plan.profile["hash"] == half.content_hash != profile.content_hash
    # --evaluate: a hand plan's transfers are those of the halved cut bytes.
    hand = {"version": 1, "micro_batches": 4, "global_batch_size": 32,
            "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [2, 3], "devices": [2]}]}
    plan_file = tmp_path / "hand.json"
    plan_file.write_text(json.dumps(hand))
    r = dapple(f"--evaluate={plan_file}", f"--profile={path}", "--topology=2x2,net=10Gbps",
               "--format=json", "--compute_dtype=bfloat16")
    assert r.returncode == 0, r.stderr
    want = cm.evaluate(Plan.from_dict(hand), profile.with_compute_dtype("bfloat16"), topo)
    assert Plan.from_json(r.stdout).estimate.latency_ms == pytest.approx(want.latency_ms)
    costs = cm.pipeline_costs(Plan.from_dict(hand), half, topo)
    x = profile.cut_bytes[1] / 2 * 8 / 4               # micro-batch 8, profile batch 4
    assert costs.send_forward_ms[0] == pytest.approx(
        x / (topo.inter_host_bandwidth / 1e3) + topo.inter_host_latency * 1e3)
    # A plan made for float16 is refused against the float32 profile, with the flag to pass.
    made = tmp_path / "made.json"
    made.write_text(plan.to_json())
    r = dapple(f"--evaluate={made}", f"--profile={path}", "--topology=2x2,net=10Gbps")
    assert r.returncode == 2 and "pass --compute_dtype=float16" in r.stderr
    r = dapple(f"--profile={path}", "--topology=1x2", "--global_batch_size=32",
               "--compute_dtype=float16")
    assert r.returncode == 0 and "(activations in float16)" in r.stdout


def test_compute_dtype_flag_rejects_an_unknown_dtype(tmp_path):
    path, _ = write_profile(tmp_path)
    r = dapple(f"--profile={path}", "--topology=1x2", "--global_batch_size=8",
               "--compute_dtype=fp8")
    assert r.returncode == 2 and r.stdout == ""
    assert "--compute_dtype=fp8 is not one of float32, float16, bfloat16" in r.stderr


def test_transfers_tensorflow_plans_with_the_chiefs_rows(tmp_path):
    """Big input rows on 2 hosts at 1 Gbit/s: data parallelism is best when each process reads
    its own rows; on a TensorFlow cluster the chief sends host 1 its half first, and a pipeline
    whose first stage is on the chief wins. The estimate is `evaluate`'s with the rows."""
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": 4.0, "backward_ms": 8.0,
               "output_bytes": 1e5, "parameter_bytes": 4e5, "inputs": [i - 1]} for i in range(4)]
    text = json.dumps({"format": "dapple-profile", "version": 1, "name": "rows",
                       "batch_size": 8, "input_bytes": 4e6, "layers": layers})
    path = tmp_path / "rows.json"
    path.write_text(text)
    profile, topo = parse_native_json(text), parse_topology("2x1,net=1Gbps")
    args = (f"--profile={path}", "--topology=2x1,net=1Gbps", "--global_batch_size=32",
            "--format=json", "--schedule=1f1b")
    r = dapple(*args)
    assert r.returncode == 0, r.stderr
    assert [st.devices for st in Plan.from_json(r.stdout).stages] == [[0, 1]]
    r = dapple(*args, "--transfers=tensorflow")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)
    assert plan.transfers == "tensorflow"
    assert [st.devices for st in plan.stages] == [[0], [1]]
    assert plan.estimate.latency_ms == pytest.approx(cm.evaluate(plan, profile, topo).latency_ms)
