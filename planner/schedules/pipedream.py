"""PipeDream with weight stashing: an update after every backward (`planner.schedules.relaxed_lists`)."""
from __future__ import annotations

from planner.schedules.actions import Schedule
from planner.schedules.relaxed_lists import pipedream
from planner.schedules.relaxed import BATCHES, VERTICAL_SYNC, OverOneFOneB


class PipeDream(OverOneFOneB):
    name = "pipedream"
    summary = "PipeDream: 1F1B, an update per micro-batch, weight stashing"
    parameters = (BATCHES, VERTICAL_SYNC)
    updates_every_micro_batch = True
    update_rule = ("every micro-batch: W(t+1) = W(t) - lr grad f(W_1(t-K_1+1), ..., "
                   "W_S(t-K_S+1)), stage s K_s - 1 updates stale (S - 1 - s at 1F1B's warm-up); "
                   "vertical sync: K_1 - 1 on every stage")

    def with_updates(self, order: Schedule, micro_batches: int, batches: int,
                     vertical_sync: bool) -> Schedule:
        return pipedream(order, batches, vertical_sync, name=self.name)


PIPEDREAM = PipeDream()
