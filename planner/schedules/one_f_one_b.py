"""DAPPLE's early backward, 1F1B (§III-B, §V-C): stage i runs K_i forwards, then strictly
alternates one backward and one forward, then runs the remaining backwards. K_i = min(S - i, M)
(policy A) unless the plan's `warmup` says otherwise; the planner writes its choice there
(policy A's or B's depths by the activation communication ratio, capped by memory).

Older plans name the policy instead: "A" and "B" load and run as 1F1B with that policy's
depths, and a finished plan names "1f1b" (`canonical`). With `batches`, 1F1B runs k global
batches with a flush and an update after each: what the relaxed schedules are compared with.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from planner.schedules.actions import Schedule
from planner.schedules.relaxed_lists import flushed
from planner.schedules.forward_backward import (ForwardBackwardSpec, forward_backward_schedule,
                                                given_or_default, policy_a_depths,
                                                policy_b_depths)

POLICIES = {"A": policy_a_depths, "B": policy_b_depths}


class OneFOneB(ForwardBackwardSpec):
    summary = "DAPPLE's early backward: K_i forwards, then one backward, one forward"
    planner_warmup = True
    early_backward = True
    compares_over_batches = True
    tie_rank = 0        # equal iterations: the schedule the runtime was built around

    def __init__(self, name: str = "1f1b", policy: str = "A"):
        self.name, self.policy = name, policy
        self.legacy = name in POLICIES
        if self.legacy:          # plans name them; the planner offers and compares 1f1b only
            self.compares_over_batches, self.tie_rank = False, None

    @property
    def canonical(self) -> "OneFOneB":
        return ONE_F_ONE_B

    def default_warmup(self, num_stages: int, micro_batches: int) -> List[int]:
        return POLICIES[self.policy](num_stages, micro_batches)

    def run_actions(self, num_positions: int, micro_batches: int,
                    warmup: Optional[Sequence[int]], batches: int, advance: Optional[int],
                    vertical_sync: bool) -> Schedule:
        ks = given_or_default(self, warmup, num_positions, micro_batches)
        return flushed(forward_backward_schedule(num_positions, micro_batches, ks, self.name),
                       batches)


ONE_F_ONE_B = OneFOneB()
POLICY_A = OneFOneB("A", "A")       # the names of older plans
POLICY_B = OneFOneB("B", "B")
