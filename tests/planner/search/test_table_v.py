"""The paper's Table V cells (its own profiles, 16 V100s, configs A/B/C): DAPPLE's plan is never
estimated slower than PipeDream's plan under the same cost model (DAPPLE §VI-F's comparison),
and the plan shapes that match the paper today stay matched, in the default ("paper") plan
space (14 of 15) and in the full one (9 of 15); docs/reproductions.md (Table V) explains the
cells that differ."""
import os

import pytest

from planner.estimate import cost_model as cm
from planner.search.pipedream import plan_pipedream
from planner.formats.profile_readers import load_profile
from planner.search.plan_space import plan_dapple
from tests.paths import PROFILES as SHARED_PROFILES
from topology import parse_topology

PROFILES = os.path.join(SHARED_PROFILES, "dapple") + os.sep
# (profile, global batch, the paper's plan shape on A, B, C)
TABLE_V = [("vgg-19-pbs-32.txt", 2048, ("DP", "DP", "15:1")),
           ("gnmt-16-pbs-64.txt", 1024, ("8:8", "8:8", "straight")),
           ("bert-48-pbs-2.txt", 64, ("8:8", "straight", "straight")),
           ("xlnet-36-pbs-1.txt", 128, ("8:8", "8:8", "straight")),
           ("amoeba-36-pbs-1.txt", 128, ("8:8", "11:5", "11:5"))]
CELLS = [(f, gbs, cfg, shape) for f, gbs, shapes in TABLE_V for cfg, shape in zip("ABC", shapes)]
PLANS = {}


def planned(f, gbs, cfg, plan_space="paper"):
    if (f, cfg, plan_space) not in PLANS:
        profile, topo = load_profile(PROFILES + f), parse_topology(cfg)
        PLANS[f, cfg, plan_space] = (profile, topo,
                                     plan_dapple(profile, topo, gbs, plan_space=plan_space))
    return PLANS[f, cfg, plan_space]


@pytest.mark.parametrize("plan_space", ["paper", "full"])
@pytest.mark.parametrize("f, gbs, cfg, shape", CELLS)
def test_dapple_never_worse_than_pipedream(f, gbs, cfg, shape, plan_space):
    profile, topo, plan = planned(f, gbs, cfg, plan_space)
    pd = plan_pipedream(profile, topo, gbs)
    model = cm.StageModel(profile, topo, gbs, pd.micro_batches)
    pd_fits = all(model.max_in_flight(s.first, s.last, s.replicas) >= 1 for s in pd.stages)
    again = cm.evaluate(plan, profile, topo).latency_ms
    assert again == pytest.approx(plan.estimate.latency_ms)
    if pd_fits:
        assert plan.estimate.latency_ms <= pd.estimate.latency_ms * (1 + 1e-9)
    else:       # PipeDream ignores memory; DAPPLE's plan must fit
        assert max(s.memory_bytes for s in plan.estimate.stages) <= topo.device_memory_bytes


def test_table_v_shapes_in_the_paper_plan_space():
    missed = {(f, cfg) for f, gbs, cfg, shape in CELLS
              if planned(f, gbs, cfg)[2].shape() != shape}
    # AmoebaNet-36 on B: the straight pipeline (2263 ms) beats the paper's 11:5 (2801 ms).
    assert missed <= {("amoeba-36-pbs-1.txt", "B")}


def test_matched_table_v_shapes_stay_matched_in_the_full_plan_space():
    matched = {(f, cfg) for f, gbs, cfg, shape in CELLS
               if planned(f, gbs, cfg, "full")[2].shape() == shape}
    assert {("vgg-19-pbs-32.txt", "A"), ("vgg-19-pbs-32.txt", "B"),
            ("vgg-19-pbs-32.txt", "C"), ("gnmt-16-pbs-64.txt", "A"),
            ("bert-48-pbs-2.txt", "B"), ("bert-48-pbs-2.txt", "C"),
            ("bert-48-pbs-2.txt", "A"), ("xlnet-36-pbs-1.txt", "A"),
            ("amoeba-36-pbs-1.txt", "A")} <= matched


@pytest.mark.parametrize("f, gbs, cfg, shape", CELLS)
def test_interleaved_chunks_by_table_equal_the_loop(f, gbs, cfg, shape, monkeypatch):
    """`chunking.interleave_plan` cuts each cell's plan (v = 2, 3) over numpy tables as the
    loop over `chunk_ms` does."""
    from planner.search import chunking
    profile, topo, plan = planned(f, gbs, cfg)
    for v in (2, 3):
        if plan.num_stages * v > profile.num_layers:
            continue
        by_table = chunking.interleave_plan(plan, profile, topo, v).to_json()
        loop = chunking.balanced_cuts
        with monkeypatch.context() as m:
            m.setattr(chunking, "balanced_cuts", lambda ms, n, c, table=None: loop(ms, n, c))
            assert chunking.interleave_plan(plan, profile, topo, v).to_json() == by_table
