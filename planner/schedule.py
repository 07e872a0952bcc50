"""Schedules as data: per stage, the ordered forward/backward tasks of each micro-batch.

This module is the single source of truth for execution order (after DeepSpeed's
schedule-as-instructions). `graph_rewrite` lowers these lists to control dependencies, the
simulator replays them with the cost model's durations, and tests check them without
TensorFlow.

Early backward (DAPPLE §III-B, §V-C): stage i runs K_i forwards, then strictly alternates one
backward and one forward until its forwards are exhausted, then runs the remaining backwards.

* policy "A": K_i = min(S - i, M)
* policy "B": K_i = min(2(S - i) - 1, M)
* "gpipe":    K_i = M (all forwards, then all backwards)

A memory limit D (micro-batches whose activations fit on a device) caps K_i further; the planner
writes the capped depths into the plan's `warmup` field.

Correctness condition: K_i >= K_{i+1} >= 1 and K_i <= M. With it, replaying all stages
together never deadlocks (`replay` checks this by construction, and tests check it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Task:
    kind: str          # FORWARD or BACKWARD
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


class ScheduleError(ValueError):
    pass


def warmup_depths(policy: str, num_stages: int, micro_batches: int,
                  memory_limit: Optional[int] = None) -> List[int]:
    """K_i for every stage under `policy`, capped by `memory_limit` (D) when given."""
    S, M = num_stages, micro_batches
    if policy == "A":
        ks = [min(S - i, M) for i in range(S)]
    elif policy == "B":
        ks = [min(2 * (S - i) - 1, M) for i in range(S)]
    elif policy == "gpipe":
        ks = [M] * S
    else:
        raise ScheduleError(f"unknown schedule policy {policy!r}; use 'A', 'B' or 'gpipe'")
    if memory_limit is not None:
        if memory_limit < 1:
            raise ScheduleError(f"memory limit D must allow at least one micro-batch, got "
                                f"{memory_limit}")
        ks = [min(k, memory_limit) for k in ks]
    return ks


def check_warmup(warmup: Sequence[int], micro_batches: int) -> None:
    for i, k in enumerate(warmup):
        if not 1 <= k <= micro_batches:
            raise ScheduleError(f"warmup K_{i} = {k} must be between 1 and micro_batches "
                                f"({micro_batches})")
    for i in range(len(warmup) - 1):
        if warmup[i] < warmup[i + 1]:
            raise ScheduleError(
                f"warmup K_{i} = {warmup[i]} < K_{i + 1} = {warmup[i + 1]}: a stage must warm "
                f"up at least as deep as the next one, or stage {i} waits for a backward "
                f"that needs a forward it has not run yet")


def stage_tasks(micro_batches: int, warmup: int) -> List[Task]:
    """One stage's ordered task list: `warmup` forwards, then alternate B/F, then drain Bs."""
    M, K = micro_batches, warmup
    if not 1 <= K <= M:
        raise ScheduleError(f"warmup depth {K} must be in 1..{M}")
    tasks = [Task(FORWARD, m) for m in range(K)]
    next_forward, next_backward = K, 0
    while next_backward < M:
        tasks.append(Task(BACKWARD, next_backward))
        next_backward += 1
        if next_forward < M:
            tasks.append(Task(FORWARD, next_forward))
            next_forward += 1
    return tasks


def pipeline_schedule(num_stages: int, micro_batches: int, policy: str = "A",
                      warmup: Optional[Sequence[int]] = None) -> List[List[Task]]:
    """Task lists for every stage (index = stage)."""
    ks = list(warmup) if warmup is not None else warmup_depths(policy, num_stages, micro_batches)
    if len(ks) != num_stages:
        raise ScheduleError(f"{len(ks)} warmup depths for {num_stages} stages")
    check_warmup(ks, micro_batches)
    return [stage_tasks(micro_batches, k) for k in ks]


def plan_schedule(plan) -> List[List[Task]]:
    """Task lists for a `planner.plan.Plan`."""
    return pipeline_schedule(plan.num_stages, plan.micro_batches, plan.schedule,
                             plan.warmup_depths())


def dependencies(stage: int, task: Task, num_stages: int) -> List[Tuple[int, Task]]:
    """Cross-stage data dependencies of `task` on `stage`: (stage, task) pairs it needs."""
    if task.kind == FORWARD:
        return [(stage - 1, task)] if stage > 0 else []
    deps = [(stage, Task(FORWARD, task.micro_batch))]
    if stage < num_stages - 1:
        deps.append((stage + 1, task))
    return deps


def replay(schedule: Sequence[Sequence[Task]]) -> List[Tuple[int, Task]]:
    """Run all stages' lists together in unit time steps; return the global completion order.

    Each stage runs its next task as soon as that task's data dependencies are complete.
    Raises ScheduleError naming the stuck tasks on deadlock, and on a list that misses or
    repeats a task.
    """
    S = len(schedule)
    for s, tasks in enumerate(schedule):
        M = sum(1 for t in tasks if t.kind == FORWARD)
        expected = {Task(k, m) for k in (FORWARD, BACKWARD) for m in range(M)}
        if len(tasks) != len(set(tasks)) or set(tasks) != expected:
            missing = sorted(expected - set(tasks))
            repeated = sorted({t for t in tasks if list(tasks).count(t) > 1})
            raise ScheduleError(f"stage {s}: task list must hold F and B of every micro-batch "
                                f"once; missing {[str(t) for t in missing]}, repeated "
                                f"{[str(t) for t in repeated]}")
    done: Dict[Tuple[int, Task], int] = {}
    position = [0] * S
    order: List[Tuple[int, Task]] = []
    step = 0
    while any(position[s] < len(schedule[s]) for s in range(S)):
        ready = []
        for s in range(S):
            if position[s] < len(schedule[s]):
                t = schedule[s][position[s]]
                if all(d in done for d in dependencies(s, t, S)):
                    ready.append((s, t))
        if not ready:
            stuck = [f"stage {s}: {schedule[s][position[s]]}" for s in range(S)
                     if position[s] < len(schedule[s])]
            raise ScheduleError("schedule deadlocks; waiting tasks: " + ", ".join(stuck))
        for s, t in ready:
            done[(s, t)] = step
            position[s] += 1
            order.append((s, t))
        step += 1
    return order

