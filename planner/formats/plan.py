"""The Plan: the one contract between planning and running.

A Plan is plain data. The planner writes it, a person may edit it, the simulator and the
reports read it, and `graph_rewrite` runs it. It round-trips through JSON
(`Plan.to_json` / `Plan.from_json`); the file format is documented in docs/formats.md
("Plan JSON") and carries a `version` so that old files are refused clearly, not misread.

Conventions (the same everywhere in dapple):

* `layers` of a stage is `[first, last]`, 0-based and inclusive, as positions in the
  profile's / model's topological layer order (`graph_rewrite.model_graph.layer_order`
  and the profiler write the same order).
* `devices` are device ids of the topology, ordered host by host (the order `horovodrun -H
  h1:8,h2:8` numbers ranks). A stage's replica count is `len(devices)`.
* `schedule` is the schedule's spec (`planner.schedules`; a name given is looked up there, and
  JSON holds the name): "gpipe" (K_i = M), "1f1b"
  (DAPPLE's early backward; K_i = min(S-i, M) unless `warmup` says otherwise), "interleaved"
  (Megatron's, `virtual_stages` chunks per device) or "zb-h1" (zero bubble, split backward).
  The early-backward policies "A" (K_i = min(S-i, M)) and "B" (K_i = min(2(S-i)-1, M)) are
  also accepted, as older plans name them. `warmup` (K_i per stage, gpipe and early backward
  only) may be given explicitly, e.g. when a memory limit D caps it; when absent it is derived
  from the name (`planner.schedules.by_name.warmup_depths`). In JSON the name and its parameters are one
  object: `"schedule": {"name": "1f1b", "warmup": [2, 1]}`,
  `{"name": "interleaved", "virtual_stages": 2}` (version 2; a version 1 file, with
  `"schedule": "A"` and `warmup` beside it, still loads). The relaxed schedules "pipedream",
  "2bw" and "avgpipe" (`planner.schedules.relaxed_lists`) take `batches` (global batches one run covers),
  "avgpipe" `advance` (forwards ahead of 1F1B's warm-up), "pipedream" `vertical_sync`:
  `{"name": "2bw", "batches": 4, "warmup": [2, 1]}`.
* Interleaved plans list their chunks as `stages`, in pipeline order: with S devices groups
  and v virtual stages there are S v of them, and chunk c runs on the devices of chunk c % S
  (its `devices` repeat that chunk's; a device group holds chunks c, c + S, c + 2S, ...).
* A micro-batch is global_batch_size / micro_batches samples (an integer); a stage with R
  replicas splits it as evenly as possible (`Plan.slice_sizes`), each replica taking at least
  one sample. Slices may differ by one sample (a 15:1 plan of a 2048 batch).
* Fields the planner derives (`estimate`, `warmup`) may be left out of a hand-written file.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from planner.formats import slicing
from planner.formats.files import write_text_atomically
from planner import schedules
from planner.schedules.by_name import check_warmup, first_backward_depths, plan_schedule
from planner.schedules import ScheduleSpec

PLAN_VERSION = 2


class PlanError(ValueError):
    """A plan that is malformed or inconsistent; the message says what and how to fix it."""


@dataclass
class StageEstimate:
    forward_ms: float
    backward_ms: float
    allreduce_ms: float
    memory_bytes: float


@dataclass
class Estimate:
    latency_ms: float
    warmup_ms: float
    steady_ms: float
    ending_ms: float
    pivot_stage: int
    stages: List[StageEstimate] = field(default_factory=list)
    # "formula": DAPPLE's eq. 1-3 with the round trip (gpipe, early backward); "simulated": the
    # simulator's iteration (interleaved, zb-h1), phases read from the first device group.
    method: str = "formula"

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Estimate":
        d = dict(d)
        stages = [StageEstimate(**s) for s in d.pop("stages", [])]
        return cls(stages=stages, **d)


@dataclass
class Stage:
    layers: List[int]                       # [first, last], inclusive
    devices: List[int]
    layer_names: List[str] = field(default_factory=list)

    @property
    def first(self) -> int:
        return self.layers[0]

    @property
    def last(self) -> int:
        return self.layers[1]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0] + 1

    @property
    def replicas(self) -> int:
        return len(self.devices)


@dataclass
class Plan:
    stages: List[Stage]
    micro_batches: int
    global_batch_size: Optional[int] = None
    schedule: ScheduleSpec = schedules.DEFAULT     # a name given here is looked up
    warmup: Optional[List[int]] = None
    recompute: bool = False
    estimate: Optional[Estimate] = None
    topology: Optional[Dict[str, Any]] = None   # description of the topology it was made for
    profile: Optional[Dict[str, Any]] = None    # {"name": ..., "hash": ...}
    version: int = PLAN_VERSION
    virtual_stages: Optional[int] = None        # "interleaved": chunks per device group
    batches: Optional[int] = None               # relaxed schedules: global batches in one run
    advance: Optional[int] = None               # "avgpipe": forwards ahead of 1F1B's warm-up
    vertical_sync: Optional[bool] = None        # "pipedream": every stage reads stage 0's version
    transfers: str = "async"    # how its estimate moves boundary tensors: one of TRANSFERS

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "schedule":       # a name (as older code and hand-made plans give) -> its spec
            value = schedules.coerce(value)
        object.__setattr__(self, key, value)

    # ---- derived views -------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Entries of `stages`: the pipeline's stages, or an interleaved plan's chunks."""
        return len(self.stages)

    @property
    def num_positions(self) -> int:
        """Device groups along the pipeline: stages, or num_stages / virtual_stages."""
        v = self.virtual_stages if self.schedule.rechunks and self.virtual_stages else 1
        return max(1, self.num_stages // v)

    @property
    def num_devices(self) -> int:
        return sum(s.replicas for s in self.stages[:self.num_positions])

    @property
    def num_layers(self) -> int:
        return self.stages[-1].last + 1

    def shape(self) -> str:
        """The paper's notation: 'DP', 'straight', or replica counts like '8:8' (of the device
        groups: an interleaved plan's chunks repeat them)."""
        groups = self.stages[:self.num_positions]
        if len(groups) == 1:
            return "DP" if groups[0].replicas > 1 else "single"
        if all(s.replicas == 1 for s in groups):
            return "straight"
        return ":".join(str(s.replicas) for s in groups)

    def warmup_depths(self) -> List[int]:
        """K per position: forwards before its first backward (chunk forwards, interleaved)."""
        if self.warmup is not None:
            return list(self.warmup)
        if self.schedule.takes_warmup:
            return self.schedule.default_warmup(self.num_stages, self.micro_batches)
        return first_backward_depths(plan_schedule(self))

    def micro_batch_size(self) -> Optional[int]:
        if self.global_batch_size is None:
            return None
        return self.global_batch_size // self.micro_batches

    def slice_sizes(self, stage: int) -> List[int]:
        """Samples of one micro-batch on each replica of `stage`, as even as possible:
        replica r of R takes rows [r*n//R, (r+1)*n//R) of an n-sample micro-batch, so slices
        differ by at most one sample (e.g. 15 replicas of a 128-sample micro-batch)."""
        n = self.micro_batch_size()
        if n is None:
            raise PlanError("the plan has no global_batch_size, so slices are unknown")
        return slicing.slice_sizes(n, self.stages[stage].replicas)

    # ---- checking ------------------------------------------------------------------
    def validate(self, num_layers: Optional[int] = None,
                 num_devices: Optional[int] = None) -> "Plan":
        """Raise PlanError naming the first problem found; return self when consistent."""
        if self.version != PLAN_VERSION:
            raise PlanError(f"plan version {self.version} is not supported (this dapple reads "
                            f"version {PLAN_VERSION}); re-create the plan with `dapple plan`")
        if not self.stages:
            raise PlanError("plan has no stages")
        if self.transfers not in TRANSFERS:
            raise PlanError(f"'transfers' must be one of {TRANSFERS}, got {self.transfers!r}: "
                            f"\"async\" for one process's devices, \"horovod\" under horovodrun")
        self._validate_schedule()
        S = self.num_positions
        expected_first = 0
        seen: Dict[int, int] = {}
        for i, st in enumerate(self.stages):
            if len(st.layers) != 2 or st.first > st.last:
                raise PlanError(f"stage {i}: layers must be [first, last] with first <= last, "
                                f"got {st.layers}")
            if st.first != expected_first:
                what = "leaves out" if st.first > expected_first else "repeats"
                raise PlanError(
                    f"stage {i} starts at layer {st.first} but the previous stage ended at "
                    f"layer {expected_first - 1}: the plan {what} layers "
                    f"{min(st.first, expected_first)}..{max(st.first, expected_first) - 1}; "
                    f"stages must cover consecutive layer ranges")
            expected_first = st.last + 1
            if not st.devices:
                raise PlanError(f"stage {i} has no devices")
            if st.layer_names and len(st.layer_names) != st.num_layers:
                raise PlanError(f"stage {i}: {len(st.layer_names)} layer_names for "
                                f"{st.num_layers} layers {st.layers}")
            if i >= S:          # an interleaved chunk: on its device group's devices
                self._check_chunk_devices(i, S)
                continue
            for d in st.devices:
                if not isinstance(d, int) or d < 0:
                    raise PlanError(f"stage {i}: device id {d!r} is not a non-negative integer")
                if d in seen:
                    raise PlanError(f"device {d} is used by stage {seen[d]} and stage {i}; "
                                    f"each device may run one stage replica only")
                seen[d] = i
        if num_layers is not None and expected_first != num_layers:
            raise PlanError(f"the plan covers layers 0..{expected_first - 1} but the model/profile "
                            f"has {num_layers} layers (0..{num_layers - 1})")
        if num_devices is not None and max(seen) >= num_devices:
            raise PlanError(f"the plan uses device {max(seen)} but the topology has "
                            f"{num_devices} devices (0..{num_devices - 1})")
        if self.micro_batches < 1:
            raise PlanError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.global_batch_size is not None:
            if self.global_batch_size % self.micro_batches:
                raise PlanError(
                    f"global batch {self.global_batch_size} does not divide into "
                    f"{self.micro_batches} equal micro-batches; use a global batch that is a "
                    f"multiple of {self.micro_batches}, or change micro_batches")
            mb = self.global_batch_size // self.micro_batches
            for i, st in enumerate(self.stages):
                if st.replicas > mb:
                    raise PlanError(
                        f"stage {i} has {st.replicas} replicas but a micro-batch has only {mb} "
                        f"samples (global batch {self.global_batch_size} / {self.micro_batches} "
                        f"micro-batches); every replica needs a slice of at least one sample: "
                        f"use fewer micro-batches, fewer replicas or a larger global batch")
        if self.warmup is not None:
            check_warmup(self.warmup, self.micro_batches)
        return self

    def _validate_schedule(self) -> None:
        problem = schedules.plan_problem(self)
        if problem:
            raise PlanError(problem)

    def _check_chunk_devices(self, chunk: int, positions: int) -> None:
        home, st = chunk % positions, self.stages[chunk]
        first = self.stages[home]
        if st.replicas != first.replicas:
            raise PlanError(
                f"chunk {chunk} has {st.replicas} replica(s) but chunk {home}, on the same "
                f"device group (chunk c runs where chunk c % {positions} does), has "
                f"{first.replicas}: every chunk of a device group runs on all of its devices")
        if list(st.devices) != list(first.devices):
            raise PlanError(f"chunk {chunk} runs on devices {st.devices} but chunk {home}, on "
                            f"the same device group, on {first.devices}; give chunk {chunk} "
                            f"the devices {first.devices}")

    # ---- JSON ----------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        schedule = {"name": d.pop("schedule").name}
        for key in schedules.PARAMETERS:
            value = d.pop(key)
            if value is not None:
                schedule[key] = value
        d["schedule"] = schedule
        if d["transfers"] == "async":       # the default, left out
            d["transfers"] = None
        order = ["version", "stages", "micro_batches", "global_batch_size", "schedule",
                 "transfers", "recompute", "estimate", "topology", "profile"]
        return {k: d[k] for k in order if d[k] is not None}

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"a plan is a JSON object, got {type(d).__name__}")
        d = dict(d)
        if "version" not in d:
            raise PlanError("plan has no 'version' field; plans written by dapple carry one")
        for key in ("stages", "micro_batches"):
            if key not in d:
                raise PlanError(f"plan has no '{key}' field")
        d.update(_schedule_fields(d))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"plan has unknown field(s) {unknown}; known fields: {sorted(known)}")
        stages = []
        for i, s in enumerate(d.pop("stages")):
            try:
                stages.append(Stage(layers=list(s["layers"]), devices=list(s["devices"]),
                                    layer_names=list(s.get("layer_names", []))))
            except (KeyError, TypeError) as e:
                raise PlanError(f"stage {i} must have 'layers' [first, last] and 'devices' "
                                f"[ids...]: {e}") from None
        est = d.pop("estimate", None)
        return cls(stages=stages, estimate=Estimate.from_dict(est) if est else None, **d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            try:
                return cls.from_json(f.read())
            except PlanError as e:
                raise PlanError(f"{path}: {e}") from None

    def save(self, path: str) -> None:
        """Write atomically (temp file + rename) so a crash never leaves half a plan."""
        write_text_atomically(path, self.to_json() + "\n")


def straight_plan(boundaries: Sequence[int], num_layers: int, micro_batches: int,
                  global_batch_size: Optional[int] = None, replicas: Optional[Sequence[int]] = None,
                  schedule=schedules.DEFAULT) -> Plan:
    """A plan from cut positions: `boundaries` are the first layers of stages 1..S-1.

    `replicas[i]` devices go to stage i (default 1 each), numbered consecutively.
    Handy for tests and hand-made plans.
    """
    starts = [0] + list(boundaries)
    ends = [b - 1 for b in boundaries] + [num_layers - 1]
    replicas = list(replicas) if replicas is not None else [1] * len(starts)
    if len(replicas) != len(starts):
        raise PlanError(f"{len(replicas)} replica counts for {len(starts)} stages")
    stages, next_device = [], 0
    for first, last, r in zip(starts, ends, replicas):
        stages.append(Stage(layers=[first, last], devices=list(range(next_device, next_device + r))))
        next_device += r
    return Plan(stages=stages, micro_batches=micro_batches, global_batch_size=global_batch_size,
                schedule=schedule).validate(num_layers=num_layers)


# "async": a transfer goes when sent, each direction its own channel (one process's devices);
# "horovod": as under horovodrun (planner.estimate.simulator: serial links, rendezvous);
# "tensorflow": TensorFlow's Send/Recv between processes (`dapple launch --runtime=tensorflow`):
# buffered and full duplex as "async", over the topology's (measured) links.
TRANSFERS = ("async", "horovod", "tensorflow")


def _schedule_fields(d: Dict[str, Any]) -> Dict[str, Any]:
    """The schedule's name and parameters from a plan's JSON object, of either version."""
    version = d.get("version")
    if version == 1:          # "schedule": "A", "warmup": [...] side by side
        if "schedule" in d and not isinstance(d["schedule"], str):
            raise PlanError("a version 1 plan's 'schedule' is a name like \"A\"; version 2 "
                            "plans hold an object: set \"version\": 2")
        return {"version": PLAN_VERSION}
    if version != PLAN_VERSION or "schedule" not in d:
        return {}
    if "warmup" in d:
        raise PlanError("'warmup' belongs inside the schedule object: \"schedule\": {\"name\": "
                        "\"1f1b\", \"warmup\": [...]}")
    spec = d.pop("schedule")
    if not isinstance(spec, dict) or "name" not in spec:
        raise PlanError(f"'schedule' must be an object with a name and parameters, e.g. "
                        f"{{\"name\": \"1f1b\", \"warmup\": [2, 1]}}; got {spec!r}")
    unknown = sorted(set(spec) - {"name"} - set(schedules.PARAMETERS))
    if unknown:
        raise PlanError(f"schedule {spec['name']!r} has unknown parameter(s) {unknown}; known: "
                        f"{list(schedules.PARAMETERS)}")
    return {"schedule": spec["name"], **{k: spec[k] for k in schedules.PARAMETERS if k in spec}}
