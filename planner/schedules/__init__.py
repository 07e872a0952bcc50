"""Schedules as typed specs, one module per schedule, in one registry.

* `base`: `ScheduleSpec`, what every schedule states (name, parameters with defaults and
  checks, action lists, warm-up, the facts the planner, simulator and runtime ask);
* `forward_backward`: the lists GPipe and early backward share; `relaxed`: what the relaxed
  schedules share;
* one module per schedule: `gpipe`, `one_f_one_b` (with the legacy names "A" and "B"),
  `interleaved`, `zb_h1`, `pipedream`, `two_bw`, `avgpipe`;
* `registry`: `get(name)`, `names()`, `register(spec)`, `build(...)`.

`Plan.schedule` holds a spec; a name given where a spec is expected is looked up here.
"""
from planner.schedules.base import ScheduleSpec, UnknownSchedule  # noqa: F401
from planner.schedules.registry import (DEFAULT, PARAMETERS, build, coerce, find,  # noqa: F401
                                        get, names, plan_problem, register, specs, takers)
