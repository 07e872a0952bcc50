"""`seed_plans.TwoStageSeeds` (every two-stage seed at one M as numpy arrays) against the former
seeding, `Search.seed` called once per shape of `seed_shapes`: the same incumbent (plan and
value) and the same seed count, on random profiles (with and without shared parameters, memory
that fits some stages only), hosts of several sizes, restricted stage sizes, and on Table V
cells and BERT-48 on 128 x 8 (1,024 devices, 6,600 two-stage shapes per M)."""
import dataclasses
import math
import os
import random

import pytest

from planner.estimate import cost_model as cm
from planner.estimate.cost_model import StageModel
from planner.formats.profile import SharedParameters
from planner.formats.profile_readers import load_profile
from planner.search.exact_search import LARGE_TOPOLOGY_DEVICES, Search, SearchStats
from planner.search.plan_finishing import micro_batch_choices
from planner.search.seed_plans import seed_search, seed_shapes
from tests.paths import PROFILES
from tests.planner.search.test_search_oracle import random_topology
from tests.planner.search.test_search_optimal import random_profile
from topology import parse_topology


def one_at_a_time(search, ms):
    """The former `seed_search`: every shape offered with `Search.seed`."""
    shapes = seed_shapes(search.profile, search.topology, search.stage_sizes)
    for M in ms:
        model = StageModel(search.profile, search.topology, search.gbs, M)
        for stages in shapes:
            search.seed(M, stages, model)


def seeded(seeder, profile, topo, gbs, sizes, max_stages, policies=None):
    stats = SearchStats()
    extra = {} if policies is None else {"policies": policies}
    search = Search(profile, topo, gbs, stage_sizes=sizes, stats=stats, max_stages=max_stages,
                    **extra)
    min_slice = cm.minimum_slice(profile, topo, gbs)
    ms = [M for M in micro_batch_choices(gbs) if min_slice <= gbs // M]
    seeder(search, ms)
    return search.best, search.best_value, stats.seeds


def same(profile, topo, gbs, sizes=None, max_stages=None, policies=None):
    new = seeded(seed_search, profile, topo, gbs, sizes, max_stages, policies)
    old = seeded(one_at_a_time, profile, topo, gbs, sizes, max_stages, policies)
    assert new == old
    return new


@pytest.mark.parametrize("seed", range(40))
def test_random_instances(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randrange(2, 14))
    if seed % 2:
        n = profile.num_layers
        shared = [SharedParameters(rng.choice([1e6, 2e8]),
                                   tuple(sorted(rng.sample(range(n), min(n, 2)))))]
        profile = dataclasses.replace(profile, shared_parameters=tuple(shared), content_hash="")
    hosts = rng.choice([(2, 2), (4,), (2, 1, 1), (3, 3), (4, 4), (2, 2, 2, 2), (8,), (1,) * 6])
    topo = random_topology(rng, hosts)
    gbs = rng.choice([8, 16, 32, 64, 96])
    G = topo.num_devices
    sizes = rng.choice([None, None, [1], [1, 2], list(range(2, G + 1, 2))])
    policies = rng.choice([None, ("fresh", "scatter"), ("append",)])
    for max_stages in (2, None):
        same(profile, topo, gbs, sizes, max_stages, policies)


@pytest.mark.parametrize("name,gbs,cfg", [("gnmt-16-pbs-64.txt", 1024, "C"),
                                          ("amoeba-36-pbs-1.txt", 128, "B"),
                                          ("vgg-19-pbs-32.txt", 2048, "A"),
                                          ("bert-48-pbs-2.txt", 8192, "128x8,net=25Gbps")])
def test_table_v_and_128x8(name, gbs, cfg):
    profile = load_profile(os.path.join(PROFILES, "dapple", name))
    topo = parse_topology(cfg)
    sizes = None
    if topo.num_devices > LARGE_TOPOLOGY_DEVICES:     # as the search narrows them
        h = max(topo.devices_per_host)
        sizes = sorted(set(range(1, h + 1)) | set(range(h, topo.num_devices + 1, h)))
    best, value, seeds = same(profile, topo, gbs, sizes, 2)
    assert best is not None and math.isfinite(value) and seeds > 100
