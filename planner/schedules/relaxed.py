"""What the relaxed schedules share (`planner.schedules.relaxed_lists`): they run `batches` consecutive
global batches in one list with the weight updates in it; their weights are stale or averaged,
which a user opts in to (`auto` never takes one)."""
from __future__ import annotations

from typing import List, Optional, Sequence

from planner.schedules.actions import Schedule, ScheduleError
from planner.schedules.avgpipe_pipelines import advance_depths
from planner.schedules.relaxed_lists import DEFAULT_BATCHES, check_batches
from planner.schedules.base import Parameter, ScheduleSpec
from planner.schedules.forward_backward import (forward_backward_schedule, given_or_default,
                                                policy_a_depths)


def _check_advance(advance) -> None:
    advance_depths(1, 1, advance)


def _check_vertical_sync(value) -> None:
    if value not in (None, True, False):
        raise ScheduleError(f"vertical_sync is true or false, got {value!r}")


BATCHES = Parameter("batches", DEFAULT_BATCHES, check_batches,
                    "consecutive global batches one run covers, without a flush (default 4)")
ADVANCE = Parameter("advance", 0, _check_advance,
                    "forwards ahead of 1F1B's warm-up on the first stage (default 0)")
VERTICAL_SYNC = Parameter("vertical_sync", False, _check_vertical_sync,
                          "every stage reads the weight version stage 0 read (default false)")


class RelaxedSpec(ScheduleSpec):
    relaxed = True
    parameters = (BATCHES,)


class OverOneFOneB(RelaxedSpec):
    """1F1B's order over all k M micro-batches of a run, no flush; warm-up as 1F1B's."""

    takes_warmup = True
    planner_warmup = True

    def default_warmup(self, num_stages: int, micro_batches: int) -> List[int]:
        return policy_a_depths(num_stages, micro_batches)

    def run_actions(self, num_positions: int, micro_batches: int,
                    warmup: Optional[Sequence[int]], batches: int, advance: Optional[int],
                    vertical_sync: bool) -> Schedule:
        ks = given_or_default(self, warmup, num_positions, micro_batches)
        order = forward_backward_schedule(num_positions, batches * micro_batches, ks, self.name)
        return self.with_updates(order, micro_batches, batches, vertical_sync)

    def with_updates(self, order: Schedule, micro_batches: int, batches: int,
                     vertical_sync: bool) -> Schedule:
        """`order` (1F1B over the run) with this schedule's updates and weight versions."""
        raise NotImplementedError
