"""Interleaved 1F1B (Megatron PTD-P, Narayanan's dissertation §4.2.2): each of S positions holds
v model chunks, so a micro-batch crosses the pipeline v times on S * v chunks, and the bubble
shrinks from (S - 1)(F + B) to (S - 1)(F + B) / v at v times the boundary transfers.

Chunk c (of S * v) runs on position c % S: position s holds chunks s, s + S, s + 2S, ...

Order on every position, after Megatron's `forward_backward_pipelining_with_interleaving`:

* micro-batches go in groups; within a group, the position runs its first chunk's forwards for
  every micro-batch of the group, then its second chunk's, ...; backwards take the same
  micro-batch order with the chunks reversed (the last chunk first);
* position s first runs W_s = min(M v, 2(S - s - 1) + (v - 1) g) forwards (g: micro-batches in
  the first group), then one forward and one backward in turn, then the remaining backwards.

Groups: Megatron takes groups of S micro-batches and requires M to be a multiple of S. Here M
is cut into max(1, M // S) groups as even as possible, so each has at least S micro-batches
(all M in one group when M < S): with M a multiple of S this is Megatron's order exactly, and
every other M still replays without deadlock (a last group smaller than S, which is what
Megatron's grouping would leave, deadlocks on some shapes; tests check all S <= 6, M <= 16,
v <= 3). With v = 1 the order is DAPPLE's policy B (K_s = 2(S - s) - 1).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from planner.schedules.actions import (BACKWARD, FORWARD, Action, Schedule, ScheduleError,
                                       shared_action)
from planner.schedules.base import Parameter, ScheduleSpec


def chunk_placement(num_positions: int, virtual_stages: int) -> Tuple[int, ...]:
    """Position of every chunk: chunk c runs on position c % S."""
    return tuple(c % num_positions for c in range(num_positions * virtual_stages))


def micro_batch_groups(num_positions: int, micro_batches: int) -> List[range]:
    """max(1, M // S) consecutive groups, sizes differing by at most one, the larger first."""
    count = max(1, micro_batches // num_positions)
    base, extra = divmod(micro_batches, count)
    groups, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def warmup_forwards(position: int, num_positions: int, virtual_stages: int,
                    micro_batches: int) -> int:
    """W_s: forwards before the first backward's turn (Megatron's count, capped at M v).
    Later positions need fewer: their first backward's inputs arrive sooner."""
    first_group = len(micro_batch_groups(num_positions, micro_batches)[0])
    return min(micro_batches * virtual_stages,
               2 * (num_positions - position - 1) + (virtual_stages - 1) * first_group)


def position_actions(position: int, num_positions: int, micro_batches: int,
                     virtual_stages: int) -> List[Action]:
    """One position's compute actions in the interleaved order."""
    S, v = num_positions, virtual_stages
    order = [(m, local) for group in micro_batch_groups(S, micro_batches)
             for local in range(v) for m in group]
    forwards = [shared_action(local * S + position, FORWARD, m) for m, local in order]
    backwards = [shared_action((v - 1 - local) * S + position, BACKWARD, m) for m, local in order]
    W = warmup_forwards(position, S, v, micro_batches)
    out = forwards[:W]
    for f, b in zip(forwards[W:], backwards):
        out += [f, b]
    return out + backwards[len(forwards) - W:]


def interleaved_schedule(num_positions: int, micro_batches: int,
                         virtual_stages: int, name: Optional[str] = None) -> Schedule:
    """Interleaved 1F1B on `num_positions` positions holding `virtual_stages` chunks each
    (named as the spec below unless `name` says otherwise)."""
    for what, value in (("positions", num_positions), ("micro-batches", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"interleaved schedule: {what} must be a positive integer, "
                                f"got {value!r}")
    lists = tuple(tuple(position_actions(s, num_positions, micro_batches, virtual_stages))
                  for s in range(num_positions))
    return Schedule(name or Interleaved.name, chunk_placement(num_positions, virtual_stages), lists)


def _check_virtual_stages(v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ScheduleError(f"virtual_stages must be a positive integer, got {v!r}")


class Interleaved(ScheduleSpec):
    name = "interleaved"
    summary = "Megatron's interleaved 1F1B over virtual_stages chunks per device group"
    parameters = (Parameter("virtual_stages", 2, _check_virtual_stages,
                            "chunks per device group (default 2)"),)
    rechunks = True
    tie_rank = 3

    def actions(self, num_positions: int, micro_batches: int,
                warmup: Optional[Sequence[int]] = None,
                virtual_stages: Optional[int] = None) -> Schedule:
        if virtual_stages is None:
            raise ScheduleError(f"schedule {self.name!r} needs virtual_stages (chunks per "
                                f"position), e.g. 2")
        return interleaved_schedule(num_positions, micro_batches, virtual_stages, self.name)

    def placement(self, num_positions: int, virtual_stages: Optional[int]) -> Sequence[int]:
        return chunk_placement(num_positions, virtual_stages)

    def plan_problem(self, plan) -> Optional[str]:
        v = plan.virtual_stages
        if not isinstance(v, int) or v < 1:
            return (f"schedule {self.name!r} needs virtual_stages, a positive integer (chunks "
                    f"per device group), e.g. {{\"name\": \"{self.name}\", \"virtual_stages\": "
                    f"2}}; got {v!r}")
        if plan.num_stages % v:
            return (f"an interleaved plan with virtual_stages = {v} lists S x {v} chunks as "
                    f"its stages; this one has {plan.num_stages}, not a multiple of {v}")
        return None


INTERLEAVED = Interleaved()
