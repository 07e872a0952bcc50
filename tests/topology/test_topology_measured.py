"""A topology's `measured` record: optional, carried through JSON, old files load unchanged,
and the strategy report says whether the links were measured or assumed."""
import json

import pytest

from topology import TopologyError, parse_topology
from topology.model import Topology

OLD_FILE = {"name": "two", "devices_per_host": [2, 2], "device_memory_bytes": 16e9,
            "intra_host_bandwidth": 4e9, "inter_host_bandwidth": 25e6,
            "intra_host_latency": 1e-3, "inter_host_latency": 2e-3}
RECORD = {"at": "2026-11-22T20:10:00+00:00", "by": "dapple topology --measure",
          "inter_host": [{"ranks": [0, 2], "bandwidth": 25e6, "latency": 2e-3}]}


def test_a_file_without_measured_loads_and_writes_as_before(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(OLD_FILE))
    topo = parse_topology(str(path))
    assert topo.measured is None
    assert topo.to_dict() == OLD_FILE                     # no new key appears
    assert topo.links_source() == "links assumed (preset or spec figures, not measured)"


def test_measured_record_round_trips_and_is_reported(tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(dict(OLD_FILE, measured=RECORD)))
    topo = parse_topology(str(path))
    assert topo.measured == RECORD
    assert topo.to_dict() == dict(OLD_FILE, measured=RECORD)
    assert topo.links_source() == "links measured at 2026-11-22T20:10:00+00:00"
    # the same figures plan the same: the record does not take part in equality
    assert topo == Topology.from_dict(OLD_FILE)


@pytest.mark.parametrize("record", [{"when": "today"}, "yesterday", {"at": 5}])
def test_a_measured_record_needs_its_time(record):
    with pytest.raises(TopologyError, match="'measured' must be an object with 'at'"):
        Topology.from_dict(dict(OLD_FILE, measured=record))


def test_the_strategy_report_says_measured_or_assumed(tmp_path):
    from planner.search.plan_space import plan_dapple
    from planner.formats.profile import Layer, Profile
    from reports.text_report import strategy_report
    layers = [Layer(f"l{i}", "Dense", 1.0, 2.0, 1e5, 1e6, (i - 1,)) for i in range(4)]
    profile = Profile("tiny", 8, layers, input_bytes=1e5)
    for topo, words in ((Topology.from_dict(OLD_FILE), "Topology: links assumed"),
                        (Topology.from_dict(dict(OLD_FILE, measured=RECORD)),
                         "Topology: links measured at 2026-11-22T20:10:00+00:00.")):
        plan = plan_dapple(profile, topo, 8)
        assert words in strategy_report(plan, profile, topo)
