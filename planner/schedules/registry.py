"""The registry: every schedule a plan may name, by name (after PyTorch's `get_schedule_class`).

The CLI's choices and help, the Plan JSON, schedule choice, the simulator and the runtime all
ask here. Adding a schedule is one module (a `ScheduleSpec` subclass) and one `register` line
below. `build` checks the parameters every schedule shares, so each "X applies to Y" message
is written once and names the schedules that take X.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from planner.schedules.actions import Schedule, ScheduleError
from planner.schedules.relaxed_lists import DEFAULT_BATCHES, check_batches
from planner.schedules.avgpipe import AVGPIPE
from planner.schedules.base import ScheduleSpec, UnknownSchedule
from planner.schedules.gpipe import GPIPE
from planner.schedules.interleaved import INTERLEAVED
from planner.schedules.one_f_one_b import ONE_F_ONE_B, POLICY_A, POLICY_B
from planner.schedules.pipedream import PIPEDREAM
from planner.schedules.two_bw import TWO_BW
from planner.schedules.zb_h1 import ZERO_BUBBLE_H1

_SPECS: Dict[str, ScheduleSpec] = {}
# The keys of a plan's "schedule" object besides "name", in the order plans write them.
PARAMETERS = ("warmup", "virtual_stages", "batches", "advance", "vertical_sync")
DEFAULT = ONE_F_ONE_B       # what `dapple plan` plans under when no --schedule is given


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add `spec` under its name (a legacy spec: a name older plans carry, not offered)."""
    if not isinstance(spec, ScheduleSpec) or not spec.known:
        raise TypeError(f"register takes a ScheduleSpec instance, got {spec!r}")
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError(f"a schedule needs a name, got {spec.name!r}")
    if spec.name in _SPECS:
        raise ValueError(f"schedule {spec.name!r} is registered already")
    undeclared = sorted({p.name for p in spec.parameters} - set(PARAMETERS))
    if undeclared:
        raise ValueError(f"schedule {spec.name!r} takes {undeclared}, which plans cannot hold; "
                         f"plan parameters are {list(PARAMETERS)}")
    _SPECS[spec.name] = spec
    return spec


def specs(legacy: bool = False) -> Tuple[ScheduleSpec, ...]:
    """Registered specs in registration order (with the legacy names when `legacy`)."""
    return tuple(s for s in _SPECS.values() if legacy or not s.legacy)


def names(legacy: bool = False, **facts: Any) -> Tuple[str, ...]:
    """Registered names in order; `facts` keep those whose attributes have these values,
    e.g. `names(relaxed=True)`."""
    return tuple(s.name for s in specs(legacy)
                 if all(getattr(s, k) == v for k, v in facts.items()))


def find(name: Any) -> Optional[ScheduleSpec]:
    """The spec named `name` (a registered spec passes through), else None."""
    if isinstance(name, ScheduleSpec):
        name = name.name
    return _SPECS.get(name) if isinstance(name, str) else None


def get(name: Any) -> ScheduleSpec:
    """The spec named `name` (a spec passes through); ScheduleError naming the choices."""
    spec = find(name)
    if spec is None:
        shown = name.name if isinstance(name, ScheduleSpec) else name
        raise ScheduleError(f"unknown schedule {shown!r}; use one of {names()}")
    return spec


def coerce(value: Any) -> ScheduleSpec:
    """What `Plan.schedule` holds for `value`: the registered spec of that name, else an
    `UnknownSchedule` that keeps the name and fails validation."""
    if isinstance(value, ScheduleSpec):
        return value
    return find(value) or UnknownSchedule(value)


def takers(parameter: str) -> Tuple[str, ...]:
    """Names of the schedules that take `parameter` ("warmup" included)."""
    if parameter == "warmup":
        return names(legacy=True, takes_warmup=True)
    return tuple(s.name for s in specs() if s.takes(parameter))


def build(name: Any, num_positions: int, micro_batches: int,
          warmup: Optional[Sequence[int]] = None, virtual_stages: Optional[int] = None,
          batches: Optional[int] = None, advance: Optional[int] = None,
          vertical_sync: bool = False) -> Schedule:
    """The compute actions of schedule `name`, its shared parameters checked first."""
    spec = get(name)
    if spec.relaxed or (batches is not None and spec.compares_over_batches):
        k = DEFAULT_BATCHES if batches is None else batches
        check_batches(k)
        if advance is not None and not spec.takes("advance"):
            raise ScheduleError(f"advance (forwards ahead) applies to {_quoted('advance')}, "
                                f"not {spec.name!r}")
        if vertical_sync and not spec.takes("vertical_sync"):
            raise ScheduleError(f"vertical_sync applies to {_quoted('vertical_sync')}, not "
                                f"{spec.name!r}")
        return spec.run_actions(num_positions, micro_batches, warmup, k, advance, vertical_sync)
    if batches is not None:
        raise ScheduleError(
            f"schedule {spec.name!r} runs one global batch; batches applies to "
            f"{', '.join(takers('batches'))} (and "
            f"{', '.join(names(compares_over_batches=True))}, to compare them)")
    if warmup is not None and not spec.takes_warmup:
        raise ScheduleError(f"schedule {spec.name!r} fixes its own warm-up; 'warmup' applies to "
                            f"{takers('warmup')} only")
    if virtual_stages not in (None, 1) and not spec.takes("virtual_stages"):
        raise ScheduleError(f"schedule {spec.name!r} runs one chunk per position; virtual_stages "
                            f"= {virtual_stages} needs schedule {_quoted('virtual_stages')}")
    return spec.actions(num_positions, micro_batches, warmup, virtual_stages)


def _quoted(parameter: str) -> str:
    return " or ".join(repr(n) for n in takers(parameter))


RELAXED_PARAMETERS = ("batches", "advance", "vertical_sync")


def plan_problem(plan) -> Optional[str]:
    """What is wrong with a `planner.formats.plan.Plan`'s schedule and its parameters, or None."""
    spec = plan.schedule
    if not spec.known:
        return (f"schedule {spec.name!r} is not one of {names()} (or the early-backward "
                f"policies {', '.join(repr(n) for n in names(legacy=True) if find(n).legacy)} "
                f"of older plans)")
    stray = [k for k in RELAXED_PARAMETERS
             if getattr(plan, k) is not None and not spec.takes(k)]
    if stray:
        first, *others = RELAXED_PARAMETERS
        applies = [f"{first} applies to {', '.join(takers(first))}"] + \
            [f"{k} to {', '.join(takers(k))}" for k in others]
        return f"schedule {spec.name!r} takes no {', '.join(stray)}: {', '.join(applies)}"
    try:
        for p in spec.parameters:
            if p.name in RELAXED_PARAMETERS and getattr(plan, p.name) is not None:
                p.check(getattr(plan, p.name))
    except ScheduleError as e:
        return str(e)
    if plan.warmup is not None and not spec.takes_warmup:
        return (f"schedule {spec.name!r} fixes its own warm-up; remove 'warmup' (it applies to "
                f"{', '.join(takers('warmup'))})")
    v = plan.virtual_stages
    if not spec.takes("virtual_stages") and v not in (None, 1):
        return (f"virtual_stages = {v} needs schedule {_quoted('virtual_stages')}; "
                f"{spec.name!r} runs one chunk per device group")
    return spec.plan_problem(plan)


register(GPIPE)
register(ONE_F_ONE_B)
register(POLICY_A)
register(POLICY_B)
register(INTERLEAVED)
register(ZERO_BUBBLE_H1)
register(PIPEDREAM)
register(TWO_BW)
register(AVGPIPE)
