"""Planning the relaxed schedules (pipedream, 2bw, avgpipe): the memory model's weight copies by
hand, AvgPipe's pipelines costed per pipeline, `auto` never taking one, the Plan JSON, and the
runtime refusing them until it runs them."""
import json

import pytest

from planner.estimate import cost_model as cm
from planner.formats.plan import Plan, PlanError, straight_plan
from planner.schedules.by_name import require_runtime_support
from planner.search.schedule_choice import choose_schedule, schedule_options, with_schedule
from reports.text_report import strategy_report
from tests.planner.search.test_schedule_choice import toy_profile
from topology import parse_topology

# Two stages of two layers: 1 MB outputs and 4 MB parameters a layer, batch 8 = the profile's.
PARAMETERS = 8e6                                        # one stage's weights: one copy
WEIGHTS = cm.BYTES_PER_PARAMETER_FACTOR * PARAMETERS + cm.DEVICE_RESERVED_BYTES
HELD = cm.ACTIVATION_MEMORY_FACTOR * 2e6                 # one 8-sample micro-batch's activations


def two_stages(replicas=(1, 1), schedule="1f1b"):
    return straight_plan([2], 4, micro_batches=4, global_batch_size=32, replicas=list(replicas),
                         schedule=schedule)


def memory(plan, topology="1x2"):
    return cm.PlanCosts(plan, toy_profile((1.0, 2.0, 3.0, 4.0)), parse_topology(topology)).memory()


def test_memory_counts_the_weight_copies_of_each_schedule_by_hand():
    # 1F1B warms up K = [2, 1] and keeps one copy. 2BW two on every stage; PipeDream one per
    # micro-batch in flight, K_s = [2, 1]; with vertical sync K_0 = 2 on every stage.
    assert memory(two_stages()) == pytest.approx([WEIGHTS + 2 * HELD, WEIGHTS + HELD])
    assert memory(with_schedule(two_stages(), "2bw")) == pytest.approx(
        [WEIGHTS + PARAMETERS + 2 * HELD, WEIGHTS + PARAMETERS + HELD])
    assert memory(with_schedule(two_stages(), "pipedream")) == pytest.approx(
        [WEIGHTS + PARAMETERS + 2 * HELD, WEIGHTS + HELD])
    synced = with_schedule(two_stages(), "pipedream")
    synced.vertical_sync = True
    assert memory(synced) == pytest.approx([WEIGHTS + PARAMETERS + 2 * HELD,
                                            WEIGHTS + PARAMETERS + HELD])


def test_avgpipe_costs_one_pipeline_per_replica_by_hand():
    # Stages on 2 devices each. Synchronous 1F1B splits each micro-batch in two slices; AvgPipe
    # runs whole micro-batches on each device (a pipeline per replica), keeps w_i and z, and
    # its allreduce sums the updates over the 2 pipelines: a 2-device ring moves the 8 MB once.
    t = parse_topology("1x4")
    sync = two_stages((2, 2))
    avg = with_schedule(sync, "avgpipe")
    assert (avg.advance, avg.batches) == (0, 4)
    assert memory(sync, "1x4") == pytest.approx([WEIGHTS + HELD, WEIGHTS + HELD / 2])
    assert memory(avg, "1x4") == pytest.approx([WEIGHTS + PARAMETERS + 2 * HELD,
                                                WEIGHTS + PARAMETERS + HELD])
    profile = toy_profile((1.0, 2.0, 3.0, 4.0))
    pipeline = cm.PlanCosts(avg, profile, t).pipeline
    assert pipeline.forward_ms == pytest.approx([1 + 2 + cm.TASK_OVERHEAD_MS,
                                                 3 + 4 + cm.TASK_OVERHEAD_MS])   # all 8 samples
    ring = PARAMETERS / (t.intra_host_bandwidth / 1e3) + 2 * t.intra_host_latency * 1e3
    assert pipeline.allreduce_ms == pytest.approx([ring, ring])
    options = schedule_options(sync, profile, t, names=("avgpipe",))
    assert options[0].simulation.pipelines == 2
    assert options[0].iteration_ms == options[0].simulation.iteration_ms / (4 * 2)


def test_avgpipe_needs_as_many_replicas_on_every_stage():
    option = schedule_options(two_stages((2, 1)), toy_profile((1.0, 2.0, 3.0, 4.0)),
                              parse_topology("1x3"), names=("avgpipe",))[0]
    assert option.plan is None and "same number of devices; this plan has 2:1" in option.note


def test_auto_never_takes_a_relaxed_schedule_even_when_it_is_fastest():
    # Two micro-batches on two stages: 1F1B idles half the time, 2BW over 4 batches much less.
    p, t = toy_profile(), parse_topology("1x2")
    plan = straight_plan([4], 8, micro_batches=2, global_batch_size=16)
    options = schedule_options(plan, p, t)
    best = min((o for o in options if o.fits), key=lambda o: o.iteration_ms)
    assert best.relaxed                               # so the test below can fail
    chosen, _ = choose_schedule(plan, p, t, "auto")
    assert chosen.schedule in ("gpipe", "1f1b", "interleaved", "zb-h1")
    assert chosen.estimate.latency_ms == min(o.iteration_ms for o in options
                                             if o.fits and not o.relaxed)


def test_an_explicit_relaxed_schedule_is_planned_and_written():
    p, t = toy_profile(), parse_topology("1x2")
    plan = straight_plan([4], 8, micro_batches=8, global_batch_size=64)
    two, options = choose_schedule(plan, p, t, "2bw", batches=3)
    option = next(o for o in options if o.name == "2bw")
    assert (two.schedule, two.batches, two.warmup) == ("2bw", 3, two.warmup_depths())
    assert two.estimate.method == "simulated"
    assert two.estimate.latency_ms == option.iteration_ms == \
        option.simulation.iteration_ms / 3
    assert json.loads(two.to_json())["schedule"] == {"name": "2bw", "warmup": two.warmup,
                                                     "batches": 3}
    assert Plan.from_json(two.to_json()) == two
    avg, _ = choose_schedule(plan, p, t, "avgpipe")
    assert json.loads(avg.to_json())["schedule"] == {"name": "avgpipe", "batches": 4,
                                                     "advance": avg.advance}
    report = strategy_report(two, p, t, schedules=options)
    assert "Relaxed schedules on the same plan, opt-in" in report
    assert "| 2bw (3 batches) |" in report and "W(t+1) = W(t) - lr grad f(W(t-1))" in report
    row = next(line for line in report.splitlines() if line.startswith("| pipedream"))
    assert row.endswith("| 1, 0 |")                  # stage 0 one update stale, stage 1 none


def test_avgpipe_advance_is_algorithm_1_over_simulations():
    # On slow links forwards ahead hide transfers. The planner's advance a must be where
    # Algorithm 1 stops: each step up to a faster than the one before, a + 1 not faster.
    import dataclasses
    from planner.estimate.cost_model import PlanCosts
    p, t = toy_profile(), parse_topology("4x1,net=100Mbps")
    plan = straight_plan([2, 4, 6], 8, micro_batches=8, global_batch_size=64)
    chosen, _ = choose_schedule(plan, p, t, "avgpipe")

    def per_batch(a):
        variant = dataclasses.replace(chosen, advance=a, estimate=None)
        return PlanCosts(variant, p, t).simulation().batch_ms
    times = [per_batch(a) for a in range(chosen.advance + 2)]
    assert chosen.advance > 0
    assert all(later < earlier for earlier, later in zip(times, times[1:chosen.advance + 1]))
    assert times[chosen.advance + 1] >= times[chosen.advance]


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["schedule"].update(name="1f1b"), "schedule '1f1b' takes no batches"),
    (lambda d: d["schedule"].update(batches=0), "must be a positive integer"),
    (lambda d: d["schedule"].update(advance=1), "schedule '2bw' takes no advance"),
    (lambda d: d["schedule"].update(vertical_sync=True), "takes no vertical_sync"),
    (lambda d: d["schedule"].update(name="avgpipe", warmup=None), "this plan has 2:1"),
])
def test_hand_edited_relaxed_plans_are_refused_naming_the_problem(edit, message):
    data = json.loads(with_schedule(two_stages((2, 1)), "2bw").to_json())
    edit(data)
    data["schedule"] = {k: v for k, v in data["schedule"].items() if v is not None}
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data).validate(num_layers=4)


def test_the_runtime_runs_the_relaxed_schedules():
    for name in ("pipedream", "2bw"):
        require_runtime_support(with_schedule(two_stages(), name))
    require_runtime_support(with_schedule(two_stages((2, 2)), "avgpipe"))


def test_a_relaxed_plan_put_under_a_schedule_keeps_its_run():
    # `dapple plan --evaluate` compares the schedules on a plan; a relaxed plan's batches (and a
    # pipedream plan's vertical sync) carry over, the defaults fill in elsewhere.
    plan = with_schedule(two_stages(), "pipedream", batches=2)
    plan.vertical_sync = True
    again = with_schedule(plan, "pipedream")
    assert (again.batches, again.vertical_sync) == (2, True)
    two = with_schedule(plan, "2bw")
    assert (two.batches, two.vertical_sync, two.warmup) == (2, None, [2, 1])
    one = with_schedule(plan, "1f1b")
    assert (one.batches, one.vertical_sync, one.advance) == (None, None, None)
    assert with_schedule(two_stages(), "2bw").batches == 4
    with pytest.raises(PlanError, match="batches applies to pipedream, 2bw, avgpipe"):
        with_schedule(plan, "zb-h1", batches=2)
