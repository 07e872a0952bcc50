"""AvgPipe (Chen et al., "Elastic Averaging for Efficient Pipelined DNN Training", PPoPP'23):
N pipelines trained by elastic averaging, each running advance forward propagation.

* Pipelines: a plan's stage replicas become N independent pipelines (pipeline i runs on
  replica i of every stage), each with its own weights w_i and its own global batch a step,
  so a step consumes N global batches. Every stage needs the same number of replicas. (The
  paper runs its N pipelines on the same GPUs; dapple gives each pipeline its own devices.)
* Update (§3.2 states it in prose): with Delta_i the user optimizer's update from pipeline i's
  gradient and a = 1/N (the paper's choice),
      w_i <- (1 - a) w_i + a z + Delta_i,        z <- z + (1/N) sum_i Delta_i.
  This is the reading under which the paper's invariant holds exactly: if z is the mean of the
  w_i before a step, it is after (mean of the new w_i = (1 - a) z + a z + mean Delta = new z).
  In the lists each batch ends with `UPDATE t` (the rule, with z of the step before) and then
  `ALLREDUCE t`, which sums the Delta_i over the pipelines for z (`Schedule.averaging`).
* Each pipeline is synchronous: it finishes a batch's backwards, then updates (Step 1, then
  Step 2; Algorithm 1 runs batch by batch), so batch t reads version t and the lists flush
  between batches (`planner.schedules.relaxed_lists.flushed`).
* Advance forward propagation (§4.2, Algorithm 1): the first GPU runs `advance` forwards more
  than 1F1B before its first backward (Algorithm 1 starts at advance_num = K - 1, "equivalent to
  1F1B", and raises it while training gets faster and memory allows). The paper gives the
  first GPU's count only; here the stages after it run ahead by a share of it falling linearly
  to none on the last stage, which has nothing downstream to feed (as GPU 2 in Fig. 7(c)
  alternates F and B while GPU 1 runs ahead, and "upstream GPUs" give the memory):
      K_s = min(S - s + floor(advance (S - 1 - s) / (S - 1)), M),    K_{S-1} = 1.
  Each boundary then gets its share of the extra forwards in flight, to hide its transfers.
  advance = 0 is 1F1B, advance = S - 1 is DAPPLE's policy B (K_s = 2(S - s) - 1), and a large
  one runs every forward of stages 0..S-2 first (AFAB, the other end the paper names). The
  planner starts at the warm-up it chose for early backward (advance = K_0 - S) and raises it
  one at a time, as Algorithm 1 does, while the simulated step gets faster and fits in memory,
  at most ADVANCE_STEPS times (each step is a simulation; the runtime, which measures, may go
  on): `planner.search.schedule_choice`.
* Memory: each device keeps w_i and its stage's share of z, two weight copies
  (`planner.schedules.weight_versions`).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from planner.schedules.actions import ScheduleError

ADVANCE_STEPS = 8          # the planner's bound on Algorithm 1's steps


def advance_depths(num_stages: int, micro_batches: int, advance: int) -> List[int]:
    """Forwards before the first backward, per stage, under advance forward propagation."""
    if not isinstance(advance, int) or isinstance(advance, bool) or advance < 0:
        raise ScheduleError(f"avgpipe: advance (forwards ahead of 1F1B's warm-up) must be a "
                            f"non-negative integer, got {advance!r}")
    S, M = num_stages, micro_batches
    return [min(S - s + advance * (S - 1 - s) // (S - 1), M) for s in range(S - 1)] + [1]


def pipelines(replicas: Sequence[int]) -> int:
    """N, the pipelines of a plan whose stages have `replicas` devices each."""
    if len(set(replicas)) != 1:
        raise ScheduleError(f"avgpipe runs one pipeline per stage replica, so every stage needs "
                            f"the same number of devices; this plan has "
                            f"{':'.join(map(str, replicas))}")
    return replicas[0]


def tune_advance(step: Callable[[int], Tuple[float, bool]], micro_batches: int,
                 max_steps: Optional[int] = None, start: int = 0) -> int:
    """Algorithm 1's lines 9-10: from `start` (0: 1F1B), raise advance by one while
    `step(advance)`, (time of a step, fits in memory), is faster than at the current advance
    and fits; at most `max_steps` times (each step is a simulation to the planner)."""
    advance, best = start, step(start)[0]
    limit = micro_batches if max_steps is None else min(micro_batches, start + max_steps)
    while advance < limit:
        time, fits = step(advance + 1)
        if not fits or time >= best * (1 - 1e-9):
            break
        advance, best = advance + 1, time
    return advance


def micro_batch_devices(plan) -> List[List[int]]:
    """Per stage of a `planner.formats.plan.Plan`, the devices sharing one micro-batch: its replicas,
    or under AvgPipe one device (pipeline 0's: every pipeline runs the same lists)."""
    return [list(st.devices[:1] if plan.schedule.averaging else st.devices)
            for st in plan.stages]
