"""`dapple topology --measure`: which rank pairs are timed, how timings become link figures and
a Topology with its `measured` record (tables written by hand, no TensorFlow), and the command
itself on a small emulated cluster."""
import datetime
import json

import pytest

from dapple.measured_topology import (PairTiming, devices_per_host_of, measured_topology,
                                      pairs_to_measure, summary_lines)
from emulaterun import DAPPLE, emulate, leftovers
from topology.model import Topology

PAIRS = [
    # (ranks per host, pairs inside hosts, pairs between hosts)
    ((2, 2), [(0, 1), (2, 3)], [(0, 2)]),
    ((1, 1), [], [(0, 1)]),
    ((3,), [(0, 1)], []),
    ((2, 1, 3), [(0, 1), (3, 4)], [(0, 2), (2, 3)]),
    ((8, 8), [(0, 1), (8, 9)], [(0, 8)]),
]


@pytest.mark.parametrize("counts, inside, between", PAIRS)
def test_pairs_to_measure(counts, inside, between):
    assert pairs_to_measure(counts) == (inside, between)


@pytest.mark.parametrize("local_ranks, local_sizes, counts", [
    ([0, 1, 0, 1], [2, 2, 2, 2], [2, 2]),
    ([0, 0, 1], [1, 2, 2], [1, 2]),
    ([0], [1], [1]),
])
def test_hosts_from_local_ranks(local_ranks, local_sizes, counts):
    assert devices_per_host_of(local_ranks, local_sizes) == counts


def test_ranks_not_numbered_host_by_host_are_refused():
    with pytest.raises(ValueError, match="not numbered host by host"):
        devices_per_host_of([0, 0, 1, 1], [2, 2, 2, 2])


def timing(ranks, hosts, small_s, large_s, large=8_000_064, delay=0.0):
    """Medians `delay` seconds above the fastest calls."""
    return PairTiming(ranks, hosts, 64, small_s + delay, small_s, large, large_s + delay,
                      large_s)


def test_latency_is_the_small_transfer_and_bandwidth_the_extra_bytes_over_extra_time():
    t = timing((0, 2), (0, 1), 0.010, 0.330, delay=0.005)
    assert t.latency == 0.015                                      # median
    assert t.bandwidth == pytest.approx(8e6 / 0.320)               # fastest: 25 MB/s
    assert t.to_dict()["seconds_per_transfer"] == {
        "64": {"median": 0.015, "fastest": 0.010},
        "8000064": {"median": 0.335, "fastest": 0.330}}
    noisy = timing((0, 1), (0, 0), 0.010, 0.009)                   # noise beat the bytes
    assert noisy.bandwidth == pytest.approx(8_000_064 / 0.009)


def test_measured_topology_takes_medians_and_keeps_every_pair():
    at = datetime.datetime(2026, 11, 22, 20, 10, 0, 123, tzinfo=datetime.timezone.utc)
    inside = [timing((0, 1), (0, 0), 0.010, 0.012), timing((2, 3), (1, 1), 0.012, 0.016)]
    between = [timing((0, 2), (0, 1), 0.010, 0.330)]
    topo = measured_topology((2, 2), 4e9, inside, between, details={"allreduce": {"ranks": 4}},
                             at=at)
    assert topo.devices_per_host == (2, 2) and topo.device_memory_bytes == 4e9
    assert topo.intra_host_bandwidth == pytest.approx((8e6 / 0.002 + 8e6 / 0.004) / 2)
    assert topo.intra_host_latency == pytest.approx(0.011)
    assert topo.inter_host_bandwidth == pytest.approx(25e6)
    assert topo.inter_host_latency == 0.010
    record = topo.measured
    assert record["at"] == "2026-11-22T20:10:00+00:00"
    assert [p["ranks"] for p in record["intra_host"]] == [[0, 1], [2, 3]]
    assert [p["ranks"] for p in record["inter_host"]] == [[0, 2]]
    assert record["allreduce"] == {"ranks": 4} and "assumed" not in record
    again = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again == topo and again.measured == record
    text = "\n".join(summary_lines(topo))
    assert "inter-host ranks 0<->2: 200.0 Mbit/s, latency 10.000 ms" in text


def test_link_classes_without_a_pair_are_assumed_and_say_so():
    one_host = measured_topology((3,), 1e9, [timing((0, 1), (0, 0), 0.01, 0.02)], [])
    assert one_host.inter_host_bandwidth == 25e9 / 8               # topology.constants
    assert one_host.measured["assumed"] == [
        "link between hosts (one host): topology.constants 25 Gbps Ethernet figures"]
    assert one_host.links_source().endswith(
        "; link between hosts (one host): topology.constants 25 Gbps Ethernet figures assumed")
    one_rank_each = measured_topology((1, 1), 1e9, [], [timing((0, 1), (0, 1), 0.01, 0.33)])
    assert one_rank_each.intra_host_bandwidth == 130e9
    assert "in-host link (no host has two ranks)" in one_rank_each.measured["assumed"][0]


def test_the_command_says_what_to_do_without_measure():
    import subprocess
    result = subprocess.run([DAPPLE, "topology"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "dapple topology: say what to do: --measure" in result.stderr


@pytest.mark.horovod
def test_measure_on_an_emulated_cluster_writes_the_topology(can_emulate, tmp_path):
    """2 hosts x 2 ranks at 100 Mbit/s, small messages: the JSON on stdout and in the file are
    the same topology; the shaped link is the slow one. Figures are checked only loosely (the
    shaping took effect), never as timings: docs/cluster.md reports measured ones."""
    path = tmp_path / "topology.json"
    result = emulate("2x2,net=100Mbps", ["dapple", "topology", "--measure", "--format=json",
                                         f"--output={path}", "--message_size=2MiB"],
                     timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    printed = [line.split(":", 1)[1] for line in result.output.splitlines()
               if line.startswith("[0]<stdout>:{")]
    assert len(printed) == 1, result.output[-4000:]
    topo = Topology.from_dict(json.loads(printed[0]))
    assert Topology.from_dict(json.loads(path.read_text())) == topo
    assert topo.devices_per_host == (2, 2)
    record = topo.measured
    datetime.datetime.fromisoformat(record["at"])
    assert [p["ranks"] for p in record["intra_host"]] == [[0, 1], [2, 3]]
    assert [p["ranks"] for p in record["inter_host"]] == [[0, 2]]
    assert record["allreduce"]["ranks"] == 4
    assert topo.inter_host_bandwidth < 1.5 * 100e6 / 8              # shaped
    assert topo.intra_host_bandwidth > 10 * topo.inter_host_bandwidth
    assert leftovers(result) == []
