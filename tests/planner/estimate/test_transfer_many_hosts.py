"""`StageModel.transfer_ms` beyond `cost_model.VECTOR_HOSTS` hosts (numpy over the hosts)
against the per-host loop it replaces there: the same floats, on random host-count vectors of
stages that share hosts, cross them or stay inside one."""
import random

import pytest

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageModel
from tests.planner.search.test_search_optimal import random_profile
from topology import parse_topology


def vector(rng, hosts, per_host):
    counts = [0] * hosts
    for h in rng.sample(range(hosts), rng.randrange(1, min(hosts, 12) + 1)):
        counts[h] = rng.randrange(1, per_host + 1)
    return tuple(counts)


@pytest.mark.parametrize("seed", range(6))
def test_numpy_hosts_give_the_loops_floats(seed, monkeypatch):
    rng = random.Random(seed)
    hosts = rng.choice([33, 64, 128])
    topo = parse_topology(f"{hosts}x8,net=25Gbps")
    profile = random_profile(rng, 6)
    pairs = []
    for _ in range(300):
        a = vector(rng, hosts, 8)
        b = rng.choice([a, vector(rng, hosts, 8),
                        tuple(min(8, x + rng.randrange(2)) for x in a)])
        pairs.append((rng.choice([0.0, 1.0, 3e5, 7.3e7]), a, b))
    assert hosts > cm.VECTOR_HOSTS
    fast = [StageModel(profile, topo, 64, 4)._transfer_ms(*p) for p in pairs]
    monkeypatch.setattr(cm, "VECTOR_HOSTS", 10 ** 9)          # the loop, as before
    slow = [StageModel(profile, topo, 64, 4)._transfer_ms(*p) for p in pairs]
    assert fast == slow
    assert len(set(fast)) > 10
