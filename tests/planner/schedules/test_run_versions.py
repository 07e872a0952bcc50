"""planner.schedules.run_versions: what a run that continues earlier runs reads, by hand from the rules
(2BW: batch t reads W(t - 1); PipeDream: micro-batch j on stage s reads W_s(j - K_s + 1);
AvgPipe flushes, so batch t reads version t)."""
import dataclasses

import pytest

from planner.schedules.actions import ScheduleError
from planner.formats.plan import straight_plan
from planner.schedules.run_versions import carried, relative_versions, update_count
from planner.schedules.by_name import plan_schedule

M = 4


def builder(name, replicas=(1, 1, 1), **settings):
    plan = straight_plan([1, 2], 3, M, 16, replicas=list(replicas), schedule=name)
    for k, v in settings.items():
        setattr(plan, k, v)
    return lambda k: plan_schedule(dataclasses.replace(plan, batches=k))


def table(versions, chunks, micro_batches):
    return [[versions[(c, j)] for j in range(micro_batches)] for c in range(chunks)]


def test_two_bw_reads_the_version_before_across_the_run_start():
    versions = relative_versions(builder("2bw"), 2)
    assert table(versions, 3, 2 * M) == [[-1] * M + [0] * M] * 3
    assert carried(versions, 3) == [1, 1, 1]


def test_pipedream_reads_k_s_minus_one_updates_back():
    versions = relative_versions(builder("pipedream"), 1)      # K = 3, 2, 1
    assert table(versions, 3, M) == [[-2, -1, 0, 1], [-1, 0, 1, 2], [0, 1, 2, 3]]
    assert carried(versions, 3) == [2, 1, 0]


def test_vertical_sync_reads_stage_zeros_version_everywhere():
    versions = relative_versions(builder("pipedream", vertical_sync=True), 1)
    assert table(versions, 3, M) == [[-2, -1, 0, 1]] * 3
    assert carried(versions, 3) == [2, 2, 2]


def test_avgpipe_reads_nothing_from_before_its_run():
    versions = relative_versions(builder("avgpipe", replicas=(2, 2, 2), advance=2), 2)
    assert table(versions, 3, 2 * M) == [[0] * M + [1] * M] * 3
    assert carried(versions, 3) == [0, 0, 0]


def test_update_counts():
    assert update_count(builder("pipedream")(2)) == {0: 2 * M, 1: 2 * M, 2: 2 * M}
    assert update_count(builder("2bw")(3)) == {0: 3, 1: 3, 2: 3}


def test_a_schedule_whose_versions_change_with_the_run_length_is_refused():
    def odd(k):       # a "rule" reading version 1 only in runs of one batch
        s = builder("2bw")(k)
        if k > 1:
            return s
        lists = [tuple(dataclasses.replace(a, version=1) if a.kind == "F" and a.micro_batch == 1
                       else a for a in lst) for lst in s.lists]
        return dataclasses.replace(s, lists=tuple(lists))
    with pytest.raises(ScheduleError, match="not the same rule in every run"):
        relative_versions(odd, 1)
