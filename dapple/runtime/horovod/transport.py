"""The pipelined step across processes: one Horovod rank per plan device.

`HorovodPipelineStep` is `pipeline.PipelineStep` (same cutting, micro-batches, schedule lowered
to control dependencies, loss terms and gradient accumulation) with `HorovodTransport`, which
builds only this rank's unit and moves boundary tensors and gradients with Horovod collectives:

* Boundary s -> s+1: one `hvd.alltoall` per micro-batch inside the process set of both stages'
  ranks, carrying all the boundary's tensors (relayed skips included) packed side by side as
  bytes (`graph_rewrite.packing`), with uneven `splits` (`ranks.RankLayout.
  send_splits`): split, concat or both when replica counts differ. Gradients go back the same
  way, one collective per micro-batch.
* Replicas of a stage: one `hvd.grouped_allreduce(op=Sum)` of all the stage's accumulated
  gradients in the stage's process set: one negotiation and one pass through the fusion
  buffer, not one allreduce per variable. A data-parallel-only plan's go in
  `GRADIENT_GROUPS` grouped allreduces, last layers first, and the rank's stage calls are
  inlined (the default), so at M = 1 the first groups are reduced while the backward goes on
  (as plain Horovod's allreduces are); ready together, Horovod fuses them into one.
* The step's loss is summed over all ranks (only last-stage ranks hold loss terms). In a
  data-parallel plan it rides in the gradients' grouped allreduce (no collective of its own);
  in a pipeline it is one global allreduce made after the rank's gradients, which nothing but
  the step's end waits for (it used to gate every gradient: the update waited for a scalar
  negotiated 30-37 ms after the gradients, docs/cluster.md "Speed"). A step's last
  collective is global either way, so every rank ends the step together (a rank that
  returns early shuts Horovod down for the rest).

Decisions a newcomer needs (tests/dapple/runtime/horovod checks each on the pinned stack,
docs/stacks.md):

* Names. Horovod pairs collectives across ranks by name, and TF prefixes the name scope,
  which differs per rank (`stage0/replica0/F3` vs `stage1/replica0/F3`). Every collective gets
  a plan-wide name (`dapple.f<boundary>.<micro-batch>`, `dapple.b<boundary>.<micro-batch>`
  ...) with `ignore_name_scope=True`. Boundary tensors are packed in the receiving stage's
  `input_ids` order (the ids themselves are process-local Python ids, the order is not). In a
  pipeline's loop (`graph_rewrite.schedule_loop`) one op carries a micro-batch per iteration,
  named by its slot (`dapple.f<boundary>.l<loop>.<relative micro-batch>`, `Crossing.label`),
  and the loop runs one iteration at a time: Horovod refuses a name still in flight.
* Grappler hazards. Horovod ops are not marked stateful, so TF's graph optimizations treat
  them as pure functions: (1) common-subexpression elimination merges transfers with identical
  inputs and attributes (receives all send the same empty tensor; a layer like Add has the same
  gradient for both inputs), so every micro-batch gets the same rows and the peers' other
  transfers never match; (2) constant folding *executes* a collective whose inputs are all
  constant while it optimizes the function (an empty tensor of static shape counts as
  constant, and so does x * 0), once, on one rank: the first call seems to work, later calls
  hang. Turning Grappler's `common_subgraph_elimination` off does not help. So every transfer
  input gets an exact zero that is neither constant nor shared: a variable read worth 0 times
  the transfer's number (from 1), added to a send's splits (not its data: an add over
  megabytes cost a millisecond per transfer on a rank's one thread), and used as the row count
  of a receive's empty tensor. Tests use different data in every micro-batch and several calls.
* Keeping transfers. A sender's alltoall returns an empty tensor that nothing reads, and a
  received gradient can be unused too (the gradient of a model input relayed by stage 0).
  Horovod ops are not stateful, so TF drops such ops and the peers wait forever; a control
  dependency on them did not keep them either (the probe hung), nor did size(output) * salt
  (Grappler knew the size). The step's loss adds (the output's first byte) * salt for every
  transfer (an empty sum for a send): an exact 0, and a data dependency Grappler cannot drop.
  One byte, not a sum over the payload, which cost milliseconds between two transfers.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import horovod.tensorflow as hvd
import tensorflow as tf

from graph_rewrite.batch_statistics import UnsupportedLayerError, is_batch_normalization
from graph_rewrite.keras_adapter import layer_of
from dapple.runtime.horovod.ranks import RankLayout
from graph_rewrite.model_graph import variable_holders
from graph_rewrite.local_transport import Crossing, Tensors, Unit
from graph_rewrite.packing import pack, row_bytes, unpack
from graph_rewrite.pipeline import PipelineStep, StepResult

ENV_DYNAMIC_PROCESS_SETS = "HOROVOD_DYNAMIC_PROCESS_SETS"


def _existing_process_sets() -> Dict[Tuple[int, ...], int]:
    from horovod.common import process_sets as ps_module
    basics = ps_module._basics
    return {tuple(ranks): ps_id for ps_id, ranks in basics._get_process_set_ids_and_ranks().items()}


def init_horovod(layout_sets: Sequence[Sequence[int]]) -> Dict[Tuple[int, ...], "hvd.ProcessSet"]:
    """Initialize Horovod with the process sets a plan needs, or find/add them if the user
    already called `hvd.init()`. Returns the sets by their ranks (the global set included)."""
    wanted = [list(r) for r in layout_sets]
    if not hvd.is_initialized():
        sets = [hvd.ProcessSet(r) for r in wanted]
        hvd.init(process_sets=sets)
    found: Dict[Tuple[int, ...], hvd.ProcessSet] = {
        tuple(range(hvd.size())): hvd.global_process_set}
    existing = _existing_process_sets()
    for ranks in wanted:
        key = tuple(ranks)
        if key in existing:
            ps = hvd.ProcessSet(ranks)
            ps.process_set_id = existing[key]
        else:
            try:
                ps = hvd.add_process_set(ranks)
            except ValueError as e:
                raise RuntimeError(
                    f"the plan needs Horovod process set {ranks}, but Horovod was initialized "
                    f"without it and cannot add it ({e}). Either let dapple initialize Horovod "
                    f"(do not call hvd.init() before creating PipelinedModel), or set "
                    f"{ENV_DYNAMIC_PROCESS_SETS}=1 in the environment (`dapple launch` does)"
                ) from None
        found[key] = ps
    return found


def rank_device(local_rank: int) -> str:
    """This rank's device: the GPU of its local rank when GPUs are visible, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) == 1:
        return gpus[0].name           # CUDA_VISIBLE_DEVICES (or set_visible_devices) chose it
    if len(gpus) > local_rank:
        return gpus[local_rank].name
    if gpus:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own ({len(gpus)} visible): "
                           f"start at most {len(gpus)} processes per host")
    return "/CPU:0"


def pin_gpu_to_local_rank() -> None:
    """Make only the local rank's GPU visible (before TensorFlow initializes its devices), so
    eight ranks on one server do not each reserve memory on all eight GPUs."""
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) > 1:
        try:
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
            for gpu in tf.config.get_visible_devices("GPU"):
                tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:
            pass  # TensorFlow already initialized; rank_device() picks the local rank's GPU


class HorovodTransport:
    """Builds only this rank's (stage, replica) units (one, or an interleaved group's chunks);
    moves boundaries with Horovod."""

    # Transfers are named by `Crossing.label` and need no more than the sender's value, so a
    # pipeline's loop body can hold them (`graph_rewrite.schedule_loop`).
    slot_named_transfers = True

    def __init__(self, layout: RankLayout, process_sets):
        self.layout = layout
        self.sets = process_sets
        self.units = self.layout.units(hvd.rank())     # one, or an interleaved group's chunks
        self.replica = self.units[0][1]
        # Read once per step; makes every transfer's splits input distinct (see the module
        # docstring, Grappler merge hazard).
        self._salt_variable = tf.Variable(0.0, trainable=False, name="dapple_transfer_salt")
        self.begin_step()

    def begin_step(self) -> None:
        self.pending: List[tf.Tensor] = []
        self._salt: Optional[tf.Tensor] = None
        self._transfers = 0

    def local_units(self) -> List[Unit]:
        return list(self.units)

    def _boundary_set(self, boundary: int):
        return self.sets[tuple(self.layout.boundary_ranks(boundary))]

    def salt(self) -> tf.Tensor:
        if self._salt is None:
            self._salt = self._salt_variable.read_value()
        return self._salt

    def kept(self, total: tf.Tensor, outputs: Sequence[tf.Tensor]) -> tf.Tensor:
        """`total` plus (the first element of each of `outputs`) * salt: an exact 0 that makes
        whatever reads the result depend on every one of these transfers. Sends' outputs are
        empty and a received gradient may go unused, and collectives are not stateful ops:
        unread, TensorFlow drops them and the peers wait forever (a control dependency alone
        did not keep them: the job hung, see the module docstring). One element each, not a
        sum over megabytes on the rank's one thread between two transfers; the salt is a
        variable read, which Grappler cannot fold."""
        if not outputs:
            return total
        firsts = [tf.reduce_sum(tf.cast(tf.reshape(out, [-1])[:1], total.dtype))
                  for out in outputs]
        return total + tf.add_n(firsts) * self.salt()

    def _zero(self) -> tf.Tensor:
        """An exact 0.0 that Grappler can neither fold nor share with another transfer of the
        step: the salt (a variable read worth 0) times the transfer's number, counted from 1
        (Grappler rewrites x * 0 to a constant)."""
        self._transfers += 1
        return self.salt() * float(self._transfers)

    def distinct(self, tensor: tf.Tensor) -> tf.Tensor:
        zero = self._zero()
        if tensor.dtype == tf.bool:
            return tf.logical_or(tensor, tf.cast(zero, tf.bool))
        return tensor + tf.cast(zero, tensor.dtype)

    def empty(self, shape: List[int], dtype) -> tf.Tensor:
        """What a receiver sends: no rows, but a row count known only at run time, so that
        the receive never has constant inputs (see the module docstring)."""
        rows = tf.cast(self._zero(), tf.int32)
        return tf.zeros(tf.stack([rows] + [tf.constant(d) for d in shape]), dtype=dtype)

    def _send(self, tensor: tf.Tensor, splits: List[int], name: str, process_set,
              row_order: List[Tuple[int, int]]) -> None:
        if [r for pair in row_order for r in pair] != sorted(r for pair in row_order for r in pair):
            # Destinations in rank order are not in replica (row) order: reorder the rows.
            tensor = tf.concat([tensor[lo:hi] for lo, hi in row_order], axis=0)
        # The splits, not the megabytes of data, carry the salt that keeps this transfer
        # distinct (see the module docstring): an add over the payload sat on the rank's one
        # thread between two transfers.
        out, _ = hvd.alltoall(tensor, splits=self.distinct(tf.constant(splits, tf.int32)),
                              name=name, ignore_name_scope=True, process_set=process_set)
        self.pending.append(out)

    def _receive(self, specs: Sequence[tf.TensorSpec], pieces, name: str,
                 process_set) -> List[tf.Tensor]:
        width = sum(row_bytes(s) for s in specs)
        out, _ = hvd.alltoall(self.empty([width], tf.uint8),
                              splits=tf.constant([0] * process_set.size(), tf.int32),
                              name=name, ignore_name_scope=True, process_set=process_set)
        self.pending.append(out)     # a received gradient may be unused (a relayed model input)
        if [p.sender_replica for p in pieces] != sorted(p.sender_replica for p in pieces):
            # Pieces arrive in sender rank order; rows are in sender replica order.
            parts = tf.split(out, [p.rows for p in pieces], axis=0)
            order = sorted(range(len(pieces)), key=lambda i: pieces[i].sender_replica)
            out = tf.concat([parts[i] for i in order], axis=0)
        rows = sum(p.rows for p in pieces)
        return unpack(tf.ensure_shape(out, [rows, width]), specs)

    # ---- activations and gradients: one collective per boundary, micro-batch and direction ---
    def send_activations(self, crossing: Crossing, replica: int, outputs: Tensors) -> None:
        b, ids = crossing.boundary, crossing.ids
        self._send(pack([outputs[t] for t in ids], [crossing.specs[t] for t in ids]),
                   self.layout.send_splits(b, replica, b + 1, crossing.rows),
                   f"dapple.f{b}.{crossing.label}", self._boundary_set(b),
                   self.layout.send_row_order(b, replica, b + 1, crossing.rows))

    def receive_activations(self, crossing: Crossing, replica: int,
                            sent: Dict[int, Tensors]) -> Tensors:
        b, ids = crossing.boundary, crossing.ids
        tensors = self._receive([crossing.specs[t] for t in ids],
                                self.layout.received_pieces(b, b + 1, replica, crossing.rows),
                                f"dapple.f{b}.{crossing.label}", self._boundary_set(b))
        return dict(zip(ids, tensors))

    def send_gradients(self, crossing: Crossing, replica: int, grads: Tensors) -> None:
        b, ids = crossing.boundary, _float_ids(crossing)
        if not ids:     # only integer tensors cross: no gradients, no collective on either side
            return
        self._send(pack([grads[t] for t in ids], [crossing.specs[t] for t in ids]),
                   self.layout.send_splits(b + 1, replica, b, crossing.rows),
                   f"dapple.b{b}.{crossing.label}", self._boundary_set(b),
                   self.layout.send_row_order(b + 1, replica, b, crossing.rows))

    def receive_gradients(self, crossing: Crossing, replica: int, sent: Dict[int, Tensors],
                          ids: Sequence[str]) -> Tensors:
        b, floats = crossing.boundary, _float_ids(crossing)
        if not floats:
            return {}
        tensors = self._receive([crossing.specs[t] for t in floats],
                                self.layout.received_pieces(b + 1, b, replica, crossing.rows),
                                f"dapple.b{b}.{crossing.label}", self._boundary_set(b))
        received = dict(zip(floats, tensors))
        return {tid: received[tid] for tid in ids}

    # ---- replicas ---------------------------------------------------------------------------
    def sum_replicas(self, stage: int, grads_by_replica: Dict[int, List[tf.Tensor]],
                     device: str, tag: str = "ar", groups: int = 1) -> List[tf.Tensor]:
        """Allreduce (sum) in the stage's process set, all tensors in `groups` grouped
        collectives (`grouped_sum`); `tag` names them."""
        grads = grads_by_replica[self.replica]
        if len(self.layout.stage_ranks(stage)) == 1 or not grads:
            return grads
        ps = self.sets[tuple(sorted(self.layout.stage_ranks(stage)))]
        with tf.name_scope(f"stage{stage}/{tag}"):
            return self.grouped_sum(grads, f"dapple.{tag}{stage}", ps, groups)

    def grouped_sum(self, tensors: List[tf.Tensor], name: str, process_set,
                    groups: int = 1) -> List[tf.Tensor]:
        """`hvd.grouped_allreduce(op=Sum)` of `tensors`, in up to `groups` collectives of about
        equal bytes, the last tensors first (a backward makes the last layers' gradients
        first). Groups ready together Horovod negotiates in one cycle and fuses into one
        allreduce; groups ready apart start while the backward goes on."""
        tensors = list(tensors)
        out: List[Optional[tf.Tensor]] = [None] * len(tensors)
        for g, members in enumerate(byte_groups(tensors, groups)):
            part = self._one_group([tensors[i] for i in members],
                                   name if groups == 1 else f"{name}.{g}", process_set)
            for i, t in zip(members, part):
                out[i] = t
        return out

    def _one_group(self, tensors: List[tf.Tensor], name: str, process_set) -> List[tf.Tensor]:
        """One `hvd.grouped_allreduce`. Only the smallest input carries the salt that keeps
        the op distinct and non-constant (see the module docstring): one distinct input makes
        the whole op distinct, and an add over every gradient cost a pass over megabytes on
        the rank's one thread."""
        small = min(range(len(tensors)), key=lambda i: tensors[i].shape.num_elements() or 0)
        tensors[small] = self.distinct(tensors[small])
        return list(hvd.grouped_allreduce(tensors, op=hvd.Sum, process_set=process_set,
                                          name=name, ignore_name_scope=True))

    def sum_over_ranks(self, tensor: tf.Tensor, name: str, ranks=None) -> tf.Tensor:
        """Allreduce (sum) over `ranks` (default: all)."""
        ps = hvd.global_process_set if ranks is None else self.sets[tuple(sorted(ranks))]
        return hvd.allreduce(self.distinct(tensor), op=hvd.Sum, process_set=ps,
                             name=f"dapple.{name}", ignore_name_scope=True)


# A data-parallel step's gradients go in this many grouped allreduces, last layers first: ready
# together (the lane's loop ends, or a backward that is not inlined) Horovod fuses them into
# one; ready apart (an inlined backward) the first start while the backward goes on. Four: a
# trial on the residual MLP of benchmarks/dp_step_horovod.py (docs/cluster.md, "Speed").
GRADIENT_GROUPS = 4


class HorovodPipelineStep(PipelineStep):
    """`PipelineStep` for this rank's unit; results cover this rank's stage only.

    `gradients` holds this stage's (replica-summed) gradients and None for other stages'
    variables; a variable shared with other stages gets the sum over all of them (an
    allreduce in the process set of every rank of those stages, to which each stage's replica
    0 contributes), so every copy is updated alike. `loss` is the global batch's loss on every
    rank; `predictions` are non-empty on last-stage ranks only (their own rows).
    """

    def __init__(self, model, plan, loss, device: str, process_sets, layout: RankLayout,
                 **kwargs):
        self.layout = layout
        self.process_sets = process_sets
        super().__init__(model, plan, loss, [device] * layout.size,
                         transport=HorovodTransport(layout, process_sets), **kwargs)
        check_shared_across_processes(self.stages)
        self.holders = variable_holders(self.stages)

    def owns_norm_of(self, variable) -> bool:
        """Whether this rank counts `variable` in the global gradient norm: the first replica of
        the first stage that holds it (every holder has the same summed gradient)."""
        holders = self.holders.get(id(variable), [])
        return bool(holders) and (holders[0], 0) in self.transport.units

    def _sum_shared(self, gradients: List[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        out = list(gradients)
        for i, v in enumerate(self.model.trainable_variables):
            stages = self.holders.get(id(v), [])
            if len(stages) < 2 or out[i] is None:
                continue
            mine = out[i] if self.transport.replica == 0 else tf.zeros_like(out[i])
            out[i] = self.transport.sum_over_ranks(mine, f"shared.{i}",
                                                   self.layout.ranks_of_stages(stages))
        return out

    def _loss_rides(self, state, stage: int, action) -> bool:
        """Whether the step's loss can ride in `stage`'s gradient allreduce: a data-parallel
        plan (one stage on every rank, one allreduce a step) whose loss terms are all made."""
        return (len(self.stages) == 1 and action.micro_batch is None and state.backward
                and len(self.layout.stage_ranks(stage)) == self.layout.size > 1
                and not self.transport.pending and bool(state.loss_terms))

    def _allreduce(self, state, stage: int, replicas: List[int], action) -> None:
        if not self._loss_rides(state, stage, action):
            super()._allreduce(state, stage, replicas, action)
            return
        local = tf.add_n(state.loss_terms)
        grads = {r: list(state.accumulated[(stage, r)]) + [local] for r in replicas}
        *state.reduced[stage], loss = self.transport.sum_replicas(
            stage, grads, self.device(stage, 0), groups=GRADIENT_GROUPS)
        self._rider = (state, len(state.loss_terms), loss)

    def run(self, x, y=None, training: bool = True, **kwargs) -> StepResult:
        """Callers must fetch `loss` (return it from the tf.function): it carries the data
        dependencies that keep every transfer; a control dependency on it may be dropped.

        Data parallelism (one stage on every rank): the loss rides in the gradients' one
        grouped allreduce. Pipelines: the global loss allreduce is made after the gradients
        (a control dependency on them), off the update's path; nothing waits for it but the
        step's end."""
        self.transport.begin_step()
        self._rider = None
        result = super().run(x, y, training, **kwargs)
        if result.gradients:
            result.gradients = self._sum_shared(result.gradients)
        if self._rider is not None:
            state, terms, loss = self._rider
            self._rider = None
            if len(state.loss_terms) != terms:     # a loss term made after the allreduce
                raise AssertionError("the step's loss changed after its allreduce")
            return StepResult(loss=loss, gradients=result.gradients,
                              predictions=result.predictions, global_batch=result.global_batch)
        kept = self.transport.kept(result.loss, self.transport.pending)
        # After this rank's gradients (their allreduces negotiated first), not before them:
        # the update does not wait for the loss.
        with tf.control_dependencies([g for g in result.gradients if g is not None]):
            kept = tf.identity(kept)
        loss = hvd.allreduce(kept, op=hvd.Sum, name="dapple.loss", ignore_name_scope=True)
        return StepResult(loss=loss, gradients=result.gradients,
                          predictions=result.predictions, global_batch=result.global_batch)

    def sum_over_ranks(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        """Allreduce (sum) over all ranks, as one of this step's collectives."""
        return self.transport.sum_over_ranks(tensor, name)

    def all_predictions(self, result: StepResult) -> List[tf.Tensor]:
        """Every output's predictions for the whole global batch, in row order, on every rank:
        last-stage ranks hold their rows; one allgather per output brings them together."""
        last = self.plan.stages[-1]
        M, R = self.schedule.micro_batches, last.replicas     # M over a relaxed run's batches
        size = result.global_batch // (M * R)
        replica_of_rank = {d: r for r, d in enumerate(last.devices)}
        ranks = sorted(last.devices)
        outs = []
        for k, tensor in enumerate(self.model.outputs):
            mine = result.predictions[k] if k < len(result.predictions) else []
            if mine:
                local = self.transport.distinct(tf.concat(mine, axis=0))
            else:   # not a last-stage rank: contributes no rows
                local = self.transport.empty(list(tensor.shape[1:]), tensor.dtype)
            gathered = hvd.allgather(local, name=f"dapple.predictions.{k}",
                                     ignore_name_scope=True)
            blocks = tf.split(gathered, [M * size] * R, axis=0)        # by rank
            by_replica = {replica_of_rank[rank]: tf.split(block, [size] * M, axis=0)
                          for rank, block in zip(ranks, blocks)}
            outs.append(tf.concat([by_replica[r][m] for m in range(M) for r in range(R)],
                                  axis=0))
        return outs


def byte_groups(tensors: Sequence[tf.Tensor], groups: int) -> List[List[int]]:
    """Indices of `tensors`, last first, cut into at most `groups` runs of about equal bytes
    (none empty)."""
    sizes = [(t.shape.num_elements() or 0) * t.dtype.size for t in tensors]
    total, out, run, done = sum(sizes), [], [], 0
    for i in reversed(range(len(tensors))):
        run.append(i)
        done += sizes[i]
        if len(out) < groups - 1 and done * groups >= total * (len(out) + 1):
            out.append(run)
            run = []
    return out + ([run] if run else [])


def _float_ids(crossing: Crossing) -> List[str]:
    """The boundary tensors that carry gradients back, in the crossing's order."""
    return [t for t in crossing.ids if crossing.specs[t].dtype.is_floating]


def shared_stage_groups(stages) -> List[Tuple[int, ...]]:
    """The groups of stages that share a trainable variable, each once."""
    return sorted({tuple(h) for h in variable_holders(stages).values() if len(h) > 1})


def check_shared_across_processes(stages) -> None:
    """Refuse a BatchNormalization layer whose calls run in two stages: its moving statistics
    would need one stage's update before the other's, across processes."""
    seen = {}
    for graph in stages:
        for node in graph.nodes:
            layer = layer_of(node)
            if is_batch_normalization(layer):
                first = seen.setdefault(id(layer), graph.index)
                if first != graph.index:
                    raise UnsupportedLayerError(
                        f"layer {layer.name!r} (BatchNormalization) is called in stages "
                        f"{first} and {graph.index}; under horovodrun its moving statistics "
                        f"cannot be updated in order across processes: move the cut so that "
                        f"its calls share a stage, or use separate layers")
