"""Choosing a schedule: chunk cuts against brute force, memory per device by hand, `auto`
taking the fastest schedule that fits, explicit schedules that do not fit refused clearly."""
import itertools
import json
import random

import numpy as np
import pytest

from planner.estimate import cost_model as cm
from planner.search.chunking import balanced_cuts, interleave_plan
from planner.formats.plan import PlanError, straight_plan
from planner.formats.profile import parse_native_json
from planner.search.schedule_choice import (ScheduleOption, choose_schedule, fastest,
                                     schedule_options, with_schedule)
from planner.estimate.simulator import SimulationResult
from topology import parse_topology


def toy_profile(forward=(1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0)):
    layers = [{"name": f"l{i}", "type": "Dense", "forward_ms": f, "backward_ms": 2 * f,
               "output_bytes": 1e6, "parameter_bytes": 4e6, "inputs": [i - 1]}
              for i, f in enumerate(forward)]
    return parse_native_json(json.dumps({"format": "dapple-profile", "version": 1,
                                         "name": "toy", "batch_size": 8, "layers": layers}))


@pytest.mark.parametrize("N,C", [(4, 2), (6, 3), (7, 4), (8, 8), (9, 2)])
def test_balanced_cuts_equal_the_best_of_every_cut(N, C):
    times = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0][:N]

    def chunk_ms(c, first, last):         # chunks on odd positions run twice as fast
        return sum(times[first:last + 1]) / (2 if c % 2 else 1)

    cuts = balanced_cuts(chunk_ms, N, C)
    assert cuts[0][0] == 0 and cuts[-1][1] == N - 1
    assert all(a[1] + 1 == b[0] and a[0] <= a[1] for a, b in zip(cuts, cuts[1:]))
    best = min(max(chunk_ms(c, a, b - 1) for c, (a, b) in enumerate(zip((0,) + ends, ends + (N,))))
               for ends in itertools.combinations(range(1, N), C - 1))
    assert max(chunk_ms(c, a, b) for c, (a, b) in enumerate(cuts)) == best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_cuts_over_tables_equal_the_loop(seed):
    """The numpy program (`chunk_table`) gives the loop's cuts, ties included (small integer
    times tie often; the first least cut is kept by both)."""
    rng = random.Random(seed)
    N = rng.randrange(1, 14)
    C = rng.randrange(1, N + 1)
    S = rng.randrange(1, C + 1)
    ints = rng.random() < 0.5
    times = [[float(rng.randrange(1, 4)) if ints else rng.uniform(0.1, 5) for _ in range(N)]
             for _ in range(S)]

    def chunk_ms(c, first, last):
        return sum(times[c % S][first:last + 1]) + 0.5

    def chunk_table(c):
        return np.array([[chunk_ms(c, i, e) if e >= i else -1.0 for e in range(N)]
                         for i in range(N)])
    assert balanced_cuts(chunk_ms, N, C, chunk_table) == balanced_cuts(chunk_ms, N, C)


def test_too_few_layers_for_the_chunks_is_a_clear_error():
    plan = straight_plan([4], 8, micro_batches=4, global_batch_size=32)
    with pytest.raises(PlanError, match="2 device group.* virtual_stages = 5: 10 chunks need "
                                        "at least 10 layers"):
        interleave_plan(plan, toy_profile(), parse_topology("1x2"), 5)


def test_interleaved_chunks_run_on_the_devices_of_their_group():
    plan = straight_plan([4], 8, micro_batches=4, global_batch_size=32, replicas=[2, 1])
    chunked = interleave_plan(plan, toy_profile(), parse_topology("1x3"), 2)
    chunked.validate(num_layers=8, num_devices=3)
    assert [st.devices for st in chunked.stages] == [[0, 1], [2], [0, 1], [2]]
    assert (chunked.schedule, chunked.virtual_stages, chunked.shape()) == ("interleaved", 2, "2:1")


def test_memory_per_device_of_each_schedule_by_hand():
    # Two stages of two layers (1 MB outputs, 4 MB parameters each, batch 8 = the profile's).
    p, t = toy_profile((1.0, 2.0, 3.0, 4.0)), parse_topology("1x2")
    plan = straight_plan([2], 4, micro_batches=4, global_batch_size=32)
    weights = cm.BYTES_PER_PARAMETER_FACTOR * 8e6 + cm.DEVICE_RESERVED_BYTES
    held = cm.ACTIVATION_MEMORY_FACTOR * 2e6                   # two layers' outputs
    awaiting = cm.WEIGHT_GRADIENT_MEMORY_FACTOR * 2e6
    one = cm.PlanCosts(with_schedule(plan, "1f1b"), p, t).memory()
    assert one == pytest.approx([weights + 2 * held, weights + held])       # K = [2, 1]
    # ZB-H1: stage 0 F0 F1 (2 held) I0 W0 ...; stage 1 1F0 1I0 1F1: one held, one awaiting W.
    zero = cm.PlanCosts(with_schedule(plan, "zb-h1"), p, t).memory()
    assert zero == pytest.approx([weights + 2 * held, weights + held + awaiting])
    # Interleaved v = 2 on the same two devices: one layer per chunk, both chunks' weights on
    # a device, the reserve once; position 0 holds 5 chunk-micro-batches at its peak, position
    # 1 holds 3 (tests/planner/schedules/test_schedule_generators.py, INTERLEAVED_PEAKS).
    chunked = interleave_plan(plan, p, t, 2)
    per_chunk = cm.ACTIVATION_MEMORY_FACTOR * 1e6
    memory = cm.PlanCosts(chunked, p, t).memory()
    assert memory == pytest.approx([weights + 5 * per_chunk, weights + 3 * per_chunk] * 2)


def option(name, iteration, fits=True):
    result = SimulationResult(iteration_ms=iteration, stages=[], events=[])
    return ScheduleOption(name, plan=straight_plan([1], 2, 2), simulation=result,
                          memory_bytes=[1.0 if fits else 3.0], device_memory_bytes=2.0)


def test_fastest_takes_the_least_iteration_that_fits_and_breaks_ties_for_the_runtime():
    assert fastest([option("1f1b", 10), option("zb-h1", 8), option("interleaved", 7, False)]
                   ).name == "zb-h1"
    assert fastest([option("zb-h1", 10), option("gpipe", 10), option("1f1b", 10)]).name == "1f1b"
    with pytest.raises(PlanError, match="no schedule fits"):
        fastest([option("gpipe", 5, False)])


def test_auto_and_explicit_choices_on_a_plan():
    p, t = toy_profile(), parse_topology("1x2")
    plan = straight_plan([4], 8, micro_batches=8, global_batch_size=64)
    options = schedule_options(plan, p, t)
    assert [o.name for o in options] == ["gpipe", "1f1b", "interleaved", "zb-h1", "pipedream",
                                         "2bw", "avgpipe"]
    chosen, _ = choose_schedule(plan, p, t, "auto")
    synchronous = ("gpipe", "1f1b", "interleaved", "zb-h1")    # auto never takes a relaxed one
    assert chosen.schedule == min((o for o in options if o.fits and o.name in synchronous),
                                  key=lambda o: o.iteration_ms).name
    zb, _ = choose_schedule(plan, p, t, "zb-h1")
    assert zb.schedule == "zb-h1" and zb.estimate.method == "simulated"
    assert zb.estimate.latency_ms == next(o for o in options if o.name == "zb-h1").iteration_ms
    three, _ = choose_schedule(plan, p, t, "interleaved", virtual_stages=3)
    assert (three.num_stages, three.virtual_stages) == (6, 3)


def test_a_schedule_that_does_not_fit_is_refused_naming_the_memory():
    # Memory for 1F1B's K = [2, 1] (its cap), not for GPipe's 8 micro-batches in flight.
    p = toy_profile()
    held = cm.ACTIVATION_MEMORY_FACTOR * 4e6 * 8 / 8          # 4 layers of 1 MB per stage
    limit = cm.BYTES_PER_PARAMETER_FACTOR * 16e6 + cm.DEVICE_RESERVED_BYTES + 2.5 * held
    t = parse_topology(f"1x2,mem={limit / 2**30:.6f}GB")
    plan = straight_plan([4], 8, micro_batches=8, global_batch_size=64)
    with pytest.raises(PlanError, match="schedule 'gpipe' .* needs .* GiB per device on device "
                                        "group 0"):
        choose_schedule(plan, p, t, "gpipe")
    assert choose_schedule(plan, p, t, "auto")[0].schedule != "gpipe"


def test_bad_choices_are_refused():
    p, t = toy_profile(), parse_topology("1x2")
    plan = straight_plan([4], 8, micro_batches=8, global_batch_size=64)
    with pytest.raises(PlanError, match="unknown schedule 'zigzag'"):
        choose_schedule(plan, p, t, "zigzag")
    with pytest.raises(PlanError, match="virtual_stages applies to the interleaved"):
        choose_schedule(plan, p, t, "zb-h1", virtual_stages=2)
