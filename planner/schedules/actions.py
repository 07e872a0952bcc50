"""Schedules as action lists: what each pipeline position runs, in order, as printable data.

An `Action` is one step of one position: compute on a model chunk for a micro-batch, or moving
data. Its text form is `<chunk><KIND><micro-batch>`, after PyTorch pipelining's:

    0F3      forward of micro-batch 3 on chunk 0
    1B2      full backward (input and weight gradients) of micro-batch 2 on chunk 1
    0I2 0W2  the split backward: I, the input gradient the previous chunk waits for, and W,
             the weight gradient, which may run later
    1RECV_F3 receive chunk 1's inputs of micro-batch 3    0SEND_F3  send chunk 0's outputs
    0RECV_B3 receive the gradients of chunk 0's outputs   1SEND_B3  send chunk 1's input grads
    0ALLREDUCE  sum chunk 0's accumulated gradients over its replicas

Schedules over several global batches (`planner.schedules.relaxed_lists`) add weight updates and versions:

    0UPDATE2     chunk 0 applies its update 2 (0-based): weight version 3 from version 2 and
                 the gradients of its weight-gradient actions since its previous update
    0ALLREDUCE2  the allreduce of update 2 (before it; AvgPipe's, of the updates, after it)
    0F9v1 0B9v1  the forward and backward of micro-batch 9 read weight version 1 (0: the
                 weights the run starts with); a version is not part of an action's identity

A `Schedule` holds one list per position and which position runs each chunk (`placement`); a
position is one device, or a stage's replicas, which all run the same list on their own rows.
Lists of compute actions come from `planner.schedules.by_name`; `planner.schedules.lowering` adds the data
movement; `planner.schedules.replay` checks a lowered schedule. Text round-trips: `Schedule.parse(str(s))`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

FORWARD = "F"
BACKWARD = "B"              # input and weight gradients together
BACKWARD_INPUT = "I"        # input gradient only
BACKWARD_WEIGHT = "W"       # weight gradient only
SEND_FORWARD = "SEND_F"
RECV_FORWARD = "RECV_F"
SEND_BACKWARD = "SEND_B"
RECV_BACKWARD = "RECV_B"
ALLREDUCE = "ALLREDUCE"
UPDATE = "UPDATE"           # apply a chunk's accumulated gradients (multi-batch schedules)

WEIGHT_READERS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)   # may carry a version
COMPUTE_KINDS = WEIGHT_READERS + (UPDATE,)    # what schedule generators write
COMMUNICATION_KINDS = (SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD, ALLREDUCE)
KINDS = COMPUTE_KINDS + COMMUNICATION_KINDS

_ACTION = re.compile(r"^(\d+)(" + "|".join(sorted(KINDS, key=len, reverse=True)) +
                     r")(\d*)(?:v(\d+))?$")


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the actions at fault."""


@dataclass(frozen=True, order=True)
class Action:
    chunk: int
    kind: str
    # The micro-batch; for UPDATE (and ALLREDUCE of a multi-batch schedule) the update's index;
    # None for the one ALLREDUCE of a single-batch schedule.
    micro_batch: Optional[int] = None
    version: Optional[int] = field(default=None, compare=False)   # weights an F/B/I/W reads

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; use one of {KINDS}")
        if self.micro_batch is None and self.kind != ALLREDUCE:
            what = "an update index" if self.kind == UPDATE else "a micro-batch"
            raise ScheduleError(f"{self.kind} actions need {what}")
        if self.version is not None and self.kind not in WEIGHT_READERS:
            raise ScheduleError(f"{self.kind} actions read no weight version; only "
                                f"{', '.join(WEIGHT_READERS)} do")

    def __str__(self) -> str:
        index = '' if self.micro_batch is None else self.micro_batch
        return f"{self.chunk}{self.kind}{index}{'' if self.version is None else f'v{self.version}'}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION.match(text.strip())
        if not m:
            raise ScheduleError(f"cannot read action {text!r}: write <chunk><kind><micro-batch>, "
                                f"e.g. 1F3, 0I2, 0W2, 1RECV_F3, 0ALLREDUCE, 0UPDATE1, 0F9v1 "
                                f"(kinds: {KINDS})")
        chunk, kind, mb, version = m.groups()
        return cls(int(chunk), kind, int(mb) if mb else None,
                   int(version) if version is not None else None)


@lru_cache(maxsize=1 << 16)
def shared_action(chunk: int, kind: str, micro_batch: Optional[int] = None) -> Action:
    """`Action(chunk, kind, micro_batch)`, one instance per value: lowering asks for the same
    actions again and again, and building one checks its fields. Values `Action` accepts are
    set without its frozen dataclass __init__ (which sets each field through
    object.__setattr__, then checks them): the same object, in less than half the time."""
    if kind in KINDS and (micro_batch is not None or kind == ALLREDUCE):   # __post_init__'s checks
        action = object.__new__(Action)
        fields = action.__dict__    # set item by item: faster than update(**fields)
        fields["chunk"], fields["kind"], fields["micro_batch"], fields["version"] = \
            chunk, kind, micro_batch, None
        return action
    return Action(chunk, kind, micro_batch)         # refused, as Action says


def micro_batch_actions(chunk: int, kind: str, count: int) -> List[Action]:
    """`[Action(chunk, kind, m) for m in range(count)]`, made as `shared_action` makes them
    (a schedule's generator takes its lists' actions from these), once per arguments
    (`micro_batch_action_run`): schedule choice builds several schedules of one plan."""
    return list(micro_batch_action_run(chunk, kind, count))


@lru_cache(maxsize=1 << 12)
def micro_batch_action_run(chunk: int, kind: str, count: int) -> Tuple[Action, ...]:
    """What `micro_batch_actions` returns, as a tuple, one per arguments."""
    Action(chunk, kind, 0)          # refused as Action refuses it
    out, new = [], object.__new__
    for m in range(count):
        action = new(Action)
        fields = action.__dict__    # set item by item: faster than update(**fields)
        fields["chunk"], fields["kind"], fields["micro_batch"], fields["version"] = \
            chunk, kind, m, None
        out.append(action)
    return tuple(out)


def actions(text: str) -> List[Action]:
    """`"0F0 0F1 0B0"` -> the actions, in order."""
    return [Action.parse(t) for t in text.split()]


@dataclass(frozen=True)
class Schedule:
    name: str                                  # "gpipe", "A", "B", ... (the plan's schedule)
    placement: Tuple[int, ...]                 # chunk -> position
    lists: Tuple[Tuple[Action, ...], ...]      # per position, in order
    batches: int = 1                           # consecutive global batches the lists run
    # AvgPipe: each ALLREDUCE follows its UPDATE and sums the pipelines' updates (elastic
    # averaging); otherwise it precedes its UPDATE and sums gradients.
    averaging: bool = False

    @property
    def num_positions(self) -> int:
        return len(self.lists)

    @property
    def num_chunks(self) -> int:
        return len(self.placement)

    @cached_property
    def micro_batches(self) -> int:
        """Micro-batches over all the batches the lists run."""
        return len({a.micro_batch for lst in self.lists for a in lst if a.kind == FORWARD})

    @cached_property
    def update_inputs(self) -> Dict[Tuple[int, int], Tuple[Action, ...]]:
        """(chunk, update) -> the weight-gradient actions (B, or W of a split backward) whose
        gradients it applies: the chunk's since its previous UPDATE, in list order."""
        out: Dict[Tuple[int, int], Tuple[Action, ...]] = {}
        for lst in self.lists:
            pending: Dict[int, List[Action]] = {}
            for a in lst:
                if a.kind in (BACKWARD, BACKWARD_WEIGHT):
                    pending.setdefault(a.chunk, []).append(a)
                elif a.kind == UPDATE:
                    out[(a.chunk, a.micro_batch)] = tuple(pending.pop(a.chunk, ()))
        return out

    @cached_property
    def has_updates(self) -> bool:
        """Whether any list applies weight updates (a multi-batch schedule)."""
        return UPDATE in {a.kind for lst in self.lists for a in lst}

    @cached_property
    def split_chunks(self) -> FrozenSet[int]:
        """Chunks whose backward is split into I and W (computed once: lowering asks often)."""
        return frozenset(a.chunk for lst in self.lists for a in lst if a.kind == BACKWARD_INPUT)

    @property
    def lowered(self) -> bool:
        return any(not a.is_compute for lst in self.lists for a in lst)

    def compute(self) -> "Schedule":
        """The same schedule without data movement (what `planner.schedules.lowering.lower` adds)."""
        return dataclasses.replace(
            self, lists=tuple(tuple(a for a in lst if a.is_compute) for lst in self.lists))

    def __str__(self) -> str:
        return "\n".join(f"{p}: " + " ".join(str(a) for a in lst)
                         for p, lst in enumerate(self.lists))

    @classmethod
    def parse(cls, text: str, name: str = "custom",
              placement: Optional[Sequence[int]] = None, batches: int = 1,
              averaging: bool = False) -> "Schedule":
        """Read `str(schedule)`: one line per position, `"<position>: <actions>"`. Without
        `placement`, each chunk runs where its actions are."""
        lists: Dict[int, List[Action]] = {}
        for n, line in enumerate(l for l in text.strip().splitlines() if l.strip()):
            head, sep, body = line.partition(":")
            if not sep or not head.strip().isdigit():
                raise ScheduleError(f"line {n + 1} {line!r}: write '<position>: <actions>'")
            lists[int(head)] = actions(body)
        if sorted(lists) != list(range(len(lists))):
            raise ScheduleError(f"positions {sorted(lists)} must be 0..{len(lists) - 1}")
        ordered = tuple(tuple(lists[p]) for p in range(len(lists)))
        if placement is None:
            where: Dict[int, int] = {}
            for p, lst in enumerate(ordered):
                for a in lst:
                    if a.is_compute and where.setdefault(a.chunk, p) != p:
                        raise ScheduleError(f"chunk {a.chunk} has compute actions on positions "
                                            f"{where[a.chunk]} and {p}; a chunk runs on one")
            if sorted(where) != list(range(len(where))):
                raise ScheduleError(f"chunks {sorted(where)} must be 0..{len(where) - 1}")
            placement = [where[c] for c in range(len(where))]
        return cls(name, tuple(placement), ordered, batches, averaging)


def one_chunk_per_position(lists: Sequence[Sequence[Action]], name: str) -> Schedule:
    """A schedule whose position s runs chunk s (every schedule without virtual stages)."""
    return Schedule(name, tuple(range(len(lists))), tuple(tuple(l) for l in lists))
