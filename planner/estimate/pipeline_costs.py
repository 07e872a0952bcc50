"""PipelineCosts: the per-task durations of one plan, the interface between the cost model
(`planner.estimate.cost_model`, which computes them from a profile and a topology) and everything that
replays a schedule (`planner.estimate.simulator`, reports, `dapple verify --timing`).

All times are milliseconds for ONE micro-batch on ONE replica of a stage (its slice of the
micro-batch), except `allreduce_ms`, which is once per iteration per stage. With an interleaved
schedule the "stages" here are the plan's chunks (its `stages`), in pipeline order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class PipelineCosts:
    forward_ms: List[float]                 # per stage
    backward_ms: List[float]                # per stage
    send_forward_ms: List[float]            # per boundary s -> s+1 (length S-1): activations
    send_backward_ms: List[float]           # per boundary s+1 -> s (length S-1): gradients
    allreduce_ms: List[float]               # per stage; 0 for a stage with one replica
    activation_bytes: List[float] = field(default_factory=list)  # per stage, one micro-batch held
    # Per stage, one micro-batch after I of a split backward, until its W: what W reads. Empty:
    # the same as activation_bytes (nothing freed before W).
    weight_gradient_bytes: List[float] = field(default_factory=list)
    # Per stage, the part of backward_ms that is I of a split backward (W is the rest). Empty:
    # half of it.
    input_gradient_ms: List[float] = field(default_factory=list)
    # Per stage, the earliest its forwards may start: what the step is fed reaching its
    # replicas (on a TensorFlow cluster, the chief's rows crossing to the first stage's other
    # replicas, `cost_model.StageModel.fed_rows_ms`). Empty: at once.
    start_ms: List[float] = field(default_factory=list)

    def activation_communication_ratio(self) -> float:
        """ACR (DAPPLE §V-C, Table V): mean boundary send time (both directions) over mean
        stage compute time (forward + backward)."""
        if self.num_stages < 2:
            return 0.0
        comm = sum(f + b for f, b in zip(self.send_forward_ms, self.send_backward_ms))
        comm /= self.num_stages - 1
        compute = sum(f + b for f, b in zip(self.forward_ms, self.backward_ms)) / self.num_stages
        return comm / compute if compute > 0 else 0.0

    @property
    def num_stages(self) -> int:
        return len(self.forward_ms)

    def __post_init__(self) -> None:
        S = len(self.forward_ms)
        for name in ("backward_ms", "allreduce_ms"):
            if len(getattr(self, name)) != S:
                raise ValueError(f"PipelineCosts.{name} has {len(getattr(self, name))} entries "
                                 f"for {S} stages")
        for name in ("activation_bytes", "weight_gradient_bytes", "input_gradient_ms",
                     "start_ms"):
            if getattr(self, name) and len(getattr(self, name)) != S:
                raise ValueError(f"PipelineCosts.{name} has {len(getattr(self, name))} entries "
                                 f"for {S} stages (or leave it empty)")
        for name in ("send_forward_ms", "send_backward_ms"):
            if len(getattr(self, name)) != max(S - 1, 0):
                raise ValueError(f"PipelineCosts.{name} needs {S - 1} entries (one per boundary), "
                                 f"got {len(getattr(self, name))}")
