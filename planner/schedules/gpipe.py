"""GPipe: every forward of a global batch, then every backward (K_i = M)."""
from __future__ import annotations

from typing import List

from planner.schedules.forward_backward import ForwardBackwardSpec


class GPipe(ForwardBackwardSpec):
    name = "gpipe"
    summary = "all forwards, then all backwards (K_i = M)"
    tie_rank = 1        # equal iterations: after 1f1b, which holds less

    def default_warmup(self, num_stages: int, micro_batches: int) -> List[int]:
        return [micro_batches] * num_stages


GPIPE = GPipe()
