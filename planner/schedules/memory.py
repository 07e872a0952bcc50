"""What a schedule keeps in memory, from its action lists alone.

Two things a chunk keeps for a micro-batch between its actions:

* **held** activations: everything the backward reads, from the forward until the action that
  computes the input gradient (B, or I of a split backward);
* **awaiting W**: after I, only what the weight gradient W still reads (each layer's inputs and
  the gradients of its outputs), until W.

A position's counts change only with its own actions, in the order of its list, so the peaks
need no timing: they are maxima over the prefixes of each list (the simulator's timed counts,
`planner.estimate.simulator`, reach the same peaks). Held micro-batches of 1F1B peak at its warm-up depth
K_i; ZB-H1 holds the same and has up to s more awaiting W on stage s (`planner.schedules.zb_h1`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from planner.schedules.actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Schedule

HELD_UNTIL = (BACKWARD, BACKWARD_INPUT)       # the action that frees the full activations


def _peaks(schedule: Schedule, held_weight: Sequence[float],
           awaiting_weight: Sequence[float]) -> List[float]:
    """Per position: max over its list's prefixes of sum(held * held_weight[chunk] +
    awaiting * awaiting_weight[chunk])."""
    peaks = []
    for lst in schedule.lists:
        now = peak = 0.0
        for a in lst:
            if a.kind == FORWARD:
                now += held_weight[a.chunk]
            elif a.kind in HELD_UNTIL:
                now -= held_weight[a.chunk]
                if a.kind == BACKWARD_INPUT:
                    now += awaiting_weight[a.chunk]
            elif a.kind == BACKWARD_WEIGHT:
                now -= awaiting_weight[a.chunk]
            if now > peak:                  # max(peak, now)
                peak = now
        peaks.append(peak)
    return peaks


def peak_counts(schedule: Schedule) -> Tuple[List[int], List[int]]:
    """(peak held micro-batches, peak micro-batches awaiting W) per position; a position with
    several chunks counts each chunk's micro-batches."""
    ones, zeros = [1.0] * schedule.num_chunks, [0.0] * schedule.num_chunks
    held = [int(round(p)) for p in _peaks(schedule, ones, zeros)]
    awaiting = [int(round(p)) for p in _peaks(schedule, zeros, ones)]
    return held, awaiting


def peak_bytes(schedule: Schedule, held_bytes: Sequence[float],
               awaiting_weight_bytes: Sequence[float]) -> List[float]:
    """Peak bytes per position: `held_bytes[c]` per micro-batch whose activations chunk c
    holds, `awaiting_weight_bytes[c]` per micro-batch waiting for chunk c's W."""
    for name, values in (("held_bytes", held_bytes),
                         ("awaiting_weight_bytes", awaiting_weight_bytes)):
        if len(values) != schedule.num_chunks:
            raise ValueError(f"{name} has {len(values)} entries for {schedule.num_chunks} "
                             f"chunks")
    return _peaks(schedule, held_bytes, awaiting_weight_bytes)
