"""The cost model: per-task durations of a plan (`pipeline_costs`) and its latency (`evaluate`).

Everything the planner believes about time and memory is here, with every constant stated
once in `CONSTANTS` below (name, value, why). The search (`planner.search`) calls the same
primitives (`StageModel`), so a plan's estimate never depends on who computed it.

Per-task compute time (one micro-batch slice of b samples on one replica):

    t(b) = T_profile * (b + H) / (pbs + H) + TASK_OVERHEAD_MS

T_profile is the layers' profiled time at the profile batch pbs. The affine part says a device
reaches half its per-sample throughput at H samples (SMALL_BATCH_HALF_SAMPLES): time per sample
grows as slices shrink, which is what real devices charge and eq. 1-5 leave out. It equals the
profile exactly at b = pbs. The fixed TASK_OVERHEAD_MS is what every scheduled task costs
(launch, control dependencies, executor dispatch). Replicated stages split each micro-batch as
evenly as possible; the largest slice, ceil(mb / r), sets the pace.

Transfers (a boundary between stages, both directions): the micro-batch's cut bytes X move from
the sender set to the receiver set. Each sender's rows are spread over the receivers in
proportion (split, concat or both, DAPPLE §V-B2, Fig. 9). A host's network interface carries
what leaves or enters it: egress_h = X * s_h * (1 - r_h), ingress_h = X * r_h * (1 - s_h)
(s_h, r_h: fractions of senders / receivers on host h); inside a host each device moves at most
X / min(r1, r2)... bounded by max(X/r1, X/r2) at the in-host rate. Time = the slower of the two
plus the link's latency.

Allreduce of a stage's gradients G over its devices: hierarchical ring. Inside hosts a
reduce-scatter and an all-gather over n (devices of the busiest host): 2 (n-1)/n G at the
in-host rate; across H hosts a ring over the hosts' network interfaces: 2 (H-1)/H G at the
network rate; plus 2 (n-1) in-host and 2 (H-1) network latencies.
Overlap ("DP Overlap", DAPPLE §VI-C): gradients accumulate over the micro-batches, so the
allreduce of a layer may start once the LAST micro-batch's backward has passed that layer.
Layers' allreduces run one after another on the links; the exposed allreduce is what is left
after the stage's last backward ends. `PipelineCosts.allreduce_ms` carries this exposed time,
and eq. 1's AR(P_s, g_s) is this exposed time too, so the simulator and `evaluate` agree.

Latency (DAPPLE eq. 1-3), on the stage list with communication stages interleaved
(computation stage, its outgoing transfer, next computation stage, ...; a transfer has
F = forward send, B = backward send, AR = 0):

    Tw = sum_{s<=Q} F_s
    Ts = (M - 1) (F_Q + B_Q)
    Te = max( max_{s<=Q} AR_s + sum_{a=s..Q} B_a ,  max_{s>Q} AR_s + B_Q - sum_{a=Q+1..s-1} B_a )

Our reading of Te: every term is "when stage s finishes, counted from the end of the steady
phase". The pivot's last backward B_Q runs first in the ending phase; a stage s < Q finishes
after the backward chain Q..s and its allreduce; a stage s > Q ran its last backward before the
pivot's, ending sum_{a=Q+1..s-1} B_a before the pivot's last backward started. Read literally,
eq. 1's s >= Q branch is AR_s - sum_{a=Q..s} B_a, which for s = Q is AR_Q - B_Q while the s < Q
branch would give AR_Q + B_Q: it drops the pivot's last backward and subtracts stage s's own.
`te_literal` keeps the literal form for comparison (tests show the difference).

Round trip (what we plan with; `round_trip_phases`): eq. 1 assumes the pivot never idles. After
its K_q warm-up forwards it needs the gradient of its first micro-batch, back only after every
later stage and transfer has run that micro-batch (R_q = sum_{s>q} F_s + B_s): it waits
W_q = max(0, R_q - (K_q - 1) F_q), and with K_q micro-batches in flight the steady period is
max(F_q + B_q, (F_q + B_q + R_q) / K_q). So latency depends on K (policy by ACR, capped by
memory: `warmup_for`); e.g. VGG-19's 15:1 at K = 1 pays the whole round trip per micro-batch.
The simulator engineer measured it: the planner's Table V plans are within 5% of the
discrete-event simulator with it, up to 1.9x off without it (README, "Formula against simulator on the planner's Table V plans").

Pivot (eq. 3): the printed rule starts Q at the last stage and, walking s from S-2 down to 0,
moves Q to s when (M-1)(F_s+B_s) > (M-1)(F_Q+B_Q) + sum_{s'=s+1..Q-1} (F_s'+B_s'): the stage
whose bubble-free run is longest. We take Q = argmax_q L(q), with L(q) = Tw+Ts+Te computed
with pivot q (see `phases`); `pivot_stage_eq3` keeps the printed scan and tests compare them.

Memory per device of stage s: BYTES_PER_PARAMETER_FACTOR x parameter bytes (weights, gradients,
two Adam slots: 16 bytes a 4-byte parameter, DAPPLE Table VIII) + K_s x ACTIVATION_MEMORY_FACTOR
x the layer outputs of one slice + DEVICE_RESERVED_BYTES.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from planner.costs import PipelineCosts
from planner.plan import Estimate, Plan, PlanError, StageEstimate
from planner.profile import Profile
from planner.schedule import warmup_depths

# ---- the constants: one place, with their sources --------------------------------------------
# Fixed cost of every scheduled forward or backward task: kernel launches of a stage's first
# ops, control-dependency waits and the executor's dispatch. TF 1.x executor + CUDA launch
# overheads are commonly 10s of microseconds per op; a task is dozens of ops: 0.5 ms.
TASK_OVERHEAD_MS = 0.5
# Samples at which a device reaches half its per-sample throughput on a layer slice. Per-sample
# time at b samples is (b + H) / b of the asymptote. 0: time is linear in the slice, as the
# profile measured at its batch; the planner never goes below the profile batch
# (`minimum_slice`, the DAPPLE planner's own rule), so small-batch inefficiency is excluded by
# the plan space rather than modelled (with H = 1 deeper replicated plans won on every flat
# config; the fixed TASK_OVERHEAD_MS still charges small tasks).
SMALL_BATCH_HALF_SAMPLES = 0.0
# Bytes of training state per parameter byte: fp32 weights + gradients + 2 Adam slots = 16 bytes
# per 4-byte parameter (DAPPLE Table VIII assumes 16 bytes a parameter with Adam).
BYTES_PER_PARAMETER_FACTOR = 4.0
# Memory actually held per byte of layer outputs while a micro-batch waits for its backward.
# Profiles record layer outputs only; training keeps more (inputs of every op, masks, workspace).
# From BERT-48, the best-behaved row of DAPPLE Table II: (11.4 GB - 16 B x 640M) / (2 samples x
# 110 MB of outputs) = 5.3; we use 5.
ACTIVATION_MEMORY_FACTOR = 5.0
# Device memory that training cannot use: CUDA context, cuDNN/cuBLAS workspaces and allocator
# fragmentation on a V100 (about 1 GiB is typical).
DEVICE_RESERVED_BYTES = 2 ** 30
# Warm-up policy B (K_i = min(2(S-i)-1, D)) when the activation communication ratio (ACR:
# boundary send time over stage compute time) reaches this; DAPPLE Table IV: B paid off for
# GNMT (ACR 0.10, 1.31x) and VGG-19, not for BERT-48 (0.06) or XLNet-36 (0.03).
POLICY_B_MIN_ACR = 0.08


def minimum_slice(profile: Profile, topology, global_batch_size: int) -> int:
    """The fewest samples a replica may get of one micro-batch in a planned plan: the profile's
    batch size, or, when the global batch cannot give every device that many, the global batch
    over the devices (so data parallelism at M = 1 always qualifies).

    A profile is measured at its batch; below it a device's per-sample time is unknown and in
    practice much worse (kernels too small to fill the GPU). The DAPPLE authors' planner has the
    same rule (`min_micro_batch_size` = the profile batch in PLANNER_REPRODUCTION.md), and it
    keeps eq. 1-5 from preferring deep pipelines of tiny micro-batches. Hand-written plans may
    go below it: `evaluate` extrapolates with SMALL_BATCH_HALF_SAMPLES."""
    pbs = max(1, int(math.ceil(profile.batch_size)))
    return max(1, min(pbs, global_batch_size // topology.num_devices))


CONSTANTS = {
    "TASK_OVERHEAD_MS": TASK_OVERHEAD_MS,
    "SMALL_BATCH_HALF_SAMPLES": SMALL_BATCH_HALF_SAMPLES,
    "BYTES_PER_PARAMETER_FACTOR": BYTES_PER_PARAMETER_FACTOR,
    "ACTIVATION_MEMORY_FACTOR": ACTIVATION_MEMORY_FACTOR,
    "DEVICE_RESERVED_BYTES": DEVICE_RESERVED_BYTES,
    "POLICY_B_MIN_ACR": POLICY_B_MIN_ACR,
}


class CostModelError(ValueError):
    pass


def host_counts(topology, devices: Sequence[int]) -> Tuple[int, ...]:
    """Devices of `devices` on each host (a vector over all hosts)."""
    counts = [0] * topology.num_hosts
    for d in devices:
        counts[topology.host_of(d)] += 1
    return tuple(counts)


class StageModel:
    """Fast cost primitives for one (profile, topology, global batch, M), shared by `evaluate`
    and the search. Stages are (first, last, host-count vector)."""

    def __init__(self, profile: Profile, topology, global_batch_size: int, micro_batches: int):
        if global_batch_size % micro_batches:
            raise PlanError(f"global batch {global_batch_size} does not divide into "
                            f"{micro_batches} equal micro-batches")
        self.profile = profile
        self.topology = topology
        self.M = micro_batches
        self.micro_batch = global_batch_size // micro_batches
        self.pbs = float(profile.batch_size)
        self.intra_bw = topology.intra_host_bandwidth / 1e3     # bytes per ms
        self.inter_bw = topology.inter_host_bandwidth / 1e3
        self.intra_lat = topology.intra_host_latency * 1e3      # ms
        self.inter_lat = topology.inter_host_latency * 1e3
        self._ar_cache: Dict[tuple, float] = {}
        self._transfer_cache: Dict[tuple, float] = {}
        self._fit_cache: Dict[tuple, int] = {}

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

    # ---- allreduce ------------------------------------------------------------------
    def allreduce_rate(self, counts: Sequence[int]) -> Tuple[float, float]:
        """(ms per gradient byte, fixed ms per collective) of a hierarchical ring."""
        hosts = sum(1 for c in counts if c)
        n = max(counts)
        per_byte, fixed = 0.0, 0.0
        if n > 1:
            per_byte += 2 * (n - 1) / n / self.intra_bw
            fixed += 2 * (n - 1) * self.intra_lat
        if hosts > 1:
            per_byte += 2 * (hosts - 1) / hosts / self.inter_bw
            fixed += 2 * (hosts - 1) * self.inter_lat
        return per_byte, fixed

    def exposed_allreduce_ms(self, first: int, last: int, counts: Sequence[int]) -> float:
        """Allreduce time left after the stage's last backward (see module docstring)."""
        if sum(counts) <= 1:
            return 0.0
        key = (first, last, tuple(counts))
        hit = self._ar_cache.get(key)
        if hit is not None:
            return hit
        per_byte, fixed = self.allreduce_rate(counts)
        scale = self.time_scale(sum(counts))
        p = self.profile
        # Layers finish their last backward from `last` down to `first`; layer k is ready at
        # tau_k = TASK_OVERHEAD + scale * backward(k..last). Allreduces run in that order:
        # finish = max_k (tau_k + per_byte * params(k..last)).
        finish = 0.0
        b_done = 0.0
        for k in range(last, first - 1, -1):
            b_done += p.layers[k].backward_ms * scale
            finish = max(finish, b_done + per_byte * p.parameter_bytes(k, last))
        exposed = TASK_OVERHEAD_MS + finish + fixed - (TASK_OVERHEAD_MS + b_done)
        exposed = max(exposed, fixed) if p.parameter_bytes(first, last) > 0 else 0.0
        self._ar_cache[key] = exposed
        return exposed

    # ---- memory ---------------------------------------------------------------------
    def static_bytes(self, first: int, last: int) -> float:
        return (BYTES_PER_PARAMETER_FACTOR * self.profile.parameter_bytes(first, last)
                + DEVICE_RESERVED_BYTES)

    def activation_bytes(self, first: int, last: int, replicas: int) -> float:
        """Bytes one micro-batch slice holds on a replica until its backward."""
        return (ACTIVATION_MEMORY_FACTOR * self.profile.output_bytes(first, last)
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


# ---- eq. 1-3 ------------------------------------------------------------------------------

def pivot_stage_eq3(F: Sequence[float], B: Sequence[float], M: int) -> int:
    """Eq. 3 as printed: a greedy scan from the last stage towards stage 0 (for comparison)."""
    S = len(F)
    Q = S - 1
    between = 0.0        # sum of F+B strictly between s and Q
    for s in range(S - 2, -1, -1):
        if (M - 1) * (F[s] + B[s]) > (M - 1) * (F[Q] + B[Q]) + between:
            Q = s
            between = 0.0
        else:
            between += F[s] + B[s]
    return Q


def latency_with_pivot(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int,
                       q: int) -> Tuple[float, float, float]:
    """(Tw, Ts, Te) of eq. 1 with pivot q, under our reading of Te."""
    Tw = sum(F[: q + 1])
    Ts = (M - 1) * (F[q] + B[q])
    te = -math.inf
    chain = 0.0
    for s in range(q, -1, -1):
        chain += B[s]
        te = max(te, AR[s] + chain)
    chain = 0.0
    for s in range(q + 1, len(F)):
        te = max(te, AR[s] + B[q] - chain)
        chain += B[s]
    return Tw, Ts, te


def _all_pivots(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int
                ) -> List[Tuple[float, float, float]]:
    """(Tw, Ts, Te) of `latency_with_pivot` for every pivot q, in O(S) instead of O(S^2).

    With P[k] = sum_{a<k} B_a and x_s = AR_s - P[s], the s <= q terms of Te are
    P[q+1] + x_s and the s > q terms B_q + P[q+1] + x_s, so Te(q) = P[q+1] +
    max(max_{s<=q} x_s, B_q + max_{s>q} x_s): a prefix and a suffix maximum."""
    S = len(F)
    P = [0.0] * (S + 1)
    for a in range(S):
        P[a + 1] = P[a] + B[a]
    x = [AR[s] - P[s] for s in range(S)]
    suffix = [-math.inf] * (S + 1)
    for s in range(S - 1, -1, -1):
        suffix[s] = max(suffix[s + 1], x[s])
    out, prefix, tw = [], -math.inf, 0.0
    for q in range(S):
        prefix = max(prefix, x[q])
        tw += F[q]
        te = P[q + 1] + max(prefix, B[q] + suffix[q + 1])
        out.append((tw, (M - 1) * (F[q] + B[q]), te))
    return out


def phases(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int
           ) -> Tuple[float, float, float, int]:
    """(Tw, Ts, Te, Q): the pivot is the stage whose bubble-free estimate is longest.

    Eq. 3 moves Q from a later stage to s when s's steady phase exceeds Q's plus the work in
    between, i.e. (up to the pivot's own F+B) when the estimate L(s) through s exceeds L(Q).
    We take that argmax exactly: Q = argmax_q L(q), ties to the later stage (eq. 3 only moves on
    a strict excess). Besides matching eq. 3 on ordinary pipelines, it makes L a maximum of
    path lengths, so adding stages never lowers a partial plan's bound: the search's pruning
    and dominance tests rely on that and stay exact. `pivot_stage_eq3` is the printed scan.
    """
    best = None
    for q, (Tw, Ts, Te) in enumerate(_all_pivots(F, B, AR, M)):
        total = Tw + Ts + Te
        if best is None or total >= best[0] - 1e-12 * max(1.0, abs(total)):
            best = (total, Tw, Ts, Te, q)
    return best[1], best[2], best[3], best[4]


def round_trip_phases(F: Sequence[float], B: Sequence[float], AR: Sequence[float], M: int,
                      K: Sequence[int]) -> Tuple[float, float, float, int]:
    """(Tw, Ts, Te, Q) of eq. 1 with the pivot's round-trip wait, the latency we plan with.

    `K` holds K_i per computation stage (interleaved index q uses K[q // 2], a transfer the
    K of the stage that sends it). After its K_q warm-up forwards, pivot q needs the gradient of
    its first micro-batch, which comes back only after every later stage and transfer ran that
    micro-batch's forward and backward: R_q = sum_{s>q} (F_s + B_s). It idles
    W_q = max(0, R_q - (K_q - 1) F_q) (added to Tw), and with at most K_q micro-batches in
    flight around a loop of F_q + B_q + R_q the steady period is
    max(F_q + B_q, (F_q + B_q + R_q) / K_q). Eq. 1 leaves both out; the discrete-event
    simulator (`planner.simulator`) shows them, and with them the formula is within 5% of the
    simulator on all 15 Table V cells (README, "Formula against simulator on the planner's Table V plans"). Each term is at least eq. 1's, so
    eq. 1 (`phases`) is a lower bound, which the search uses for pruning. Q = argmax as in
    `phases`."""
    # One pass from the last stage to the first (the search values thousands of complete
    # plans): Tw and the s <= q maximum of Te from prefix arrays, the s > q maximum and the trip
    # R_q accumulated on the way; Te(q) as in `_all_pivots`.
    S = len(F)
    P = [0.0] * (S + 1)
    for a in range(S):
        P[a + 1] = P[a] + B[a]
    prefix, tw = [0.0] * S, [0.0] * S
    best_x, acc = -math.inf, 0.0
    for s in range(S):
        v = AR[s] - P[s]
        if v > best_x:
            best_x = v
        prefix[s] = best_x
        acc += F[s]
        tw[s] = acc
    best, best_total, suffix, trip = None, -math.inf, -math.inf, 0.0
    for q in range(S - 1, -1, -1):
        f, b = F[q], B[q]
        fb = f + b
        k = K[q >> 1]
        if k < 1:
            k = 1
        Te = P[q + 1] + max(prefix[q], b + suffix)
        wait = trip - (k - 1) * f
        period = (fb + trip) / k
        Tw = tw[q] + (wait if wait > 0.0 else 0.0)
        Ts = (M - 1) * (period if period > fb else fb)
        total = Tw + Ts + Te
        if total > best_total and (best is None or
                                   total - best_total > 1e-12 * max(1.0, abs(total))):
            best, best_total = (Tw, Ts, Te, q), total
        v = AR[q] - P[q]
        if v > suffix:
            suffix = v
        trip += fb
    return best


def te_literal(B: Sequence[float], AR: Sequence[float], Q: int) -> float:
    """Eq. 1's Te exactly as printed (for comparison; not used for planning)."""
    terms = []
    for s in range(len(B)):
        if s >= Q:
            terms.append(AR[s] - sum(B[a] for a in range(Q, s + 1)))
        else:
            terms.append(AR[s] + sum(B[a] for a in range(s, Q + 1)))
    return max(terms)


def interleave(costs: PipelineCosts) -> Tuple[List[float], List[float], List[float]]:
    """The stage list of eq. 1: computation stages with transfer stages between them."""
    F, B, AR = [], [], []
    for s in range(costs.num_stages):
        F.append(costs.forward_ms[s])
        B.append(costs.backward_ms[s])
        AR.append(costs.allreduce_ms[s])
        if s < costs.num_stages - 1:
            F.append(costs.send_forward_ms[s])
            B.append(costs.send_backward_ms[s])
            AR.append(0.0)
    return F, B, AR


# ---- public API ---------------------------------------------------------------------------

def _check(plan: Plan, profile: Profile, topology) -> int:
    if plan.global_batch_size is None:
        raise PlanError("the plan has no global_batch_size; the cost model needs it")
    plan.validate(num_layers=profile.num_layers, num_devices=topology.num_devices)
    return plan.global_batch_size


def pipeline_costs(plan: Plan, profile: Profile, topology) -> PipelineCosts:
    """Per-task durations of `plan` (one micro-batch slice per replica; allreduce per
    iteration, the exposed part after the stage's last backward)."""
    gbs = _check(plan, profile, topology)
    model = StageModel(profile, topology, gbs, plan.micro_batches)
    counts = [host_counts(topology, st.devices) for st in plan.stages]
    fw, bw, ar, act, sf, sb = [], [], [], [], [], []
    for i, st in enumerate(plan.stages):
        fw.append(model.forward_ms(st.first, st.last, st.replicas))
        bw.append(model.backward_ms(st.first, st.last, st.replicas))
        ar.append(model.exposed_allreduce_ms(st.first, st.last, counts[i]))
        act.append(model.activation_bytes(st.first, st.last, st.replicas))
        if i < plan.num_stages - 1:
            x = model.boundary_bytes(st.last)
            sf.append(model.transfer_ms(x, counts[i], counts[i + 1]))
            sb.append(model.transfer_ms(x, counts[i + 1], counts[i]))
    return PipelineCosts(forward_ms=fw, backward_ms=bw, send_forward_ms=sf, send_backward_ms=sb,
                         allreduce_ms=ar, activation_bytes=act)


def activation_communication_ratio(costs: PipelineCosts) -> float:
    """ACR (DAPPLE §V-C, Table V): mean boundary send time (both directions) over mean stage
    compute time (forward + backward)."""
    if costs.num_stages < 2:
        return 0.0
    comm = sum(f + b for f, b in zip(costs.send_forward_ms, costs.send_backward_ms))
    comm /= costs.num_stages - 1
    compute = sum(f + b for f, b in zip(costs.forward_ms, costs.backward_ms)) / costs.num_stages
    return comm / compute if compute > 0 else 0.0


def memory_per_device(plan: Plan, profile: Profile, topology,
                      warmup: Optional[Sequence[int]] = None) -> List[float]:
    gbs = _check(plan, profile, topology)
    model = StageModel(profile, topology, gbs, plan.micro_batches)
    ks = list(warmup) if warmup is not None else plan.warmup_depths()
    return [model.static_bytes(st.first, st.last)
            + ks[i] * model.activation_bytes(st.first, st.last, st.replicas)
            for i, st in enumerate(plan.stages)]


def warmup_for(costs: PipelineCosts, caps: Sequence[int], M: int) -> Tuple[str, List[int]]:
    """(policy, K_i) from a plan's costs and each stage's memory cap D_i (micro-batches that
    fit; values below 1 count as 1): policy B when the ACR is notable (>= POLICY_B_MIN_ACR),
    else A; K_i = min(the policy's depth, D_i), kept non-increasing. The search and
    `choose_warmup` share it, so a plan's latency (which depends on K, see
    `round_trip_phases`) is the same whoever computes it."""
    S = costs.num_stages
    policy = "B" if S > 1 and activation_communication_ratio(costs) >= POLICY_B_MIN_ACR else "A"
    capped, running = [], M
    for k, d in zip(warmup_depths(policy, S, M), caps):
        running = min(running, k, max(1, d))
        capped.append(running)
    return policy, capped


def choose_warmup(plan: Plan, profile: Profile, topology) -> Tuple[str, List[int]]:
    """(policy, K_i) for `plan` (`warmup_for` with each stage's memory cap D). Raises PlanError
    when a stage cannot hold even one micro-batch."""
    gbs = _check(plan, profile, topology)
    model = StageModel(profile, topology, gbs, plan.micro_batches)
    caps = []
    for i, st in enumerate(plan.stages):
        d = model.max_in_flight(st.first, st.last, st.replicas)
        if d < 1:
            need = model.static_bytes(st.first, st.last) + model.activation_bytes(
                st.first, st.last, st.replicas)
            raise PlanError(f"stage {i} (layers {st.first}..{st.last}, {st.replicas} replicas) "
                            f"needs {need / 2**30:.2f} GiB per device for one micro-batch; "
                            f"devices have {topology.device_memory_bytes / 2**30:.2f} GiB")
        caps.append(d)
    return warmup_for(pipeline_costs(plan, profile, topology), caps, plan.micro_batches)


def evaluate(plan: Plan, profile: Profile, topology, check_memory: bool = False) -> Estimate:
    """The plan's latency estimate: L = Tw + Ts + Te with eq. 3's pivot, and per-stage figures.

    `pivot_stage` in the result indexes computation stages; when the pivot falls on a transfer
    stage, it names the computation stage that sends it (the report says so)."""
    costs = pipeline_costs(plan, profile, topology)
    F, B, AR = interleave(costs)
    ks = plan.warmup
    if ks is None or len(ks) != plan.num_stages:
        model = StageModel(profile, topology, plan.global_batch_size, plan.micro_batches)
        caps = [model.max_in_flight(st.first, st.last, st.replicas) for st in plan.stages]
        ks = warmup_for(costs, caps, plan.micro_batches)[1]
    Tw, Ts, Te, Q = round_trip_phases(F, B, AR, plan.micro_batches, ks)
    memory = memory_per_device(plan, profile, topology)
    if check_memory:
        for i, m in enumerate(memory):
            if m > topology.device_memory_bytes:
                raise PlanError(f"stage {i} needs {m / 2**30:.2f} GiB per device, more than the "
                                f"{topology.device_memory_bytes / 2**30:.2f} GiB available")
    stages = [StageEstimate(forward_ms=costs.forward_ms[i], backward_ms=costs.backward_ms[i],
                            allreduce_ms=costs.allreduce_ms[i], memory_bytes=memory[i])
              for i in range(costs.num_stages)]
    return Estimate(latency_ms=Tw + Ts + Te, warmup_ms=Tw, steady_ms=Ts, ending_ms=Te,
                    pivot_stage=Q // 2, stages=stages)
