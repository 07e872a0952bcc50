"""A pipeline's steady periods as one loop between warm-up and cool-down (the default:
`graph_rewrite.schedule_loop`, with `graph_rewrite.stage_split`): the step's graph does not
grow with M, and what it computes is what plain Keras computes. The references: the plain
model's gradients by `tf.GradientTape` on the whole batch, its `fit`, its own
`train_on_batch` for BatchNormalization's moving statistics, and the traced graph's ops."""
import collections

import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from graph_rewrite.schedule_loop import periodic_runs, plan_loop
from planner.formats.plan import straight_plan
from planner.search.chunking import interleaved_plan
from planner.schedules.by_name import build_schedule, plan_schedule
from tests.models import (assert_trains_like_plain_model, conv_batchnorm, data_for,
                          dense_batchnorm, losses_for, mlp_with_skip, plain_loss_and_grads,
                          small_conv, two_in_two_out)
from tests.dapple.test_sample_weights import BATCH, ROWS, assert_same, pair, weights_for

CALLS = ("StatefulPartitionedCall", "PartitionedCall")
GLOBAL_BATCH = 48


def assert_looped(pm, looped=True):
    """`pm`'s step ran its pipeline as a loop iff `looped`."""
    assert (pm.pipeline_step.schedule_loops > 0) == looped, \
        f"pipeline {'not ' if looped else ''}built as a loop"


def lists_of(cuts, m, schedule, replicas):
    plan = straight_plan(cuts, 5, m, 8 * m, replicas=replicas, schedule=schedule)
    return [[(a.kind, a.micro_batch) for a in lst] for lst in plan_schedule(plan).lists]


def plan_of(cuts, m, schedule, replicas, layers=5, batch=None):
    """A straight plan, or with schedule "interleaved" two chunks per device group (`cuts`
    then cut chunks, `replicas` is per device group); global batch 8 M unless given."""
    batch = batch or 8 * m
    if schedule == "interleaved":
        return interleaved_plan(cuts, layers, m, 2, batch, replicas)
    return straight_plan(cuts, layers, m, batch, replicas=replicas, schedule=schedule)


def loop_plan_of(plan):
    schedule = plan_schedule(plan)
    return plan_loop([[(a.kind, a.chunk, a.micro_batch) for a in lst] for lst in schedule.lists],
                     [s.replicas for s in plan.stages], schedule.placement)


@pytest.mark.parametrize("schedule", ["A", "B"])
def test_warm_up_and_cool_down_do_not_grow_with_the_micro_batches(schedule):
    plans = [plan_loop(lists_of([1, 3], m, schedule, [1, 1, 1]), [1, 1, 1]) for m in (8, 32)]
    assert all(plans) and [len(p.segments) for p in plans] == [3, 3]     # one loop
    warm_up, loop, cool_down = zip(*[p.segments for p in plans])
    assert len(warm_up[0]) == len(warm_up[1]) and len(cool_down[0]) == len(cool_down[1])
    assert len(loop[0].body) == len(loop[1].body) == 2 * 3       # a forward and a backward
    assert loop[1].iterations - loop[0].iterations == 24


def test_gpipe_runs_a_loop_of_forwards_then_one_of_backwards():
    plan = plan_loop(lists_of([1, 3], 8, "gpipe", [2, 1, 2]), [2, 1, 2])
    forwards, backwards = plan.loops
    assert [p for p in plan.segments if not isinstance(p, type(forwards))] == [[], [], []]
    assert {t.kind for t in forwards.body} == {"F"} and {t.kind for t in backwards.body} == {"B"}
    assert forwards.iterations == backwards.iterations == 8
    # the forwards' residuals wait, stacked, for the backwards; nothing else crosses
    assert forwards.collected == [("residuals", s, r, 0) for s, r in
                                  [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]]
    assert forwards.carried == backwards.carried == backwards.collected == []


@pytest.mark.parametrize("cuts,replicas", [([2], [1, 1]), ([1, 3], [1, 2, 1])])
def test_zb_h1_loops_forward_input_and_weight_gradients(cuts, replicas):
    plans = [loop_plan_of(plan_of(cuts, m, "zb-h1", replicas)) for m in (8, 32)]
    assert all(plans) and [len(p.loops) for p in plans] == [1, 1]
    warm_up, loop, cool_down = zip(*[p.segments for p in plans])
    assert len(warm_up[0]) == len(warm_up[1]) and len(cool_down[0]) == len(cool_down[1])
    # a period: one F, one I and one W of every unit
    assert collections.Counter(t.kind for t in loop[0].body) == {
        k: sum(replicas) for k in "FIW"}
    assert loop[1].iterations - loop[0].iterations == 24
    # stage s's W runs s micro-batches behind its I: what I left for it is carried
    assert {k for k in loop[0].carried if k[0] == "pending"} == {
        ("pending", s, r, m) for s in range(len(replicas)) for r in range(replicas[s])
        for m in range(min(t.micro_batch for t in loop[0].body if t.kind == "W" and t.stage == s),
                       min(t.micro_batch for t in loop[0].body if t.kind == "I" and t.stage == s))}


def test_interleaved_loops_a_group_of_micro_batches_per_period():
    plans = [loop_plan_of(plan_of([1, 2, 3], m, "interleaved", [1, 1])) for m in (8, 32)]
    assert all(plans) and [len(p.loops) for p in plans] == [1, 1]
    warm_up, loop, cool_down = zip(*[p.segments for p in plans])
    assert len(warm_up[0]) == len(warm_up[1]) and len(cool_down[0]) == len(cool_down[1])
    # M / S = groups of 2: every chunk's forward and backward of 2 micro-batches per period
    assert loop[0].stride == loop[1].stride == 2
    assert collections.Counter((t.kind, t.stage) for t in loop[0].body) == {
        (k, c): 2 for k in "FB" for c in range(4)}
    assert 2 * (loop[1].iterations - loop[0].iterations) == 24


def test_lists_no_loop_can_express_are_left_unrolled():
    assert plan_loop(lists_of([2], 2, "A", [1, 1]), [1, 1]) is None      # one period
    assert plan_loop([[("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)],
                      [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]],
                     [1, 1]) is None        # stages without common periods


def names(tasks):
    return [f"{t.stage}{t.kind}{t.micro_batch}" for t in tasks]


def test_pipedreams_updates_run_inside_the_loop():
    """PipeDream on 3 stages, M = 4, a run of 3 batches (12 micro-batches, an update after
    every backward): stage s keeps 3 - s forwards in flight, so a period is a forward, a
    backward and an update on every stage; hand-derived from the lists
    (stage 0: F0 F1 F2 B0 U0 F3 B1 U1 ... F11 B9 U9 B10 U10 B11 U11)."""
    lists = [[(a.kind, a.chunk, a.micro_batch) for a in lst]
             for lst in build_schedule("pipedream", 3, 4, batches=3).lists]
    warm_up, loop, cool_down = plan_loop(lists, [1, 1, 1]).segments
    assert names(warm_up) == ["0F0", "0F1", "1F0"]
    assert sorted(names(loop.body)) == sorted(["0F2", "0B0", "0UPDATE0", "1F1", "1B0",
                                               "1UPDATE0", "2F0", "2B0", "2UPDATE0"])
    assert loop.iterations == 10
    assert sorted(names(cool_down)) == sorted(["0B10", "0UPDATE10", "0B11", "0UPDATE11",
                                               "1F11", "1B10", "1UPDATE10", "1B11", "1UPDATE11",
                                               "2F10", "2B10", "2UPDATE10", "2F11", "2B11",
                                               "2UPDATE11"])


def test_a_fixed_action_cuts_the_periodic_runs():
    """An action no loop may hold (weights move before it) ends one run; the next starts
    after it."""
    actions = [(k, m) for m in range(5) for k in "FB"]
    assert periodic_runs(actions, 2) == [(0, 5)]
    assert periodic_runs(actions, 2, fixed={4}) == [(0, 2), (5, 2)]     # F2: B2 F3 | B3 F4
    assert periodic_runs(actions, 2, fixed={4, 7}) == [(0, 2)]


CASES = [
    # (builder, cuts, replicas, M, schedule)
    (mlp_with_skip, [2], [1, 1], 4, "A"),
    (mlp_with_skip, [1], [1, 1], 8, "B"),              # skip d1 -> add crosses the cut
    (mlp_with_skip, [1, 3], [1, 1, 1], 8, "A"),        # 3 stages, skip relayed
    (mlp_with_skip, [2], [2, 1], 4, "A"),              # 2:1 (concat)
    (mlp_with_skip, [2], [2, 3], 8, "A"),              # 2:3 (split and concat)
    (two_in_two_out, [1, 4], [1, 2, 1], 8, "B"),       # input b enters late, two outputs
    (small_conv, [2], [1, 1], 6, "A"),
    (mlp_with_skip, [1, 3], [1, 1, 1], 4, "gpipe"),
    (mlp_with_skip, [2], [2, 3], 8, "gpipe"),
    (two_in_two_out, [1, 4], [1, 2, 1], 4, "gpipe"),
    (mlp_with_skip, [2], [1, 1], 4, "zb-h1"),
    (mlp_with_skip, [1, 3], [1, 1, 1], 8, "zb-h1"),
    (mlp_with_skip, [2], [2, 3], 8, "zb-h1"),
    (two_in_two_out, [1, 4], [1, 2, 1], 8, "zb-h1"),
    (small_conv, [2], [1, 1], 6, "zb-h1"),
    # interleaved: cuts of 4 chunks, replicas per device group; groups of M / 2 micro-batches
    (mlp_with_skip, [1, 2, 3], [1, 1], 6, "interleaved"),      # skip relayed through chunk 1
    (mlp_with_skip, [1, 2, 3], [2, 1], 8, "interleaved"),      # 2:1, then 1:2 back to group 0
    (mlp_with_skip, [1, 2, 3], [1, 2], 8, "interleaved"),
    (two_in_two_out, [1, 2, 3], [1, 1], 6, "interleaved"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].__name__}-{':'.join(map(str, c[2]))}"
                         f"-M{c[3]}-{c[4]}")
def test_looped_gradients_equal_the_plain_model(case):
    builder, cuts, replicas, m, schedule = case
    model, reference = builder(), builder()
    plan = plan_of(cuts, m, schedule, replicas, len(layer_order(model)), GLOBAL_BATCH)
    loss = losses_for(model)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=True)
    pm.compile(optimizer="sgd", loss=loss)
    x, y = data_for(model, GLOBAL_BATCH, seed=7)
    got = pm.gradients(x, y)
    _, want = plain_loss_and_grads(reference, loss, x, y)
    assert len(got) == len(want)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, want)) < 1e-5
    assert_looped(pm)


@pytest.mark.parametrize("schedule,cuts,m", [("1f1b", [2], 4), ("gpipe", [2], 4),
                                             ("zb-h1", [2], 4), ("interleaved", [1, 2, 3], 6)])
def test_looped_training_gives_the_plain_model_weights(schedule, cuts, m):
    model, reference = mlp_with_skip(), mlp_with_skip()
    plan = plan_of(cuts, m, schedule, [2, 1], batch=GLOBAL_BATCH)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=True)
    assert_trains_like_plain_model(pm, model, reference, losses_for(model),
                                   lambda: tf.keras.optimizers.Adam(0.01), GLOBAL_BATCH)
    assert_looped(pm)


def compute_ops(function):
    """Op types of a split function's graph, without its arguments and pass-throughs."""
    return collections.Counter(op.type for op in function.graph.get_operations()
                               if op.type not in ("Placeholder", "Identity", "NoOp"))


def test_zb_h1_input_and_weight_functions_do_the_backwards_work_once():
    model = small_conv()
    plan = straight_plan([2], len(layer_order(model)), 4, GLOBAL_BATCH, schedule="zb-h1")
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=True)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    pm.gradients(*data_for(model, GLOBAL_BATCH, seed=7))
    splits = list(pm.pipeline_step.stage_splits.values())
    assert len(splits) == 2
    for split in splits:
        fused = compute_ops(split.backward_function)
        assert compute_ops(split.input_function) + compute_ops(split.weight_function) == fused
        # the weight products are W's: none in I
        weight_products = {"Conv2DBackpropFilter", "BiasAddGrad"} & set(fused)
        assert weight_products and not weight_products & set(compute_ops(split.input_function))


def looped_step_graph(schedule):
    """The traced step graph of a looped 2-stage pipeline of `mlp_with_skip`, M = 4."""
    model = mlp_with_skip()
    pm = dapple.PipelinedModel(model, straight_plan([2], 5, 4, 16, schedule=schedule),
                               pipeline_loop=True)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, 16, seed=0)
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    graph = fn.get_concrete_function(x, y).graph
    return graph


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_loop_variables_start_on_their_units_devices(schedule):
    """A lowered loop variable's Enter, Merge, Switch and NextIteration go where its first
    value was made: one made on the default device would cross devices every iteration."""
    graph = looped_step_graph(schedule)
    (loop,) = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    floats = [t for t in loop.inputs if t.dtype.is_floating]
    assert all(t.op.device for t in floats), [t.op.name for t in floats if not t.op.device]
    assert len({t.op.device for t in floats}) == 2      # both stages' sums, tokens, values


def deep_mlp(depth):
    """`depth` Dense(8) layers and a classifier: a variable pair and residuals per layer."""
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((6,))
    h = x
    for _ in range(depth):
        h = tf.keras.layers.Dense(8, activation="relu")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(5)(h))


def _device(name: str) -> str:
    return tf.DeviceSpec.from_string(name).to_string() if name else ""


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_every_loop_variable_stays_on_its_device_across_iterations(schedule):
    """Each loop variable's value for the next iteration is made where the variable lives (the
    device of its first value, where its Merge and NextIteration go): a body output made
    elsewhere, as the while loop's own return Identity was when left to the placer, costs a
    send there and back every iteration."""
    graph = looped_step_graph(schedule)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops
    checked = 0
    for loop in loops:
        body = library[loop.get_attr("body").name]
        nodes = {n.name: n for n in body.node_def}
        for arg, start in zip(body.signature.output_arg, loop.inputs):
            if start.dtype == tf.resource or not start.op.device:
                continue        # invariants pass through; the loop's own counter
            returned = nodes.get(body.ret[arg.name].split(":")[0])
            if returned is None:
                continue        # an argument returned as it came
            assert _device(returned.device) == _device(start.op.device), (
                loop.name, returned.name, returned.device, start.op.device)
            checked += 1
    assert checked >= 2 * len(loops)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_loop_variables_do_not_grow_with_the_stages_depth(schedule):
    """Every loop variable runs executor nodes each iteration, so a loop adds gradients into
    variables (no sums carried) and packs small carried or collected tensors by dtype: the
    loops' tensors in and out do not grow from 2 to 8 layers a stage (resources, the
    accumulators' handles, pass through)."""
    counts = []
    for depth in (4, 16):
        model = deep_mlp(depth)
        n = len(layer_order(model))
        pm = dapple.PipelinedModel(model, straight_plan([n // 2], n, 4, 16, schedule=schedule),
                                   pipeline_loop=True)
        pm.compile(optimizer="sgd", loss=losses_for(model))
        x, y = data_for(model, 16, seed=0)
        fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
        graph = fn.get_concrete_function(x, y).graph
        loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
        assert loops
        counts.append(sum(t.dtype != tf.resource for op in loops for t in op.inputs))
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("flags, looped", [({}, True), ({"micro_batch_loop": False}, False),
                                            ({"pipeline_loop": False}, False),
                                            ({"micro_batch_loop": False, "pipeline_loop": True},
                                             True)])
def test_pipelines_run_as_loops_unless_told_not_to(flags, looped):
    """Loops by default; `micro_batch_loop=False` unrolls every step, `pipeline_loop` decides
    for pipelines alone."""
    model = mlp_with_skip()
    pm = dapple.PipelinedModel(model, straight_plan([2], 5, 4, GLOBAL_BATCH), **flags)
    pm.compile(tf.keras.optimizers.SGD(0.1), losses_for(model))
    pm.train_step(*data_for(model, GLOBAL_BATCH, seed=1))
    assert_looped(pm, looped)


def test_looped_fit_evaluate_with_sample_weights_two_outputs_equal_plain_keras():
    loss = [tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            tf.keras.losses.MeanSquaredError()]
    pm, plain = pair(two_in_two_out, replicas=(1, 2), m=4, loss=loss, cuts=(2,),
                     weighted_metrics=["mae"], loop=True)
    x, y = data_for(plain, ROWS, seed=9)
    sw = [weights_for(ROWS, 1), weights_for(ROWS, 2)]
    h1 = pm.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    h2 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, sample_weight=sw)
    assert_same(pm, plain, h1, h2, keys=["cls_loss", "cls_mae", "loss", "reg_loss", "reg_mae"])
    assert_looped(pm)


@pytest.mark.parametrize("builder,cuts,replicas,m,schedule",
                         [(dense_batchnorm, [2], [2, 1], 4, "1f1b"),
                          (conv_batchnorm, [3], [1, 2], 8, "1f1b"),
                          (conv_batchnorm, [3], [2, 1], 4, "gpipe"),
                          (dense_batchnorm, [2], [2, 1], 4, "zb-h1"),
                          (conv_batchnorm, [3], [1, 2], 8, "zb-h1"),
                          (conv_batchnorm, [2, 4, 6], [1, 1], 8, "interleaved")],
                         ids=["dense-2:1-M4-1f1b", "conv-1:2-M8-1f1b", "conv-2:1-M4-gpipe",
                              "dense-2:1-M4-zb-h1", "conv-1:2-M8-zb-h1",
                              "conv-1:1-M8-interleaved"])
def test_looped_moving_statistics_after_three_steps_equal_plain_keras(builder, cuts, replicas, m,
                                                                      schedule):
    model, reference = builder(), builder()
    plan = plan_of(cuts, m, schedule, replicas, len(layer_order(model)), 16)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=True)
    # No weight update: plain Keras normalizes the whole batch, the pipeline each slice, so
    # their gradients (and then their statistics) would part after the first step.
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss=loss)
    reference.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss=loss)
    rng = np.random.RandomState(0)
    for _ in range(3):
        x = (rng.randn(16, *model.input.shape[1:]) * 2.0 + 1.5).astype("float32")
        y = rng.randint(0, 3, 16).astype("int32")
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
    assert_looped(pm)
    initial = {v.name: v.numpy() for v in builder().non_trainable_variables}
    want = {v.name: v.numpy() for v in reference.non_trainable_variables}
    got = {v.name: v.numpy() for v in model.non_trainable_variables}
    assert sorted(got) == sorted(want) and got
    for name in want:
        assert np.max(np.abs(want[name] - initial[name])) > 1e-2, f"{name} did not move"
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)


def step_calls(m, loop=True, schedule="A"):
    """Function-call ops of the traced step's own graph (a loop's body is one While op)."""
    model = mlp_with_skip()
    plan = plan_of([1, 2, 3] if schedule == "interleaved" else [2], m, schedule, [1, 1],
                   batch=4 * m)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=loop)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, 4 * m, seed=0)
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    graph_def = fn.get_concrete_function(x, y).graph.as_graph_def()
    ops = collections.Counter(n.op for n in graph_def.node)
    return sum(ops[c] for c in CALLS), ops["While"]


@pytest.mark.parametrize("schedule,loops,m", [("1f1b", 1, 4), ("gpipe", 2, 4), ("zb-h1", 1, 4),
                                              ("interleaved", 1, 8)])
def test_the_steps_calls_do_not_grow_with_the_micro_batches(schedule, loops, m):
    """Interleaved from M = 8: at M = 4 its steady part (groups of 2) is a single period."""
    (calls4, loops4), (calls16, loops16) = step_calls(m, True, schedule), step_calls(16, True,
                                                                                      schedule)
    assert loops4 == loops16 == loops
    assert calls4 == calls16        # warm-up and cool-down (GPipe's loops leave none)
    # Unrolled, the same count grows with M: the test would see a step that does not loop.
    (unrolled4, none4), (unrolled16, none16) = (step_calls(m, False, schedule),
                                                step_calls(16, False, schedule))
    assert none4 == none16 == 0
    assert unrolled16 > unrolled4


def deep_normalized(depth, normalization, seed=0):
    """`depth` x (Dense -> `normalization`), then Dense."""
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6,), name="x")
    h = x
    for i in range(depth):
        h = normalization(name=f"norm{i}")(tf.keras.layers.Dense(6)(h))
    return tf.keras.Model(x, tf.keras.layers.Dense(3, name="out")(h))


def deep_layer_norm(depth):
    """Each LayerNormalization adds small residuals (and no moving statistics, which a loop
    collects per BatchNormalization call)."""
    return deep_normalized(depth, tf.keras.layers.LayerNormalization)


def deep_batch_norm(depth):
    """Each BatchNormalization adds a pair of moving statistics the step collects from every
    forward."""
    return deep_normalized(depth, tf.keras.layers.BatchNormalization)


def call_site_ops(depth, schedule, m=8, builder=deep_layer_norm, bodies_only=False):
    """Ops of the traced step's own graph and of its loops' bodies (or of the bodies alone),
    not of the functions they call, for `builder(depth)` cut in the middle."""
    model = builder(depth)
    layers = len(layer_order(model))
    plan = plan_of([layers // 2] if schedule != "interleaved" else
                   [layers // 4, layers // 2, 3 * layers // 4], m, schedule, [1, 1], layers, 4 * m)
    pm = dapple.PipelinedModel(model, plan)
    pm.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
    x = np.random.RandomState(0).randn(4 * m, 6).astype("float32")
    y = np.zeros(4 * m, "int32")
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    graph_def = fn.get_concrete_function(x, y).graph.as_graph_def()
    functions = {f.signature.name: f for f in graph_def.library.function}
    nodes = list(graph_def.node)
    bodies = [n.attr["body"].func.name for n in nodes if n.op in ("While", "StatelessWhile")]
    assert bodies, "no loop"
    if bodies_only:
        nodes = []
    for body in bodies:
        nodes += list(functions[body].node_def)
    return collections.Counter(n.op for n in nodes)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "interleaved"])
def test_residuals_add_no_ops_where_they_are_carried(schedule):
    """A stage's residuals are packed inside its forward's function and unpacked inside its
    backward's: three more normalized layers per stage add no Reshape, split or
    concat at the call sites (unpacked there, each residual added a Reshape at each end of
    every iteration and at every warm-up and cool-down call)."""
    shallow, deep = call_site_ops(2, schedule), call_site_ops(8, schedule)
    for op in ("Reshape", "SplitV", "Split", "ConcatV2"):
        assert deep[op] == shallow[op], (op, shallow[op], deep[op])


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_loop_body_collects_batch_statistics_in_as_many_ops_whatever_the_layers(schedule):
    """Each forward in a loop's body returns its BatchNormalization statistics joined inside
    its function, so the body writes one row of each per forward: three more normalized
    layers per stage add no Reshape or concat to the body (joined there, each layer added a
    Reshape per statistic per forward)."""
    shallow = call_site_ops(2, schedule, builder=deep_batch_norm, bodies_only=True)
    deep = call_site_ops(8, schedule, builder=deep_batch_norm, bodies_only=True)
    for op in ("Reshape", "ConcatV2"):
        assert deep[op] == shallow[op], (op, shallow[op], deep[op])


def weight_sends_per_step(pm, x, y, logdir) -> int:
    """Transfers between devices of variable values in one traced step, counted in a profiler
    trace of the step as it ran (each execution of a `_Send` of a `ReadVariableOp`'s value):
    the runtime's own account, whatever built the graph."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    pm.train_step(x, y).numpy()         # traced and optimized before the trace starts
    tf.profiler.experimental.start(str(logdir))
    pm.train_step(x, y).numpy()
    tf.profiler.experimental.stop()
    (path,) = logdir.glob("**/*.xplane.pb")
    space = xplane_pb2.XSpace.FromString(path.read_bytes())
    names = [plane.event_metadata[event.metadata_id].name for plane in space.planes
             for line in plane.lines for event in line.events]
    return sum(n.endswith(":_Send") and "ReadVariableOp" in n for n in names)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_looped_step_moves_each_weight_across_devices_at_most_twice(schedule, tmp_path):
    """The second stage's weights live on the first device (Keras makes every variable on the
    default one). A loop body reading them crossed devices every iteration, in the forward and
    again in the split backward; a looped step reads copies on the stage's device instead,
    refreshed once a step: each weight out and its gradient sum back, twice per variable at
    most, whatever M. Unrolled, the same count grows with M (the count sees the reads)."""
    model = deep_mlp(8)
    n = len(layer_order(model))
    counts = {}
    for loop in (True, False):
        pm = dapple.PipelinedModel(model, straight_plan([n // 2], n, 8, 16, schedule=schedule),
                                   pipeline_loop=loop)
        pm.compile(optimizer="sgd", loss=losses_for(model))
        x, y = data_for(model, 16, seed=0)
        counts[loop] = weight_sends_per_step(pm, x, y, tmp_path / str(loop))
        assert_looped(pm, loop)
    variables = len(model.trainable_variables)
    assert counts[True] <= 2 * variables < counts[False], counts


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_an_inlined_split_function_has_one_call_site(schedule):
    """The optimizer rewrites an inlined function's copy at every call site: a split function
    is inlined only where a loop body calls it once, and otherwise called as one function
    (warm-up and cool-down; interleaved's body, two micro-batches a chunk). Inlined at each of
    interleaved's sites, MobileNetV2's first call at M = 16 was 2.4 times M = 2's."""
    model = mlp_with_skip()
    plan = plan_of([1, 2, 3] if schedule == "interleaved" else [2], 8, schedule, [1, 1],
                   batch=32)
    pm = dapple.PipelinedModel(model, plan, pipeline_loop=True)
    pm.compile(optimizer="sgd", loss=losses_for(model))
    x, y = data_for(model, 32, seed=0)
    fn = tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients)
    graph_def = fn.get_concrete_function(x, y).graph.as_graph_def()
    assert_looped(pm)
    library = {f.signature.name: f for f in graph_def.library.function}
    inlined = [f for f in library.values() if not f.attr["_noinline"].b]
    # Sites in the step and what is inlined into it (loop bodies); a `_noinline` function is
    # optimized once, whoever calls it, so a call inside it is one copy.
    nodes = list(graph_def.node) + [n for f in inlined for n in f.node_def]
    sites = collections.Counter(n.attr["f"].func.name for n in nodes if n.op in CALLS)
    inlinable = {name: n for name, n in sites.items()
                 if not library[name].attr["_noinline"].b}
    assert max(inlinable.values(), default=0) <= 1, inlinable
