"""PipeDream's hierarchical DP (`planner.search.pipedream`, bottom-up with numpy) against the recursive,
memoized form of its recurrence (the reference), and both against brute force: on random small
instances the returned partition, valued here independently from the profile, is optimal over
every hierarchical partition, and equals the reference's partition (the same tie-breaking); on
the paper's smaller profiles the partitions equal the reference's on topologies A and B."""
import itertools
import math
import os
import random
import sys
from functools import lru_cache

import pytest

from planner.search.pipedream import pipedream_partition
from planner.formats.profile_readers import load_profile
from tests.paths import PROFILES
from tests.planner.search.test_search_optimal import random_profile
from topology import parse_topology


def levels_of(topology):
    """[(units, bandwidth in bytes/ms)] from the devices in a host up (PipeDream §3.1)."""
    per_host = topology.devices_per_host[0]
    hosts = topology.num_devices // per_host
    if per_host == 1:
        return [(hosts, topology.inter_host_bandwidth / 1e3)]
    return [(per_host, topology.intra_host_bandwidth / 1e3),
            (hosts, topology.inter_host_bandwidth / 1e3)]


def reference_partition(profile, topology):
    """The recurrence top-down with memoization, the direct form of the module docstring's
    equations: (value, [(first, last, replicas)])."""
    def compute(i, j):
        return profile.forward_ms(i, j) + profile.backward_ms(i, j)

    def make_level(prev, bw):
        @lru_cache(maxsize=None)
        def T(i, j, m):
            inner_time, inner_part = prev(i, j) if prev else (compute(i, j), [(i, j, 1)])
            sync = 2 * (m - 1) * profile.parameter_bytes(i, j) / bw
            return max(inner_time, sync) / m, [(a, b, r * m) for a, b, r in inner_part]

        @lru_cache(maxsize=None)
        def A(i, j, m):
            best = T(i, j, m)
            for s in range(i, j):
                comm = 2 * profile.boundary_bytes(s) / bw
                for m2 in range(1, m):
                    left, right = A(i, s, m - m2), T(s + 1, j, m2)
                    value = max(left[0], comm, right[0])
                    if value < best[0]:
                        best = (value, left[1] + right[1])
            return best
        return A

    prev = None
    for count, bw in levels_of(topology):
        A = make_level(prev, bw)
        prev = (lambda i, j, A=A, count=count: A(i, j, count))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        return prev(0, profile.num_layers - 1)
    finally:
        sys.setrecursionlimit(limit)


def slowest_stage(profile, topology, part):
    """The time per profile batch of a flat partition's slowest stage or cut (PipeDream's
    objective), minimized over the ways to read it as a hierarchy: consecutive stages grouped
    into level-2 stages of m hosts each, every replica count in a group a multiple of m and
    the group's replicas per host adding up to a host's devices. inf if there is none."""
    def stage(first, last, r, bw):
        sync = 2 * (r - 1) * profile.parameter_bytes(first, last) / bw
        return max(profile.forward_ms(first, last) + profile.backward_ms(first, last), sync) / r

    def cut(last, bw):
        return 2 * profile.boundary_bytes(last) / bw

    levels = levels_of(topology)
    if len(levels) == 1:
        (_, bw), = levels
        return max([stage(a, b, r, bw) for a, b, r in part] +
                   [cut(b, bw) for a, b, r in part[:-1]])
    (per_host, bw1), (_, bw2) = levels

    @lru_cache(maxsize=None)
    def rest(x):                     # the best reading of part[x:] as whole level-2 stages
        if x == len(part):
            return 0.0
        best = math.inf
        for y in range(x + 1, len(part) + 1):
            group = part[x:y]
            hosts = sum(r for _, _, r in group) // per_host
            if hosts * per_host != sum(r for _, _, r in group) or \
                    any(r % hosts for _, _, r in group):
                continue
            inner = max([stage(a, b, r // hosts, bw1) for a, b, r in group] +
                        [cut(b, bw1) for a, b, r in group[:-1]])
            first, last = group[0][0], group[-1][1]
            value = max(inner, 2 * (hosts - 1) * profile.parameter_bytes(first, last) / bw2) / hosts
            if y < len(part):
                value = max(value, cut(last, bw2), rest(y))
            best = min(best, value)
        return best
    return rest(0)


def every_partition(n, devices):
    """Every flat partition of n layers onto `devices` devices: [(first, last, replicas)]."""
    for k in range(1, min(n, devices) + 1):
        for cuts in itertools.combinations(range(n - 1), k - 1):
            bounds = list(zip((0,) + tuple(c + 1 for c in cuts), cuts + (n - 1,)))
            for splits in itertools.combinations(range(1, devices), k - 1):
                reps = [b - a for a, b in zip((0,) + splits, splits + (devices,))]
                yield [(a, b, r) for (a, b), r in zip(bounds, reps)]


def well_formed(part, n, devices):
    return ([a for a, _, _ in part] == [0] + [b + 1 for _, b, _ in part[:-1]]
            and part[-1][1] == n - 1 and all(a <= b and r >= 1 for a, b, r in part)
            and sum(r for _, _, r in part) == devices)


TOPOLOGIES = ["1x2", "1x4", "2x2", "2x4", "4x1", "2x1", "3x2", "2x3,net=1Gbps",
              "2x2,nvlink=10GB/s,net=100Gbps", "4x1,net=100Gbps", "1x1"]


@pytest.mark.parametrize("seed", range(30))
def test_optimal_against_reference_and_brute_force(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(1, 8))
    spec = TOPOLOGIES[seed % len(TOPOLOGIES)]
    topology = parse_topology(spec)
    part = pipedream_partition(profile, topology)
    ref_value, ref_part = reference_partition(profile, topology)
    assert well_formed(part, profile.num_layers, topology.num_devices)
    value = slowest_stage(profile, topology, part)
    assert value == pytest.approx(ref_value, rel=1e-12)
    assert part == ref_part                      # ties broken as the reference breaks them
    brute = min(slowest_stage(profile, topology, p)
                for p in every_partition(profile.num_layers, topology.num_devices))
    assert value == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("name", ["vgg-19-pbs-32.txt", "bert-24-pbs-6.txt", "xlnet-24-pbs-1.txt",
                                  "amoeba-18-pbs-8.txt"])
@pytest.mark.parametrize("spec", ["A", "B"])
def test_published_profiles_match_reference(name, spec):
    profile = load_profile(os.path.join(PROFILES, "dapple", name))
    topology = parse_topology(spec)
    assert pipedream_partition(profile, topology) == reference_partition(profile, topology)[1]
