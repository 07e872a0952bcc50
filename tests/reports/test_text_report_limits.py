"""The text report limited in what it simulates (`max_tasks`, `dapple plan` without
`--simulate_all`): every row it simulates is the row of the full report (the former one, which
simulates everything), a row it leaves out says so with its task count (and a synchronous
schedule's lower bound, never above what simulating it gives), and a note says how to get
them all."""
import os

import pytest

from planner.schedules.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from planner.search.plan_space import plan_dapple
from planner.search.schedule_choice import choose_schedule, schedule_tasks
from planner.formats.profile_readers import load_profile
from reports.text_report import NOT_SIMULATED, REPORT_TASKS, strategy_report
from tests.paths import PROFILES
from tests.planner.search.test_schedule_choice import toy_profile
from tests.planner.test_schedule_cli import dapple
from topology import parse_topology


def reports(profile, topo, gbs, max_tasks, schedule="auto"):
    plan = plan_dapple(profile, topo, gbs)
    chosen, options = choose_schedule(plan, profile, topo, schedule)
    limited = strategy_report(chosen, profile, topo, schedules=options, max_tasks=max_tasks)
    chosen, again = choose_schedule(plan, profile, topo, schedule)
    full = strategy_report(chosen, profile, topo, schedules=again)
    return limited.splitlines(), full.splitlines(), options


def cells(line):
    return [c.strip() for c in line.strip("|").split(" | ")]


def check(limited, full, options, max_tasks):
    note = NOT_SIMULATED.format(tasks=max_tasks)
    skipped = [l for l in limited if "not simulated (" in l]
    assert (note in limited) == bool(skipped)
    rest = list(limited)
    if skipped:                          # the note and its blank line
        at = rest.index(note)
        assert rest[at + 1] == ""
        del rest[at:at + 2]
    assert len(rest) == len(full)
    by_name = {o.name: o for o in options}
    for mine, theirs in zip(rest, full):
        if mine == theirs:
            continue
        name, shown = cells(mine)[:2]
        assert cells(theirs)[0].startswith(name)
        option = by_name[name]
        assert shown.endswith(f"not simulated ({option.tasks:,} tasks)")
        assert option.tasks > max_tasks
        if not option.relaxed:           # the bound, at most the simulated iteration
            bound = float(shown.split()[1])
            assert bound <= float(cells(theirs)[1]) + 0.05
    return skipped


def test_without_a_limit_it_is_the_full_report():
    profile, topo = toy_profile(), parse_topology("2x2,net=1Gbps")
    limited, full, _ = reports(profile, topo, 64, None)
    assert limited == full


def test_a_limit_leaves_out_only_what_auto_did_not_simulate():
    profile, topo = toy_profile(), parse_topology("2x2,net=1Gbps")
    limited, full, options = reports(profile, topo, 64, 0)
    skipped = check(limited, full, options, 0)
    simulated = [o for o in options if o.simulated]
    assert len(skipped) == len(options) - len(simulated) > 0
    assert any(not o.relaxed for o in simulated)      # the chosen schedule is shown


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "pipedream", "avgpipe"])
def test_the_plans_own_schedule_is_always_simulated(schedule):
    profile, topo = toy_profile(), parse_topology("2x2,net=1Gbps")
    limited, full, options = reports(profile, topo, 64, 0, schedule)
    skipped = check(limited, full, options, 0)
    assert schedule not in {cells(l)[0] for l in skipped}
    assert len(skipped) == len(options) - 1


def test_table_v_straight_pipeline_at_32_micro_batches():
    profile = load_profile(os.path.join(PROFILES, "dapple", "bert-48-pbs-2.txt"))
    limited, full, options = reports(profile, parse_topology("B"), 64, REPORT_TASKS)
    skipped = check(limited, full, options, REPORT_TASKS)
    assert {cells(l)[0] for l in skipped} == {"interleaved", "pipedream", "2bw", "avgpipe"}


def test_tasks_count_what_the_simulation_runs():
    profile, topo = toy_profile(), parse_topology("2x2,net=1Gbps")
    plan = plan_dapple(profile, topo, 64)
    _, options = choose_schedule(plan, profile, topo, "auto")
    for o in options:
        if o.plan is None:
            continue
        computed = sum(1 for lst in o.simulation.schedule.lists for a in lst
                       if a.kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
        assert o.tasks == computed == schedule_tasks(plan, o.name), o.name


def test_dapple_plan_simulate_all_prints_the_full_report(tmp_path):
    path = os.path.join(PROFILES, "dapple", "bert-48-pbs-2.txt")
    args = (f"--profile={path}", "--topology=B", "--global_batch_size=64", "--schedule=auto")
    default, everything = dapple("plan", *args), dapple("plan", *args, "--simulate_all")
    assert default.returncode == everything.returncode == 0, default.stderr
    profile = load_profile(path)
    topo = parse_topology("B")
    plan = plan_dapple(profile, topo, 64)
    _, options = choose_schedule(plan, profile, topo, "auto")
    assert "not simulated" not in everything.stdout
    check(default.stdout.splitlines(), everything.stdout.splitlines(), options, REPORT_TASKS)
