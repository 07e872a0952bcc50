"""PipeDream-2BW: 1F1B, an update per global batch, two weight versions
(`planner.schedules.relaxed_lists`)."""
from __future__ import annotations

from planner.schedules.actions import Schedule
from planner.schedules.relaxed_lists import two_bw
from planner.schedules.relaxed import OverOneFOneB


class TwoBW(OverOneFOneB):
    name = "2bw"
    summary = "PipeDream-2BW: 1F1B, an update per global batch, two weight versions"
    update_rule = ("every global batch: W(t+1) = W(t) - lr grad f(W(t-1)), 1 update stale on "
                   "every stage")

    def with_updates(self, order: Schedule, micro_batches: int, batches: int,
                     vertical_sync: bool) -> Schedule:
        return two_bw(order, micro_batches, batches, name=self.name)


TWO_BW = TwoBW()
