"""Task 3: a pipeline schedule (per-device action lists, e.g. 1F1B) run as warm-up (unrolled),
ONE tf.while_loop over the steady periods of every device, cool-down (unrolled).

The lists are dapple's (`planner.schedules.by_name.plan_schedule(plan).lists`, compute actions F/B).
Each device's list is cut into prefix + n_d periods of P actions + suffix, where period i
repeats period 0 with every micro-batch + i (found by `periodic`). The loop runs iterations
t = 0 .. min_d n_d - 1; in iteration t device d runs its period t; earlier actions form the
warm-up, later ones the cool-down (their count depends on the stage count, not on M).

State between actions is explicit, keyed (kind, stage, micro-batch): "act" (a stage's input
received from the previous stage), "res" (a forward's residuals, awaiting its backward), "grad"
(the gradient of a stage's outputs, from the next stage's backward). What is live when the loop
starts becomes loop variables, keyed by the micro-batch relative to t (a residual of F(t+1)
carried into iteration t is ("res", s, +1)); the body must leave the same keys shifted by one
(checked). Inside the body a micro-batch index is the tensor t + c (it slices x and y).

Actions of one device are ordered by control dependencies on the previous action's outputs,
and across iterations through a per-device token (a loop variable). Boundary tensors go from
one device's call to the other's directly (TensorFlow inserts the copies).
"""
from __future__ import annotations

import time
from typing import Sequence, Tuple

import tensorflow as tf

from benchmarks.prototypes.loop_step.split import split_stage

F, B = "F", "B"


def periodic(actions: Sequence[Tuple[str, int]], P: int):
    """(k0, n): the longest run of periods a[k0 + iP + j] == (kind_j, m_j + i), i < n."""
    best = (0, 0)
    for k0 in range(len(actions)):
        n = 0
        while k0 + (n + 1) * P <= len(actions) and all(
                actions[k0 + n * P + j] == (actions[k0 + j][0], actions[k0 + j][1] + n)
                for j in range(P)):
            n += 1
        if n > best[1]:
            best = (k0, n)
    return best


class LoopPipeline:
    """`stages`: graph_rewrite.model_graph.StageGraph list (stage s on devices[s]); `lists`:
    per stage, [(kind, micro_batch)] (F and B) in the order the stage runs them."""

    def __init__(self, stages, lists, devices, M, rows, optimizer=None, use_loop=True,
                 peel=0, parallel_iterations=10):
        self.stages, self.devices, self.M, self.rows = stages, list(devices), M, rows
        self.S = len(stages)
        self.lists = [list(l) for l in lists]
        self.use_loop = use_loop
        self.peel = peel      # periods run before the loop (their gradients start the sums)
        self.parallel_iterations = parallel_iterations   # 1: iteration t+1 waits for t
        self.global_rows = rows * M
        global_rows = float(self.global_rows)
        start = time.perf_counter()
        self.splits = []
        for s, g in enumerate(stages):
            ids = list(g.input_ids)
            x_specs = [tf.TensorSpec([rows] + list(g.specs[i].shape[1:]), g.specs[i].dtype)
                       for i in ids]
            last = s == self.S - 1

            def fn(*args, g=g, ids=ids, last=last, n=len(ids)):
                outs = g.call(dict(zip(ids, args[:n])), training=True)
                if not last:
                    return [outs[t] for t in g.output_ids]
                p = outs[g.output_ids[0]]
                return tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(
                    args[n], p)) / global_rows

            if last:
                y_spec, extra = tf.TensorSpec((), tf.float32), [tf.TensorSpec((rows,), tf.int32)]
            else:
                y_spec = [tf.TensorSpec([rows] + list(g.specs[t].shape[1:]), g.specs[t].dtype)
                          for t in g.output_ids]
                extra = []
            self.splits.append(split_stage(fn, x_specs, extra, g.trainable_variables,
                                           differentiate_x=s > 0, y_spec=y_spec))
        self.split_s = time.perf_counter() - start
        self.variables = [v for g in stages for v in g.trainable_variables]
        self.optimizer = optimizer
        if optimizer is not None:
            optimizer.build(self.variables)
        self.gradients = tf.function(self._gradients)
        self.train_step = tf.function(self._step)

    # ---- actions over an explicit state -----------------------------------------------------
    def _run(self, state, s, kind, m, mb, x, y):
        """One action of stage s on micro-batch key m (an int; `mb` its index, int or tensor)."""
        split = self.splits[s]
        deps = [state["token"][s]]
        with tf.device(self.devices[s]), tf.control_dependencies(deps):
            if kind == F:
                if s == 0:
                    inputs = [x[mb]]
                else:
                    inputs = state.pop(("act", s, m))
                extra = [y[mb]] if s == self.S - 1 else []
                out = split.fwd(*inputs, *extra)[0]
                ys, res = out[:split.num_outputs], out[split.num_outputs:]
                state[("res", s, m)] = list(res)
                if s < self.S - 1:
                    state[("act", s + 1, m)] = list(ys)
                else:
                    state["loss"] = state["loss"] + ys[0]
                produced = list(ys)
            else:
                res = state.pop(("res", s, m))
                if s == self.S - 1:
                    dys = [tf.ones([])]
                else:
                    dys = state.pop(("grad", s, m))
                flat = split.bwd(*res, *dys)
                grads = [tf.convert_to_tensor(g) for g in split.unpack(flat)]
                k = split.num_input_grads
                if s > 0:
                    state[("grad", s - 1, m)] = grads[:k]
                wg = grads[k:]
                for g, v in zip(wg, self.stages[s].trainable_variables):
                    g.set_shape(v.shape)
                acc = state["acc"][s]
                state["acc"][s] = wg if acc is None else [a + g for a, g in zip(acc, wg)]
                produced = grads
            with tf.control_dependencies(produced):
                state["token"][s] = tf.identity(state["token"][s])

    @staticmethod
    def _needs(s, S, kind, m):
        if kind == F:
            return [("act", s, m)] if s > 0 else []
        return [("res", s, m)] + ([("grad", s, m)] if s < S - 1 else [])

    def _emit(self, state, queues, mb_of, x, y):
        """Run the per-stage queues of (kind, m) in an order respecting data (ready-driven)."""
        queues = [list(q) for q in queues]
        while any(queues):
            progressed = False
            for s in reversed(range(self.S)):      # backwards first frees memory sooner
                while queues[s] and all(k in state for k in self._needs(s, self.S,
                                                                        *queues[s][0])):
                    kind, m = queues[s].pop(0)
                    self._run(state, s, kind, m, mb_of(m), x, y)
                    progressed = True
            if not progressed:
                raise ValueError(f"deadlock: {queues}")

    def plan_loop(self):
        """(warm-up queues, period templates (period 0's micro-batches), first iteration t0,
        end T, cool-down queues): the loop runs t in [t0, T)."""
        P = 2
        cuts = [periodic(l, P) for l in self.lists]
        T = min(n for _, n in cuts) if self.use_loop else 0
        t0 = self.peel
        if T - t0 < 2:     # one period is no loop (and any P actions look periodic once)
            T = t0 = 0
        warm, body, cool = [], [], []
        for l, (k0, n) in zip(self.lists, cuts):
            if T == 0:
                warm.append(l); body.append([]); cool.append([])
                continue
            warm.append(l[:k0 + t0 * P])
            body.append(l[k0:k0 + P])
            cool.append(l[k0 + T * P:])
        return warm, body, t0, T, cool

    @tf.autograph.experimental.do_not_convert
    def _gradients(self, x, y):
        M, S = self.M, self.S
        x = tf.reshape(x, [M, self.rows] + x.shape[1:].as_list())
        y = tf.reshape(y, [M, self.rows])
        state = {"loss": tf.zeros([]), "token": [tf.zeros([]) for _ in range(S)],
                 "acc": [None] * S}
        warm, body, t0, T, cool = self.plan_loop()
        self._emit(state, warm, lambda m: m, x, y)
        if T > 0:
            for s, g in enumerate(self.stages):    # a stage with no backward before the loop
                if state["acc"][s] is None:
                    state["acc"][s] = [tf.zeros_like(v) for v in g.trainable_variables]
            # keys relative to t: micro-batch m at t = t0 is key m - t0
            state = {((k[0], k[1], k[2] - t0) if isinstance(k, tuple) else k): v
                     for k, v in state.items()}
            carried = sorted(k for k in state if isinstance(k, tuple))

            def unpack(vals):
                st = {"loss": vals[1], "token": list(vals[2:2 + S])}
                i = 2 + S
                st["acc"] = []
                for g in self.stages:
                    n = len(g.trainable_variables)
                    st["acc"].append(list(vals[i:i + n])); i += n
                for k, v in zip(carried, vals[i:]):
                    st[k] = v
                return st

            def pack(t, st, keys):
                return ([t, st["loss"]] + st["token"] + [a for acc in st["acc"] for a in acc]
                        + [st[k] for k in keys])

            def loop_body(*vals):
                t = vals[0]
                st = unpack(vals)
                self._emit(st, body, lambda m: t + m, x, y)
                # next iteration's keys: micro-batch m at t+1 is key m-1
                shifted = {(k[0], k[1], k[2] - 1): st[k] for k in st if isinstance(k, tuple)}
                if sorted(shifted) != carried:
                    raise ValueError(f"body leaves {sorted(shifted)}, carries {carried}")
                st.update(shifted)
                return pack(t + 1, st, carried)

            init = pack(tf.constant(t0), state, carried)
            out = tf.while_loop(lambda t, *_: t < T, loop_body, init,
                                parallel_iterations=self.parallel_iterations)
            state = unpack(out)
            # keys relative to t = T: back to absolute micro-batches
            state = {((k[0], k[1], k[2] + T) if isinstance(k, tuple) else k): v
                     for k, v in state.items()}
        self._emit(state, cool, lambda m: m, x, y)
        leftover = [k for k in state if isinstance(k, tuple)]
        if leftover:
            raise ValueError(f"unconsumed state {leftover}")
        return state["loss"], [g for acc in state["acc"] for g in acc]

    @tf.autograph.experimental.do_not_convert
    def _step(self, x, y):
        loss, grads = self._gradients(x, y)
        self.optimizer.apply_gradients(zip(grads, self.variables))
        return loss


def schedule_lists(num_stages, M, num_layers, cut, rows):
    from planner.formats.plan import straight_plan
    from planner.schedules.by_name import plan_schedule
    plan = straight_plan([cut], num_layers, M, rows * M, schedule="1f1b")
    sched = plan_schedule(plan)
    return plan, [[(a.kind, a.micro_batch) for a in l] for l in sched.lists]
