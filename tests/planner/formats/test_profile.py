"""Profile readers: graph.txt (out-of-order nodes, DAGs, odd descriptions, multi-output nodes),
native JSON, cut bytes of DAGs, scaling, and errors naming file and line."""
import json

import pytest

from planner.formats.profile import ProfileError
from planner.formats.profile_readers import load_profile, parse_graph_txt
from tests.paths import published_profile

DAG = """node3 -- Add -- forward_compute_time=3.0, backward_compute_time=6.0, activation_size=30.0, parameter_size=0.0
node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=10.0, parameter_size=0.0
node2 -- Conv2d(3, 64, k=(3, 3)) -- odd -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=[20; 5], parameter_size=100
node4 -- Loss -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0 -- stage_id=1
\tnode1 -- node2
 \tnode1 -- node3
  node2 -- node3
\tnode3 -- node4
"""


def test_dag_order_and_cut_bytes(tmp_path):
    path = tmp_path / "dag-pbs-4.txt"
    path.write_text(DAG)
    p = load_profile(str(path))
    assert p.batch_size == 4
    assert [n.split(":")[0] for n in p.layer_names] == ["node1", "node2", "node3", "node4"]
    # cut after Input: node1's output (10) feeds node2 and node3.
    # cut after node2: node1 (10, still needed by node3) + node2's two outputs (25).
    # cut after node3: only node3's output.
    assert p.cut_bytes == [10.0, 35.0, 30.0]
    assert p.parameter_bytes(0, 3) == 100
    assert p.forward_ms(1, 2) == 4.0


def test_scaling_is_linear_in_time_and_activations_fixed_in_parameters(tmp_path):
    path = tmp_path / "dag-pbs-4.txt"
    path.write_text(DAG)
    p = load_profile(str(path)).scaled(2)
    assert p.forward_ms(2, 2) == 1.5 and p.cut_bytes == [5.0, 17.5, 15.0]
    assert p.parameter_bytes(0, 3) == 100


def test_native_json_and_same_hash_as_graph_txt(tmp_path):
    path = tmp_path / "dag-pbs-4.txt"
    path.write_text(DAG)
    p = load_profile(str(path))
    j = tmp_path / "dag.json"
    j.write_text(json.dumps(p.to_dict()))
    q = load_profile(str(j))
    assert q.cut_bytes == p.cut_bytes and q.content_hash == p.content_hash
    assert q.model_signature is None


def test_native_json_model_input_crossing_a_cut(tmp_path):
    d = {"format": "dapple-profile", "version": 1, "name": "m", "batch_size": 2,
         "input_bytes": 8, "model_signature": "abc",
         "layers": [{"name": "a", "type": "Dense", "forward_ms": 1, "backward_ms": 2,
                     "output_bytes": 4, "parameter_bytes": 10, "inputs": [-1]},
                    {"name": "b", "type": "Concat", "forward_ms": 1, "backward_ms": 2,
                     "output_bytes": 6, "parameter_bytes": 0, "inputs": [0, -1]}]}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(d))
    p = load_profile(str(path))
    assert p.cut_bytes == [12.0] and p.model_signature == "abc" and p.name == "m"


def test_real_profiles_load():
    p = load_profile(published_profile("dapple/gnmt-16-pbs-64.txt"))
    assert p.num_layers == 96 and p.batch_size == 64
    q = load_profile(published_profile("pipedream/resnet50.txt"), batch_size=128)
    assert q.num_layers == 177 and max(q.cut_bytes) > 0


@pytest.mark.parametrize("text, words", [
    ("node1 -- Input -- forward_compute_time=1.0, backward_comp", "1:.*truncated"),
    ("node1 -- Input -- forward_compute_time=x, backward_compute_time=0, activation_size=1, "
     "parameter_size=0", "1:.*not a number"),
    ("node1 -- Input -- forward_compute_time=1, backward_compute_time=0, activation_size=1, "
     "parameter_size=0\n\tnode1 -- node9", "2:.*node9"),
    ("garbage", "1: cannot read"),
])
def test_malformed_graph_txt_names_file_and_line(text, words):
    with pytest.raises(ProfileError, match=f"bad-pbs-1.txt:{words}"):
        parse_graph_txt(text, "bad-pbs-1.txt")


def test_truncated_json_and_missing_batch_size(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"format": "dapple-profile", "version": 1, "layers": [')
    with pytest.raises(ProfileError, match="t.json:1"):
        load_profile(str(path))
    g = tmp_path / "graph.txt"
    g.write_text(DAG)
    with pytest.raises(ProfileError, match="batch size is unknown"):
        load_profile(str(g))
