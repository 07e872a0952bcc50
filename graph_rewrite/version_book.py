"""Which copy holds which weight version of one stage while a relaxed run is built: the copies
to make, decided ahead from the run's events. Plain Python (no TensorFlow).

A stage computes with its Keras variables (the traced stage function reads them), so the
version a forward names must be in those variables when it runs; every other version a later
action still reads lives in a slot (a non-trainable copy, `graph_rewrite.weight_store`). The
events of one run, in the order the executor builds them, are:

* `Read(key)`: a forward (or a recomputing backward) computes with version `key`;
* `Write(old, new)`: an update changes the variables in place from version `old` to `new`.

`plan_moves` walks them once and says, before each event, which copies to make: save the
variables' version to a free slot when it is still needed later and no slot holds it, then load
the version the event reads. A slot is freed after the last event that needs its version.
At the end the variables hold `end_model` and the slots `end_slots` (the versions the next run
starts from, each in the slot it expects), reached by one parallel move (read every source,
then write).

A backward computes its weight gradient from the values its forward read, which its tape keeps
(TensorFlow's tensors are immutable, a later in-place update copies on write), so it reads no
version unless the stage is recomputed: weight stashing costs a slot only when a forward must
read a version that the variables no longer hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Union

MODEL = "model"
Place = Union[str, int]           # MODEL, or a slot's index


@dataclass(frozen=True)
class Read:
    key: Hashable


@dataclass(frozen=True)
class Write:
    old: Hashable
    new: Hashable


Event = Union[Read, Write]


@dataclass(frozen=True)
class Move:
    source: Place
    target: Place


@dataclass
class MovePlan:
    before: List[List[Move]]                           # per event, in order
    finish: List[Move] = field(default_factory=list)   # after the last event, in order
    permute: List[Move] = field(default_factory=list)  # then one parallel move
    slots: int = 0                                     # slots used (highest index + 1)


class VersionError(ValueError):
    """An event reads a version that no copy holds."""


def plan_moves(events: Sequence[Event], model: Hashable, slots: Dict[Hashable, int],
               end_model: Optional[Hashable], end_slots: Dict[Hashable, int]) -> MovePlan:
    """The copies that make every event find its version in the variables. `model` and
    `slots`: where the versions are at the start; `end_model` (None: whatever is left) and
    `end_slots`: where they must be at the end."""
    needed_at: Dict[Hashable, List[int]] = {}
    for i, e in enumerate(events):
        needed_at.setdefault(e.key if isinstance(e, Read) else e.old, []).append(i)
    finally_needed = set(end_slots) | ({end_model} if end_model is not None else set())

    def needed_after(key, i: int) -> bool:
        return key in finally_needed or any(j > i for j in needed_at.get(key, ()))

    held = dict(slots)                  # version -> slot
    top = max(list(held.values()) + list(end_slots.values()), default=-1) + 1

    def free_slot() -> int:
        used = set(held.values())
        return next(s for s in range(len(used) + 1) if s not in used)

    def save(moves: List[Move]) -> None:
        nonlocal top
        slot = free_slot()
        held[model] = slot
        top = max(top, slot + 1)
        moves.append(Move(MODEL, slot))

    plan = MovePlan(before=[])
    for i, e in enumerate(events):
        moves: List[Move] = []
        want = e.key if isinstance(e, Read) else e.old
        if model != want:
            if model is not None and model not in held and needed_after(model, i - 1):
                save(moves)
            if want not in held:
                raise VersionError(f"event {i} ({e}) reads version {want!r}, which no copy "
                                   f"holds (held: {sorted(map(str, held))}, variables: "
                                   f"{model!r})")
            moves.append(Move(held[want], MODEL))
            model = want
        if isinstance(e, Write):
            if e.old not in held and needed_after(e.old, i):
                save(moves)
            model = e.new
        for key in [k for k in held if not needed_after(k, i)]:
            del held[key]
        plan.before.append(moves)

    if end_model is not None and model != end_model:
        if model is not None and model not in held and model in finally_needed:
            save(plan.finish)
        plan.finish.append(Move(held[end_model], MODEL))
        model = end_model
    for key, target in sorted(end_slots.items(), key=lambda kv: kv[1]):
        source = MODEL if model == key else held.get(key)
        if source is None:
            raise VersionError(f"version {key!r} is needed after the run but no copy holds it")
        if source != target:
            plan.permute.append(Move(source, target))
    plan.slots = top
    return plan
