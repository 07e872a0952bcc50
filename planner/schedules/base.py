"""What every schedule spec states: `ScheduleSpec`, the base of one class per schedule.

A spec is stateless: the values of its parameters live on the plan (`Plan.warmup`,
`virtual_stages`, `batches`, `advance`, `vertical_sync`, the JSON's "schedule" object); the
spec says which of them it takes, their defaults and how they are checked, how it builds its
action lists, and what the planner, the simulator and the runtime need to know of it (the
attributes below). Code outside `planner.schedules` asks a spec these questions instead of
comparing names. Its memory follows from its lists: the activations they hold at their peak
(`planner.schedules.memory`) and the weight versions its updates keep (`planner.schedules.weight_versions`).
A spec compares equal to its name, so `plan.schedule == "1f1b"` reads as before; `str(spec)`
and formatting give the name.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from planner.schedules.actions import Schedule, ScheduleError

# The runtimes of `dapple` (`dapple.runtime`): one process, horovodrun, TensorFlow's cluster.
RUNTIMES = ("local", "horovod", "tensorflow")
SYNCHRONOUS_UPDATE = "every global batch: W(t+1) = W(t) - lr grad f(W(t))"


class Parameter:
    """One parameter a schedule takes (a plan field of that name): its default when the plan
    leaves it out, and `check`, raising `ScheduleError` on a bad value."""

    def __init__(self, name: str, default: Any, check: Callable[[Any], None], help: str):
        self.name, self.default, self.check, self.help = name, default, check, help

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, default={self.default!r})"


class ScheduleSpec:
    """A schedule: its name, parameters, action lists and the facts the rest of dapple asks."""

    name: str = ""
    summary: str = ""                    # one line, for the CLI's help
    parameters: Tuple[Parameter, ...] = ()   # besides `warmup` (see `takes_warmup`)
    known = True                         # False only for `UnknownSchedule`
    legacy = False                       # an older plans' name (early backward's "A", "B")
    takes_warmup = False                 # a plan's `warmup` (K_i per stage) may set its depths
    planner_warmup = False               # the planner sets K_i (policy A/B by ACR, capped by D)
    early_backward = False               # DAPPLE's early backward (1F1B) under some policy
    formula = False                      # eq. 1-3 describe it (else its estimate is simulated)
    split_backward = False               # backwards split into I and W
    rechunks = False                     # re-cuts the layers into `virtual_stages` chunks/group
    relaxed = False                      # stale or averaged weights, opt-in; runs `batches`
    compares_over_batches = False        # also runs k batches with a flush each, to compare
    averaging = False                    # one pipeline per stage replica, averaged (AvgPipe)
    updates_every_micro_batch = False    # an update per micro-batch (PipeDream's minibatch)
    tie_rank: Optional[int] = None       # `auto`'s order among equal iterations (None: never)
    update_rule = SYNCHRONOUS_UPDATE     # as reports state it
    runtimes: Tuple[str, ...] = RUNTIMES

    # ---- what the spec is -----------------------------------------------------------------
    @property
    def canonical(self) -> "ScheduleSpec":
        """The spec a finished plan names (a legacy name's modern one; else itself)."""
        return self

    def takes(self, parameter: str) -> bool:
        return any(p.name == parameter for p in self.parameters)

    def parameter(self, name: str) -> Parameter:
        for p in self.parameters:
            if p.name == name:
                return p
        raise ScheduleError(f"schedule {self.name!r} takes no parameter {name!r}; it takes "
                            f"{[p.name for p in self.parameters] or 'none'}")

    # ---- warm-up and actions --------------------------------------------------------------
    def default_warmup(self, num_stages: int, micro_batches: int) -> Optional[List[int]]:
        """K_i when a plan gives none, or None when the schedule fixes its own (read it from
        the actions: `planner.schedules.by_name.first_backward_depths`)."""
        return None

    def actions(self, num_positions: int, micro_batches: int,
                warmup: Optional[Sequence[int]] = None,
                virtual_stages: Optional[int] = None) -> Schedule:
        """The compute actions of one global batch (parameters checked by the registry)."""
        raise ScheduleError(f"schedule {self.name!r} runs over several global batches; build "
                            f"it with batches")

    def run_actions(self, num_positions: int, micro_batches: int,
                    warmup: Optional[Sequence[int]], batches: int, advance: Optional[int],
                    vertical_sync: bool) -> Schedule:
        """The compute actions and updates of `batches` consecutive global batches."""
        raise ScheduleError(f"schedule {self.name!r} runs one global batch")

    def placement(self, num_positions: int, virtual_stages: Optional[int]) -> Sequence[int]:
        """Position of every chunk (one chunk per position unless the spec re-chunks)."""
        return range(num_positions)

    # ---- a plan under this schedule -------------------------------------------------------
    def plan_problem(self, plan) -> Optional[str]:
        """What is wrong with `plan` under this schedule beyond its parameters' own checks."""
        return None

    def pipelines(self, plan) -> int:
        """Independent pipelines the plan's devices run (AvgPipe: one per stage replica)."""
        return 1

    # ---- a spec reads as its name ---------------------------------------------------------
    def __eq__(self, other) -> bool:
        if isinstance(other, ScheduleSpec):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return str(self.name)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.name), format_spec)

    def __repr__(self) -> str:
        return f"<schedule {self.name!r}>"

    def __copy__(self) -> "ScheduleSpec":
        return self

    def __deepcopy__(self, memo) -> "ScheduleSpec":
        return self


class UnknownSchedule(ScheduleSpec):
    """A name this dapple does not know (a plan from a newer one, a typo): it loads, keeps its
    name through JSON, and fails validation and the runtime check with a clear message."""

    known = False
    runtimes: Tuple[str, ...] = ()

    def __init__(self, name: Any):
        self.name = name
