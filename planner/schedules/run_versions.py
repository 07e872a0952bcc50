"""Weight versions when runs follow one another: what a run's forwards read, counted from its start.

A relaxed schedule's lists (`planner.schedules.relaxed_lists`) describe one run of k global batches from a
fresh start: version 0 is the weights the run starts with, and forwards that would read a
version from before the run read version 0 instead (2BW's batch 0 reads max(0 - 1, 0) = 0,
PipeDream's first K_s - 1 micro-batches on stage s read 0). Training is many runs, and the
update rule must not depend on where one run ends and the next starts (a run boundary is a
flush, nothing more; Keras's `steps_per_execution` only sets how often it comes). So a run
that continues earlier ones reads, where its lists say 0, the versions the rule names: those
before its start.

`relative_versions` finds them from the lists themselves: it builds the same schedule over
`prefix` more batches in front, where the run's forwards sit past every clamp, and subtracts
the updates the prefix made. The result, per (chunk, micro-batch of the run), is a version
relative to the run's start, negative for the versions the previous runs made: -1 is the one
before the weights the run starts with. `carried` is how many of those a runtime keeps between
runs (2BW 1, PipeDream K_s - 1, synchronous schedules and AvgPipe 0). On the very first run
there is nothing before version 0, so every negative version is version 0 (the lists' clamp).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from planner.schedules.actions import BACKWARD, BACKWARD_WEIGHT, FORWARD, UPDATE, Schedule, ScheduleError

PREFIX = 2          # batches in front of the run: past every clamp while warm-ups are <= M


def relative_versions(build: Callable[[int], Schedule], batches: int,
                      prefix: int = PREFIX) -> Dict[Tuple[int, int], int]:
    """(chunk, micro-batch) -> the version the run's forward of that micro-batch reads,
    relative to the run's start, for a run of `batches` global batches that continues earlier
    runs. `build(k)` makes the schedule's compute lists over k batches."""
    run, longer = build(batches), build(prefix + batches)
    per_batch = run.micro_batches // batches
    shift = prefix * per_batch
    made = _updates_before(longer, shift)
    out: Dict[Tuple[int, int], int] = {}
    for lst in longer.lists:
        for a in lst:
            if a.kind == FORWARD and a.micro_batch >= shift:
                out[(a.chunk, a.micro_batch - shift)] = (a.version or 0) - made[a.chunk]
    for lst in run.lists:
        for a in lst:
            if a.kind != FORWARD:
                continue
            rel = out.get((a.chunk, a.micro_batch))
            if rel is None or (rel >= 0 and rel != (a.version or 0)) or (
                    rel < 0 and (a.version or 0) != 0):
                raise ScheduleError(
                    f"{run.name}: {a} reads version {a.version or 0} in a run of {batches} "
                    f"batches but {rel} (relative to the run's start) in a longer one; the "
                    f"schedule's versions are not the same rule in every run")
    return out


def carried(versions: Dict[Tuple[int, int], int], chunks: int) -> List[int]:
    """Per chunk, the versions from before a run's start that it reads: what the runtime keeps
    from one run to the next."""
    out = [0] * chunks
    for (c, _), v in versions.items():
        out[c] = max(out[c], -v)
    return out


def _updates_before(schedule: Schedule, shift: int) -> Dict[int, int]:
    """Per chunk, its updates that apply only gradients of micro-batches below `shift`."""
    made = {c: 0 for c in range(schedule.num_chunks)}
    for (c, _), grads in schedule.update_inputs.items():
        if grads and all(g.micro_batch < shift for g in grads
                         if g.kind in (BACKWARD, BACKWARD_WEIGHT)):
            made[c] += 1
    return made


def update_count(schedule: Schedule) -> Dict[int, int]:
    """Per chunk, the updates one run of `schedule` applies."""
    out = {c: 0 for c in range(schedule.num_chunks)}
    for lst in schedule.lists:
        for a in lst:
            if a.kind == UPDATE:
                out[a.chunk] += 1
    return out
