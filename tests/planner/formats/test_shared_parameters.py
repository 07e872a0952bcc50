"""Shared parameters and the compute dtype in profiles: a shared entry counts once in every
stage whose range holds one of its positions (parameter bytes, memory, allreduce, PipeDream's
table), old profiles read and hash as before, and `with_compute_dtype` rescales activation
bytes (cut bytes, transfers) by the dtype's size. Expected values are computed by hand."""
import json

import pytest

from planner.estimate import cost_model as cm
from planner.search.pipedream import parameter_table
from planner.formats.plan import straight_plan
from planner.formats.profile import Layer, Profile, ProfileError, SharedParameters, parse_native_json
from planner.formats.profile_readers import load_profile, parse_graph_txt
from tests.paths import published_profile

OWN = [10.0, 20.0, 0.0, 40.0, 5.0]
SHARED = [{"bytes": 100.0, "positions": [0, 3]}, {"bytes": 7.0, "positions": [1, 2, 4]}]


def native(shared=SHARED, own=OWN, **extra):
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": 1.0 + i, "backward_ms": 2.0 + i,
               "output_bytes": 1000.0 * (i + 1), "parameter_bytes": p, "inputs": [i - 1]}
              for i, p in enumerate(own)]
    d = {"format": "dapple-profile", "version": 1, "name": "tied", "batch_size": 4,
         "input_bytes": 400.0, "layers": layers, **extra}
    if shared is not None:
        d["shared_parameters"] = shared
    return d


def test_shared_entries_count_once_per_stage_that_holds_them():
    p = parse_native_json(json.dumps(native()))
    # By hand: own bytes of the range, +100 if it holds 0 or 3, +7 if it holds 1, 2 or 4.
    table = {(0, 0): 10 + 100, (1, 1): 20 + 7, (2, 2): 0 + 7, (3, 3): 40 + 100, (4, 4): 5 + 7,
             (0, 1): 30 + 100 + 7, (1, 2): 20 + 7, (2, 3): 40 + 100 + 7, (3, 4): 45 + 100 + 7,
             (1, 3): 60 + 100 + 7, (0, 4): 75 + 100 + 7}
    for (first, last), want in table.items():
        assert p.parameter_bytes(first, last) == want, (first, last)
    assert p.total_parameter_bytes == 75 + 107
    # Every range against the definition, and PipeDream's table against parameter_bytes.
    W = parameter_table(p)
    for first in range(5):
        for last in range(first, 5):
            want = sum(OWN[first:last + 1]) + sum(
                e["bytes"] for e in SHARED if any(first <= x <= last for x in e["positions"]))
            assert p.parameter_bytes(first, last) == want
            assert W[first, last] == want


def test_memory_and_allreduce_count_a_shared_entry_in_each_stage():
    """A plan's estimate equals that of a profile whose shared bytes are copied into each
    stage, at the stage's last position of the entry."""
    shared = [{"bytes": 3e8, "positions": [0, 3]}]
    p = parse_native_json(json.dumps(native(shared=shared, own=[1e6] * 5)))
    copied = parse_native_json(json.dumps(native(shared=None,
                                                 own=[1e6 + 3e8, 1e6, 1e6, 1e6 + 3e8, 1e6])))
    from topology import parse_topology
    topo = parse_topology("2x2,net=10Gbps")
    plan = straight_plan([2], 5, 4, 64, replicas=[2, 2])
    a, b = cm.evaluate(plan, p, topo), cm.evaluate(plan, copied, topo)
    assert a.stages == b.stages and a.latency_ms == b.latency_ms
    assert a.stages[0].allreduce_ms > 0
    model = cm.StageModel(p, topo, 64, 4)
    assert model.static_bytes(0, 1) - model.static_bytes(0, 0) == \
        cm.BYTES_PER_PARAMETER_FACTOR * 1e6                  # the entry once within a stage


def test_round_trip_and_old_profiles_unchanged(tmp_path):
    p = parse_native_json(json.dumps(native(compute_dtype="float16")))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_dict()))
    q = load_profile(str(path))
    assert q.shared_parameters == (SharedParameters(100.0, (0, 3)),
                                   SharedParameters(7.0, (1, 2, 4)))
    assert q.compute_dtype == "float16" and q.content_hash == p.content_hash
    plain = parse_native_json(json.dumps(native(shared=None)))
    assert plain.shared_parameters == () and plain.compute_dtype == "float32"
    assert len({plain.content_hash, p.content_hash,
                parse_native_json(json.dumps(native())).content_hash}) == 3
    # Hashes of profiles without the new fields are what they were (pinned).
    assert load_profile(published_profile("dapple/gnmt-16-pbs-64.txt")).content_hash == \
        "779daf9f65ebdca2f63592ae30d8360246a7c21debe02b4d50904d8e22312833"
    assert "shared_parameters" not in plain.to_dict()
    assert plain.summary() == {"name": "tied", "hash": plain.content_hash,
                               "model_signature": None}


@pytest.mark.parametrize("edit,words", [
    (lambda d: d.update(shared_parameters={"bytes": 1}), "must be a list"),
    (lambda d: d.update(shared_parameters=[{"bytes": 1}]), r"shared_parameters\[0\] must be"),
    (lambda d: d.update(shared_parameters=[{"bytes": 1, "positions": [0, 5]}]), "0..4"),
    (lambda d: d.update(shared_parameters=[{"bytes": 1, "positions": []}]), "non-empty"),
    (lambda d: d.update(shared_parameters=[{"bytes": -1, "positions": [1]}]), ">= 0"),
    (lambda d: d.update(compute_dtype="int8"), "compute_dtype 'int8'"),
])
def test_bad_shared_parameters_and_dtype_name_the_problem(edit, words):
    d = native()
    edit(d)
    with pytest.raises(ProfileError, match=words):
        parse_native_json(json.dumps(d), "p.json")


DAG = """node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=10.0, parameter_size=0.0
node2 -- Conv -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=[20; 6], parameter_size=100
node3 -- Add -- forward_compute_time=3.0, backward_compute_time=6.0, activation_size=30.0, parameter_size=0.0
\tnode1 -- node2
\tnode1 -- node3
\tnode2 -- node3
"""


def test_compute_dtype_scales_activation_bytes_only():
    p = parse_graph_txt(DAG, "dag-pbs-4.txt")
    assert p.compute_dtype == "float32" and p.cut_bytes == [10.0, 36.0]
    h = p.with_compute_dtype("float16")
    assert h.compute_dtype == "float16" and h.cut_bytes == [5.0, 18.0]
    assert [l.output_bytes for l in h.layers] == [5.0, 13.0, 15.0]
    assert h.parameter_bytes(0, 2) == 100 and h.forward_ms(0, 2) == 4.0
    assert h.input_bytes == p.input_bytes and h.batch_size == 4
    assert h.content_hash != p.content_hash
    assert p.with_compute_dtype("bfloat16").cut_bytes == [5.0, 18.0]
    assert h.with_compute_dtype("float32").cut_bytes == p.cut_bytes       # new / old size
    assert p.with_compute_dtype("float32") is p
    assert h.with_compute_dtype("float32").content_hash == p.content_hash
    assert h.summary()["compute_dtype"] == "float16"
    with pytest.raises(ProfileError, match="unknown compute dtype 'fp8'"):
        p.with_compute_dtype("fp8")


def test_a_native_16_bit_profile_is_scaled_from_its_own_dtype():
    p = parse_native_json(json.dumps(native(compute_dtype="bfloat16")))
    f = p.with_compute_dtype("float32")
    assert [l.output_bytes for l in f.layers] == [2000.0 * (i + 1) for i in range(5)]
    assert f.input_bytes == 400.0 and f.shared_parameters == p.shared_parameters
    assert p.with_compute_dtype("float16").cut_bytes == p.cut_bytes


def test_boundary_bytes_and_transfers_halve_in_float16():
    from topology import parse_topology
    p = load_profile(published_profile("dapple/vgg-19-pbs-32.txt"))
    h = p.with_compute_dtype("float16")
    topo = parse_topology("2x1,net=10Gbps")             # one device a host: transfers cross hosts
    cut = 12
    plan = straight_plan([cut + 1], p.num_layers, 8, 256)    # micro-batches of 32 = the profile's
    for prof, size in ((p, 4), (h, 2)):
        costs = cm.pipeline_costs(plan, prof, topo)
        x = p.cut_bytes[cut] * size / 4 * (256 // 8) / p.batch_size
        assert cm.StageModel(prof, topo, 256, 8).boundary_bytes(cut) == x
        want = x / (topo.inter_host_bandwidth / 1e3) + topo.inter_host_latency * 1e3
        assert costs.send_forward_ms == [pytest.approx(want)]
        assert costs.send_backward_ms == [pytest.approx(want)]
    full, half = cm.pipeline_costs(plan, p, topo), cm.pipeline_costs(plan, h, topo)
    latency = topo.inter_host_latency * 1e3
    assert half.send_forward_ms[0] - latency == pytest.approx((full.send_forward_ms[0] - latency) / 2)
    assert half.forward_ms == full.forward_ms and half.allreduce_ms == full.allreduce_ms
    assert half.activation_bytes == [a / 2 for a in full.activation_bytes]


def test_profile_dataclass_checks_positions_and_dtype():
    layers = [Layer("a", "Dense", 1, 1, 1, 1, (-1,)), Layer("b", "Dense", 1, 1, 1, 1, (0,))]
    with pytest.raises(ProfileError, match="distinct, sorted"):
        Profile("p", 1, layers, shared_parameters=(SharedParameters(1, (1, 0)),))
    with pytest.raises(ProfileError, match="compute dtype 'int8'"):
        Profile("p", 1, layers, compute_dtype="int8")
