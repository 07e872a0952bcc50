"""AvgPipe: one pipeline per stage replica, elastic averaging, `advance` forwards ahead
(`planner.schedules.avgpipe_pipelines`); a flush between batches."""
from __future__ import annotations

from typing import Optional, Sequence

from planner.schedules.actions import Schedule, ScheduleError
from planner.schedules.avgpipe_pipelines import advance_depths, pipelines
from planner.schedules.relaxed_lists import flushed
from planner.schedules.forward_backward import forward_backward_schedule
from planner.schedules.relaxed import ADVANCE, BATCHES, RelaxedSpec


class AvgPipe(RelaxedSpec):
    """N pipelines on the replicas, each synchronous, their weights averaged per batch."""

    name = "avgpipe"
    summary = "AvgPipe: a pipeline per stage replica, elastic averaging, advance forwards ahead"
    averaging = True                     # the fact the simulator, cost model and runtime ask
    parameters = (BATCHES, ADVANCE)      # advance: tuned by the planner (Algorithm 1)
    update_rule = ("every global batch, N pipelines: w_i <- (1 - a) w_i + a z + Delta_i, "
                   "z <- z + (1/N) sum_i Delta_i, a = 1/N; no staleness inside a pipeline")

    def run_actions(self, num_positions: int, micro_batches: int,
                    warmup: Optional[Sequence[int]], batches: int, advance: Optional[int],
                    vertical_sync: bool) -> Schedule:
        if warmup is not None:
            raise ScheduleError(f"schedule {self.name!r} fixes its own warm-up by advance "
                                f"(forwards ahead of 1F1B's); remove warmup")
        depths = advance_depths(num_positions, micro_batches, advance or 0)
        return flushed(forward_backward_schedule(num_positions, micro_batches, depths,
                                                 self.name), batches, self.name, averaging=True)

    def plan_problem(self, plan) -> Optional[str]:
        try:
            pipelines([st.replicas for st in plan.stages])
        except ScheduleError as e:
            return str(e)
        return None

    def pipelines(self, plan) -> int:
        return plan.stages[0].replicas


AVGPIPE = AvgPipe()
