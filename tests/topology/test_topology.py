"""Topology: presets against the paper's Table III, spec strings, JSON round trip, bad input."""
import json

import pytest

from topology import TopologyError, local_topology, parse_topology
from topology.units import parse_bandwidth
from topology.model import Topology


def test_presets_match_table_iii():
    a, b, c = (parse_topology(x) for x in "ABC")
    assert a.devices_per_host == (8, 8) and b.devices_per_host == (1,) * 16
    assert a.inter_host_bandwidth == 25e9 / 8 == b.inter_host_bandwidth
    assert c.inter_host_bandwidth == 10e9 / 8
    assert a.intra_host_bandwidth == 130e9
    assert a.device_memory_bytes == 16 * 2 ** 30


def test_device_ids_are_host_by_host():
    t = parse_topology("8+4")
    assert t.num_devices == 12
    assert [t.host_of(d) for d in (0, 7, 8, 11)] == [0, 0, 1, 1]
    assert t.devices_of_host(1) == [8, 9, 10, 11]


def test_spec_with_all_keys():
    t = parse_topology("4x8,nvlink=100GB/s,net=10Gbps,mem=32GB,net_latency=1ms")
    assert t.devices_per_host == (8,) * 4
    assert t.intra_host_bandwidth == 100e9
    assert t.inter_host_bandwidth == 1.25e9
    assert t.device_memory_bytes == 32 * 2 ** 30
    assert t.inter_host_latency == pytest.approx(1e-3)


def test_spec_defaults_and_json_round_trip(tmp_path):
    t = parse_topology("1x3")
    assert t.num_devices == 3 and t.device_memory_bytes == 16 * 2 ** 30
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(t.to_dict()))
    assert parse_topology(str(path)) == t
    assert Topology.from_dict(t.to_dict()) == t


def test_transfer_cpu_of_cpu_hosts(tmp_path):
    """What one end of a transfer takes of a CPU host's compute: 0.2 ms + 2 MB at 1 GB/s is
    2.2 ms; GPU topologies (every preset, specs without the keys) take none and write none."""
    t = parse_topology("1x2,transfer_cpu_latency=0.2ms,transfer_cpu_bandwidth=1GB/s")
    assert (t.transfer_cpu_latency, t.transfer_cpu_bandwidth) == (pytest.approx(2e-4), 1e9)
    assert t.transfer_cpu_seconds(2e6) == pytest.approx(2.2e-3)
    assert "0.2 ms of compute" in t.describe()
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(t.to_dict()))
    assert parse_topology(str(path)) == t
    latency_only = parse_topology("1x2,transfer_cpu_latency=50us")
    assert latency_only.transfer_cpu_seconds(1e9) == pytest.approx(5e-5)
    for gpu in (parse_topology("A"), parse_topology("1x2")):
        assert gpu.transfer_cpu_seconds(1e9) == 0.0
        assert "transfer_cpu_latency" not in gpu.to_dict()
    with pytest.raises(TopologyError, match="transfer CPU latency must be >= 0"):
        Topology.from_dict(dict(parse_topology("1x2").to_dict(), transfer_cpu_latency=-1e-3))
    with pytest.raises(TopologyError, match="transfer CPU bandwidth"):
        Topology.from_dict(dict(parse_topology("1x2").to_dict(), transfer_cpu_bandwidth=-1))


def test_local_topology():
    t = local_topology(3)
    assert t.num_devices == 3 and t.num_hosts == 1 and t.device_memory_bytes > 0


@pytest.mark.parametrize("spec, words", [
    ("D", "unknown topology preset"),
    ("2x8,net=0Gbps", "zero"),
    ("2x8,net=25", "unit"),
    ("2x8,foo=1", "unknown key"),
    ("two by eight", "cannot read topology"),
    ("0x8", ">= 1"),
])
def test_bad_specs_are_clear(spec, words):
    with pytest.raises(TopologyError, match=words):
        parse_topology(spec)


def test_bad_json_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"devices_per_host": [8, 8], "inter_host_bandwidth": 0}')
    with pytest.raises(TopologyError, match="t.json.*positive"):
        parse_topology(str(path))


# Bytes per second by hand: a bit is 1/8 byte; k/K, M, G, T are 1e3, 1e6, 1e9, 1e12.
@pytest.mark.parametrize("text, bytes_per_second", [
    ("1Gbps", 125e6), ("1Gb/s", 125e6), ("1Gbit/s", 125e6), ("1Gbits/s", 125e6),
    ("1GBps", 1e9), ("1GB/s", 1e9), ("1Gbyte/s", 1e9), ("1Gbytes/s", 1e9),
    ("200Mbps", 25e6), ("200Mb/s", 25e6), ("200MBps", 200e6), ("200MB/s", 200e6),
    ("100kbps", 12.5e3), ("100Kbps", 12.5e3), ("100kB/s", 100e3), ("100KBps", 100e3),
    ("2Tbps", 250e9), ("2TB/s", 2e12), ("800bps", 100), ("800B/s", 800), ("800Bps", 800),
    ("1.5 Gbps", 187.5e6), ("130GB/s", 130e9), ("25Gbps", 3.125e9),
])
def test_bandwidth_units_b_is_a_bit_and_B_a_byte(text, bytes_per_second):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_second)
    assert parse_topology(f"2x2,net={text}").inter_host_bandwidth == pytest.approx(
        bytes_per_second)


@pytest.mark.parametrize("text", ["1gbps", "1GBPS", "1gb/s", "200mbps", "200mbit", "1Gbit",
                                  "1G", "1Gibps", "1GiB/s", "1Gb", "1GB", "25", "1Gbp/s"])
def test_ambiguous_bandwidth_units_are_refused_with_the_spellings(text):
    with pytest.raises(TopologyError, match=r"unknown bandwidth unit.*b is a bit and B a byte.*"
                                            r"Gbps, Gb/s.*GB/s"):
        parse_bandwidth(text)
