"""The cost model: what a stage costs (`StageModel`, `StageCost`) and what a plan costs
(`pipeline_costs`, `choose_warmup`, `memory_per_device`, `evaluate`).

Everything the planner believes about time and memory is here, every constant stated once
below. The search values stages with the same `StageModel.stage_cost`, so a plan's estimate
never depends on who computed it. docs/cost_model.md explains the model and its constants.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from planner.estimate.pipeline_costs import PipelineCosts
from planner.estimate.latency import interleave, round_trip_phases
from planner.formats.plan import Estimate, Plan, PlanError, StageEstimate
from planner.formats.profile import Profile
from planner.schedules.avgpipe_pipelines import micro_batch_devices
from planner.schedules.by_name import plan_schedule, warmup_depths
from planner.schedules.one_f_one_b import ONE_F_ONE_B
from planner.schedules.memory import peak_bytes
from planner.estimate import compute_pass
from planner.estimate.simulator import SimulationResult, plan_run, simulate_plan
from planner.schedules.weight_versions import extra_weight_copies

# ---- the constants (docs/cost_model.md, "The constants", says why each value) ----------------
# Fixed cost of every scheduled forward or backward task (launch, dependencies, dispatch).
TASK_OVERHEAD_MS = 0.5
# Samples at which a device reaches half its per-sample throughput; 0: time linear in the slice.
SMALL_BATCH_HALF_SAMPLES = 0.0
# Bytes of training state per parameter byte: weights, gradients, 2 Adam slots (Table VIII).
BYTES_PER_PARAMETER_FACTOR = 4.0
# Bytes held per byte of layer outputs while a micro-batch waits for its backward (Table II).
ACTIVATION_MEMORY_FACTOR = 5.0
# Bytes a micro-batch keeps per byte of layer outputs after I of a split backward, until W:
# the layers' inputs and the gradients of their outputs, what the weight gradients read.
WEIGHT_GRADIENT_MEMORY_FACTOR = 2.0
# Device memory training cannot use (CUDA context, workspaces, fragmentation).
DEVICE_RESERVED_BYTES = 2 ** 30
# Warm-up policy B when the activation communication ratio reaches this (Table IV).
POLICY_B_MIN_ACR = 0.08


# Beyond this many hosts a transfer's per-host traffic is computed with numpy (the same
# arithmetic per host, so the same floats; the maximum of the same numbers), not in a loop.
VECTOR_HOSTS = 32


def _host_traffic(nbytes: float, senders: Sequence[int], receivers: Sequence[int], r1: int,
                  r2: int) -> Tuple[float, bool, bool]:
    """(the most bytes a host sends or receives, whether any crosses hosts, whether a host
    both sends and receives) of `StageModel._transfer_ms`, over numpy arrays."""
    s, r = np.array(senders, dtype=np.float64), np.array(receivers, dtype=np.float64)
    fs, fr = s / r1, r / r2
    out_b, in_b = nbytes * fs * (1 - fr), nbytes * fr * (1 - fs)
    worst_host = max(0.0, float(out_b.max()), float(in_b.max()))
    crosses = bool((out_b > 0).any() or (in_b > 0).any())
    return worst_host, crosses, bool(((s != 0) & (r != 0)).any())


def minimum_slice(profile: Profile, topology, global_batch_size: int) -> int:
    """The fewest samples a replica may get of one micro-batch in a planned plan: the profile's
    batch size, or the global batch over the devices when that is smaller (so data parallelism
    at M = 1 always qualifies). Below the profile batch a device's speed is unknown; the DAPPLE
    authors' planner has the same rule. Hand-written plans may go below it."""
    pbs = max(1, int(math.ceil(profile.batch_size)))
    return max(1, min(pbs, global_batch_size // topology.num_devices))


def host_counts(topology, devices: Sequence[int]) -> Tuple[int, ...]:
    """Devices of `devices` on each host (a vector over all hosts)."""
    counts = [0] * topology.num_hosts
    for d in devices:
        counts[topology.host_of(d)] += 1
    return tuple(counts)


class StageCost(NamedTuple):
    """One stage of a plan at one M: times for one micro-batch slice on one replica."""
    send_forward_ms: float      # activations into this stage from the one before (0 for stage 0)
    send_backward_ms: float     # their gradients back over the same boundary
    forward_ms: float
    backward_ms: float
    allreduce_ms: float         # once per iteration, after the stage's last backward
    max_in_flight: int          # D: micro-batches whose activations fit (0: not even one)


class StageModel:
    """Fast cost primitives for one (profile, topology, global batch, M, transfers), shared by
    `evaluate` and the search. Stages are (first, last, host-count vector). `transfers` is the
    plan's (`Plan.transfers`): "tensorflow" sums replica gradients as that runtime does
    (`allreduce_rate`)."""

    def __init__(self, profile: Profile, topology, global_batch_size: int, micro_batches: int,
                 transfers: str = "async"):
        if global_batch_size % micro_batches:
            raise PlanError(f"global batch {global_batch_size} does not divide into "
                            f"{micro_batches} equal micro-batches")
        self.profile = profile
        self.topology = topology
        self.M = micro_batches
        self.exchange = transfers == "tensorflow"
        self.micro_batch = global_batch_size // micro_batches
        self.pbs = float(profile.batch_size)
        self.intra_bw = topology.intra_host_bandwidth / 1e3     # bytes per ms
        self.inter_bw = topology.inter_host_bandwidth / 1e3
        self.intra_lat = topology.intra_host_latency * 1e3      # ms
        self.inter_lat = topology.inter_host_latency * 1e3
        # CPU hosts: each end of a boundary transfer takes its device's compute
        self.transfer_cpu = bool(topology.transfer_cpu_latency or
                                 topology.transfer_cpu_bandwidth)
        self._cpu_cache: Dict[tuple, float] = {}
        self._transfer_cache: Dict[tuple, float] = {}
        self._fit_cache: Dict[tuple, int] = {}
        self._rate_cache: Dict[tuple, Tuple[float, float]] = {}

    # ---- compute --------------------------------------------------------------------
    def slice_size(self, replicas: int) -> int:
        return -(-self.micro_batch // replicas)

    def time_scale(self, replicas: int) -> float:
        b = self.slice_size(replicas)
        return (b + SMALL_BATCH_HALF_SAMPLES) / (self.pbs + SMALL_BATCH_HALF_SAMPLES)

    def forward_ms(self, first: int, last: int, replicas: int) -> float:
        return self.profile.forward_ms(first, last) * self.time_scale(replicas) + TASK_OVERHEAD_MS

    def backward_ms(self, first: int, last: int, replicas: int) -> float:
        return self.profile.backward_ms(first, last) * self.time_scale(replicas) + TASK_OVERHEAD_MS

    def transfer_cpu_ms(self, first: int, last: int, replicas: int) -> float:
        """On CPU hosts, what a replica of layers first..last spends of its compute per
        micro-batch and direction on the ends of its boundary transfers: in the forward,
        receiving its input and sending its output; in the backward, receiving the output's
        gradient and sending the input's. The same both ways (a gradient has its activation's
        shape); one message an end, of the replica's slice. 0 on GPU hosts."""
        if not self.transfer_cpu:
            return 0.0
        key = (first, last, replicas)
        hit = self._cpu_cache.get(key)
        if hit is None:
            hit = 0.0
            for boundary in ((first - 1,) if first > 0 else ()) + (
                    (last,) if last < self.profile.num_layers - 1 else ()):
                nbytes = self.profile.boundary_bytes(boundary) * self.slice_size(replicas) / \
                    self.pbs
                hit += 1e3 * self.topology.transfer_cpu_seconds(nbytes)
            self._cpu_cache[key] = hit
        return hit

    # ---- transfers ------------------------------------------------------------------
    def transfer_ms(self, nbytes: float, senders: Sequence[int], receivers: Sequence[int]) -> float:
        """Time to move `nbytes` (a whole micro-batch's boundary) from one device set to
        another, given as host-count vectors."""
        key = (nbytes, tuple(senders), tuple(receivers))
        hit = self._transfer_cache.get(key)
        if hit is None:
            hit = self._transfer_cache[key] = self._transfer_ms(nbytes, senders, receivers)
        return hit

    def _transfer_ms(self, nbytes: float, senders: Sequence[int],
                     receivers: Sequence[int]) -> float:
        r1, r2 = sum(senders), sum(receivers)
        if len(senders) > VECTOR_HOSTS:
            worst_host, crosses, local = _host_traffic(nbytes, senders, receivers, r1, r2)
        else:
            worst_host = 0.0
            crosses = False
            for s_h, r_h in zip(senders, receivers):
                fs, fr = s_h / r1, r_h / r2
                out_b, in_b = nbytes * fs * (1 - fr), nbytes * fr * (1 - fs)
                worst_host = max(worst_host, out_b, in_b)
                if out_b > 0 or in_b > 0:
                    crosses = True
            local = any(s_h and r_h for s_h, r_h in zip(senders, receivers))
        t = 0.0
        if crosses:
            t = max(t, worst_host / self.inter_bw + self.inter_lat)
        if local:
            t = max(t, nbytes / min(r1, r2) / self.intra_bw + self.intra_lat)
        return t

    def boundary_bytes(self, last: int) -> float:
        return self.profile.boundary_bytes(last) * self.micro_batch / self.pbs

    def fed_rows_ms(self, devices: Sequence[int]) -> float:
        """On a TensorFlow cluster, when the step's input rows have reached every replica of
        a first stage on `devices`. The chief (task 0, holding plan device 0, on host 0) is fed
        the global batch and cuts each replica its rows; every micro-batch's rows go at the
        step's start, nothing ordering them, so they share the chief's links and arrive
        together. Those to its own host's other devices (other processes) cross the intra-host
        link, the rest the chief host's network link."""
        chief = self.topology.host_of(0)
        near = sum(1 for d in devices if d != 0 and self.topology.host_of(d) == chief)
        far = sum(1 for d in devices if self.topology.host_of(d) != chief)
        return self._fed_rows_ms(near, far, len(devices))

    def first_stage_rows_ms(self, counts: Sequence[int]) -> float:
        """`fed_rows_ms` of a first stage given as a host-count vector: devices go lowest ids
        first (`planner.search.placement.assign_devices`), so it holds device 0 when it has a
        device on host 0."""
        return self._fed_rows_ms(max(counts[0] - 1, 0), sum(counts) - counts[0], sum(counts))

    def _fed_rows_ms(self, near: int, far: int, replicas: int) -> float:
        per_replica = (self.profile.input_bytes * self.micro_batch * self.M / self.pbs
                       / replicas)
        if per_replica <= 0:
            return 0.0
        t = 0.0
        if near:
            t = per_replica * near / self.intra_bw + self.intra_lat
        if far:
            t = max(t, per_replica * far / self.inter_bw + self.inter_lat)
        return t

    # ---- allreduce ------------------------------------------------------------------
    def allreduce_rate(self, counts: Sequence[int]) -> Tuple[float, float]:
        """(ms per gradient byte, fixed ms per collective) of a hierarchical ring, or on a
        TensorFlow cluster of the sums every replica makes on its own device
        (`graph_rewrite.replica_sums`): host h receives 2 c_h (R - c_h) / R gradients over the
        network and a device 2 (n - 1) / R from its host's others, all at once: the slower of
        the two, and its latency once for 2 replicas, twice for more."""
        # Cached: O(hosts) to compute, and the search asks for the same vectors many times.
        key = tuple(counts)
        hit = self._rate_cache.get(key)
        if hit is None:
            hit = self._rate_cache[key] = self._allreduce_rate(key)
        return hit

    def _allreduce_rate(self, counts: Sequence[int]) -> Tuple[float, float]:
        hosts = len(counts) - counts.count(0)
        n = max(counts)
        if self.exchange:
            return self._exchange_rate(counts, hosts, n)
        per_byte, fixed = 0.0, 0.0
        if n > 1:
            per_byte += 2 * (n - 1) / n / self.intra_bw
            fixed += 2 * (n - 1) * self.intra_lat
        if hosts > 1:
            per_byte += 2 * (hosts - 1) / hosts / self.inter_bw
            fixed += 2 * (hosts - 1) * self.inter_lat
        return per_byte, fixed

    def _exchange_rate(self, counts: Sequence[int], hosts: int, n: int) -> Tuple[float, float]:
        # `graph_rewrite.replica_sums`: each device receives 2 / R of a gradient from each
        # other replica (2 replicas: the other's whole, in one round; more: a piece to add,
        # then the sums, in two).
        R = sum(counts)
        per_byte, fixed, rounds = 0.0, 0.0, 1 if R <= 2 else 2
        if n > 1:
            per_byte, fixed = 2 * (n - 1) / R / self.intra_bw, self.intra_lat
        if hosts > 1:
            into_a_host = max(2 * c * (R - c) / R for c in counts)
            per_byte = max(per_byte, into_a_host / self.inter_bw)
            fixed = max(fixed, self.inter_lat)
        return per_byte, rounds * fixed

    def allreduce_ms(self, first: int, last: int, counts: Sequence[int]) -> float:
        """A whole allreduce of the stage's parameters (AvgPipe's updates), nothing hidden."""
        per_byte, fixed = self.allreduce_rate(counts)
        return (per_byte * self.profile.parameter_bytes(first, last) + fixed) * (sum(counts) > 1)

    def exposed_allreduce_ms(self, first: int, last: int, counts: Sequence[int],
                             replicas: Optional[int] = None) -> float:
        """Allreduce time left after the stage's last backward: all of it. dapple's runtime
        runs a stage's backward as one call whose gradients appear together, so the allreduce
        starts after it (docs/cost_model.md); a stage without parameters has none.
        `replicas` is sum(counts) when the caller has it."""
        if (sum(counts) if replicas is None else replicas) <= 1:
            return 0.0
        parameters = self.profile.parameter_bytes(first, last)
        if parameters <= 0:
            return 0.0
        per_byte, fixed = self.allreduce_rate(counts)
        return per_byte * parameters + fixed

    # ---- memory ---------------------------------------------------------------------
    def static_bytes(self, first: int, last: int) -> float:
        return (BYTES_PER_PARAMETER_FACTOR * self.profile.parameter_bytes(first, last)
                + DEVICE_RESERVED_BYTES)

    def activation_bytes(self, first: int, last: int, replicas: int) -> float:
        """Bytes one micro-batch slice holds on a replica until its backward."""
        return (ACTIVATION_MEMORY_FACTOR * self.profile.output_bytes(first, last)
                * self.slice_size(replicas) / self.pbs)

    def weight_gradient_bytes(self, first: int, last: int, replicas: int) -> float:
        """Bytes one micro-batch slice keeps on a replica between I and W of a split
        backward."""
        return (WEIGHT_GRADIENT_MEMORY_FACTOR * self.profile.output_bytes(first, last)
                * self.slice_size(replicas) / self.pbs)

    def max_in_flight(self, first: int, last: int, replicas: int) -> int:
        """D: micro-batches whose activations fit beside the stage's weights (0: none)."""
        key = (first, last, replicas)
        hit = self._fit_cache.get(key)
        if hit is None:
            hit = self._fit_cache[key] = self._max_in_flight(first, last, replicas)
        return hit

    def _max_in_flight(self, first: int, last: int, replicas: int) -> int:
        free = self.topology.device_memory_bytes - self.static_bytes(first, last)
        act = self.activation_bytes(first, last, replicas)
        if free < act:
            return 0
        return self.M if act <= 0 else int(min(self.M, free // act))

    # ---- a whole stage --------------------------------------------------------------
    def stage_cost(self, first: int, last: int, counts: Sequence[int],
                   previous: Optional[Sequence[int]] = None) -> StageCost:
        """The `StageCost` of layers first..last on the devices `counts` (a host-count
        vector), after a stage on `previous` (None for the first stage)."""
        replicas = sum(counts)
        return self.stage_cost_of(first, last, counts, previous, replicas)

    def stage_cost_of(self, first: int, last: int, counts: tuple,
                      previous: Optional[tuple], replicas: int) -> StageCost:
        """`stage_cost` with `replicas` = sum(counts) given and the vectors as tuples (the
        search's inner loop, where hosts can number hundreds)."""
        send_forward = send_backward = 0.0
        if previous is not None:
            x = self.boundary_bytes(first - 1)
            send_forward = self.transfer_ms(x, previous, counts)
            send_backward = self.transfer_ms(x, counts, previous)
        cpu = self.transfer_cpu_ms(first, last, replicas)      # a transfer's ends; 0 on GPUs
        return StageCost(send_forward, send_backward,
                         self.forward_ms(first, last, replicas) + cpu,
                         self.backward_ms(first, last, replicas) + cpu,
                         self.exposed_allreduce_ms(first, last, counts, replicas),
                         self.max_in_flight(first, last, replicas))


# ---- what a plan costs --------------------------------------------------------------------

def to_pipeline_costs(stages: Sequence[StageCost], activation_bytes: Sequence[float] = (),
                      weight_gradient_bytes: Sequence[float] = ()) -> PipelineCosts:
    """The `PipelineCosts` of a plan given as its stages' costs."""
    return PipelineCosts(forward_ms=[s.forward_ms for s in stages],
                         backward_ms=[s.backward_ms for s in stages],
                         send_forward_ms=[s.send_forward_ms for s in stages[1:]],
                         send_backward_ms=[s.send_backward_ms for s in stages[1:]],
                         allreduce_ms=[s.allreduce_ms for s in stages],
                         activation_bytes=list(activation_bytes),
                         weight_gradient_bytes=list(weight_gradient_bytes))


def warmup_for(costs: PipelineCosts, caps: Sequence[int], M: int) -> Tuple[str, List[int]]:
    """(policy, K_i) from a plan's costs and each stage's memory cap D_i (values below 1 count
    as 1): policy B when the ACR reaches POLICY_B_MIN_ACR, else A; K_i = min(the policy's
    depth, D_i), kept non-increasing. The search and `choose_warmup` both use it, so a plan's
    latency (which depends on K) is the same whoever computes it."""
    S = costs.num_stages
    policy = "B" if S > 1 and costs.activation_communication_ratio() >= POLICY_B_MIN_ACR else "A"
    capped, running = [], M
    for k, d in zip(warmup_depths(policy, S, M), caps):
        running = min(running, k, max(1, d))
        capped.append(running)
    return policy, capped


def planned_latency_ms(stages: Sequence[StageCost], M: int) -> float:
    """The latency we plan with (eq. 1 with the round trip, `latency.round_trip_phases`) of a
    plan given as its stages' costs, at the K_i `warmup_for` chooses."""
    costs = to_pipeline_costs(stages)
    ks = warmup_for(costs, [s.max_in_flight for s in stages], M)[1]
    Tw, Ts, Te, _ = round_trip_phases(*interleave(costs), M, ks)
    return Tw + Ts + Te


class Timing(NamedTuple):
    """Of a plan's simulated run: its iteration, its time per global batch consumed, and on
    position 0 the least start of a B, I, W or allreduce and the latest end of a forward
    (0.0 when there are none)."""
    iteration_ms: float
    batch_ms: float
    first_backward_ms: float
    last_forward_ms: float


class PlanCosts:
    """A plan's costs, computed once: the plan validated against the profile and topology, its
    `StageModel`, each stage's `StageCost`, and the `PipelineCosts` the simulator replays."""

    def __init__(self, plan: Plan, profile: Profile, topology):
        if plan.global_batch_size is None:
            raise PlanError("the plan has no global_batch_size; the cost model needs it")
        plan.validate(num_layers=profile.num_layers, num_devices=topology.num_devices)
        self.plan, self.topology = plan, topology
        self.model = model = StageModel(profile, topology, plan.global_batch_size,
                                        plan.micro_batches, plan.transfers)
        counts = [host_counts(topology, st.devices) for st in plan.stages]
        lanes = [host_counts(topology, d) for d in micro_batch_devices(plan)]
        self.stages = [model.stage_cost(st.first, st.last, c, lanes[i - 1] if i else None)
                       for i, (st, c) in enumerate(zip(plan.stages, lanes))]
        if plan.schedule.averaging:      # its allreduce, after the update, sums the pipelines'
            self.stages = [s._replace(allreduce_ms=model.allreduce_ms(st.first, st.last, c))
                           for s, st, c in zip(self.stages, plan.stages, counts)]
        self.pipeline = to_pipeline_costs(
            self.stages, *[[f(st.first, st.last, sum(c)) for st, c in zip(plan.stages, lanes)]
                           for f in (model.activation_bytes, model.weight_gradient_bytes)])
        # I of a split backward: its share of the layers' backward, and every transfer end
        # (W sends and receives nothing)
        self.pipeline.input_gradient_ms = [
            model.backward_ms(st.first, st.last, sum(c)) *
            profile.input_gradient_fraction(st.first, st.last) +
            model.transfer_cpu_ms(st.first, st.last, sum(c))
            for st, c in zip(plan.stages, lanes)]
        if plan.transfers == "tensorflow":      # the chief sends the first stage its rows
            first_devices = micro_batch_devices(plan)[0]
            self.pipeline.start_ms = [model.fed_rows_ms(first_devices)] + \
                [0.0] * (len(plan.stages) - 1)
        self._simulation: Optional[SimulationResult] = None
        self._timing: Optional[Timing] = None

    def simulation(self) -> SimulationResult:
        """The plan's schedule simulated with these costs; computed once, for the plan as it
        is at the first call (set the warm-up first)."""
        if self._simulation is None:
            self._simulation = simulate_plan(self.plan, self.pipeline)
        return self._simulation

    def timing(self) -> "Timing":
        """What a choice and a simulated estimate need of the simulation, the same numbers:
        from `compute_pass` when it applies (no timeline is built), else the simulation's."""
        if self._timing is None:
            if self._simulation is None:
                schedule, link_duplex, rendezvous, pipelines = plan_run(self.plan, self.pipeline)
                quick = compute_pass.iteration(schedule, self.pipeline, link_duplex, rendezvous)
                if quick is not None:
                    self._timing = Timing(quick.iteration_ms,
                                          quick.iteration_ms / (schedule.batches * pipelines),
                                          quick.first_backward_ms, quick.last_forward_ms)
                    return self._timing
            result = self.simulation()
            first = result.stage_events(0)
            self._timing = Timing(
                result.iteration_ms, result.batch_ms,
                min((e.start_ms for e in first if e.kind != "forward"), default=0.0),
                max((e.end_ms for e in first if e.kind == "forward"), default=0.0))
        return self._timing

    def warmup(self) -> Tuple[str, List[int]]:
        """(policy, K_i) by `warmup_for`; PlanError when a stage cannot hold one micro-batch."""
        for i, (st, cost) in enumerate(zip(self.plan.stages, self.stages)):
            if cost.max_in_flight < 1:
                need = self.model.static_bytes(st.first, st.last) + \
                    self.pipeline.activation_bytes[i]
                raise PlanError(
                    f"stage {i} (layers {st.first}..{st.last}, {st.replicas} replicas) needs "
                    f"{need / 2**30:.2f} GiB per device for one micro-batch; devices have "
                    f"{self.topology.device_memory_bytes / 2**30:.2f} GiB")
        return warmup_for(self.pipeline, [c.max_in_flight for c in self.stages],
                          self.plan.micro_batches)

    def memory(self, warmup: Optional[Sequence[int]] = None) -> List[float]:
        """Bytes per device running each stage (chunk): the weights of every chunk on the
        device and their extra copies (`planner.schedules.weight_versions`), the reserve once, and the
        peak of the activations its schedule keeps (`planner.schedules.memory`; 1F1B and GPipe:
        K_i micro-batches, and `warmup` replaces the plan's K_i)."""
        plan = self.plan
        schedule = plan_schedule(plan) if warmup is None else \
            ONE_F_ONE_B.actions(plan.num_stages, plan.micro_batches, warmup)
        activations = peak_bytes(schedule, self.pipeline.activation_bytes,
                                 self.pipeline.weight_gradient_bytes)
        weights = [0.0] * schedule.num_positions
        extra = extra_weight_copies(schedule)
        for c, st in enumerate(plan.stages):
            p = schedule.placement[c]
            weights[p] += self.model.static_bytes(st.first, st.last) - DEVICE_RESERVED_BYTES + \
                extra[p] * self.model.profile.parameter_bytes(st.first, st.last)
        return [DEVICE_RESERVED_BYTES + weights[p] + activations[p]
                for p in schedule.placement]

    def estimate(self, check_memory: bool = False) -> Estimate:
        """L = Tw + Ts + Te at the plan's warm-up depths (`warmup_for`'s when it has none).
        `pivot_stage` indexes computation stages: a pivot on a transfer names its sender.
        Schedules the formula does not describe (interleaved, zb-h1) are simulated instead."""
        plan, costs = self.plan, self.pipeline
        if not plan.schedule.formula:
            return self._simulated_estimate(check_memory)
        ks = plan.warmup
        if not plan.schedule.planner_warmup and ks is None:
            ks = plan.warmup_depths()                 # every forward first: K_i = M
        elif ks is None or len(ks) != plan.num_stages:
            ks = warmup_for(costs, [c.max_in_flight for c in self.stages],
                            plan.micro_batches)[1]
        Tw, Ts, Te, Q = round_trip_phases(*interleave(costs), plan.micro_batches, ks)
        Tw += costs.start_ms[0] if costs.start_ms else 0.0    # nothing starts before its rows
        return Estimate(latency_ms=Tw + Ts + Te, warmup_ms=Tw, steady_ms=Ts, ending_ms=Te,
                        pivot_stage=Q // 2, stages=self._stage_estimates(check_memory))

    def _stage_estimates(self, check_memory: bool) -> List[StageEstimate]:
        costs, memory = self.pipeline, self.memory()
        if check_memory:
            for i, m in enumerate(memory):
                if m > self.topology.device_memory_bytes:
                    raise PlanError(f"stage {i} needs {m / 2**30:.2f} GiB per device, more than "
                                    f"the {self.topology.device_memory_bytes / 2**30:.2f} GiB "
                                    f"available")
        return [StageEstimate(forward_ms=costs.forward_ms[i], backward_ms=costs.backward_ms[i],
                              allreduce_ms=costs.allreduce_ms[i], memory_bytes=memory[i])
                for i in range(costs.num_stages)]

    def _simulated_estimate(self, check_memory: bool) -> Estimate:
        """The simulated time per global batch consumed as the latency; phases from the first
        device group, scaled alike: until its first backward, until its last forward, the rest."""
        result = self.timing()
        per = result.batch_ms / (result.iteration_ms or 1.0)
        backward, last_forward = result.first_backward_ms, result.last_forward_ms
        return Estimate(latency_ms=result.batch_ms, warmup_ms=backward * per,
                        steady_ms=max(last_forward - backward, 0.0) * per,
                        ending_ms=(result.iteration_ms - max(last_forward, backward)) * per,
                        pivot_stage=0, stages=self._stage_estimates(check_memory),
                        method="simulated")


def pipeline_costs(plan: Plan, profile: Profile, topology) -> PipelineCosts:
    """Per-task durations of `plan` (one micro-batch slice per replica; allreduce once per
    iteration, the part exposed after the stage's last backward)."""
    return PlanCosts(plan, profile, topology).pipeline


def choose_warmup(plan: Plan, profile: Profile, topology) -> Tuple[str, List[int]]:
    """(policy, K_i) for `plan`; PlanError when a stage cannot hold one micro-batch."""
    return PlanCosts(plan, profile, topology).warmup()


def memory_per_device(plan: Plan, profile: Profile, topology,
                      warmup: Optional[Sequence[int]] = None) -> List[float]:
    return PlanCosts(plan, profile, topology).memory(warmup)


def evaluate(plan: Plan, profile: Profile, topology, check_memory: bool = False) -> Estimate:
    """The plan's latency estimate (eq. 1 with the round trip) and per-stage figures."""
    return PlanCosts(plan, profile, topology).estimate(check_memory)
