"""`PipelinedModel(inline_stage_calls=True)`: an unrolled step's stage calls may be inlined into
it (in one process they stay out of line by default; across processes the runtimes inline
them, tests/dapple/runtime). References: the traced step's own function library (which calls
the graph optimizer may inline) and the plain Keras model, trained alike."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from planner.formats.plan import straight_plan
from planner.search.chunking import interleaved_plan
from tests.graph_rewrite.test_gradient_sums import LOSS, data, dense_mlp

PLANS = {
    "1f1b": lambda: straight_plan([2], 4, 4, 32, schedule="1f1b"),
    "gpipe-2:1": lambda: straight_plan([2], 4, 4, 32, replicas=[2, 1], schedule="gpipe"),
    "interleaved": lambda: interleaved_plan([1, 2, 3], 4, 4, 2, 32, [1, 1]),
    # F, I and W: the split backward's functions inlined as the stage's calls are
    "zb-h1": lambda: straight_plan([2], 4, 4, 32, schedule="zb-h1"),
    # looped (the default in one process): a loop body calls the stage as before
    "1f1b-looped": lambda: straight_plan([2], 4, 4, 32, schedule="1f1b"),
    "data-parallel-looped": lambda: straight_plan([], 4, 4, 32, replicas=[2]),
}


def traced_step(pm, x, y) -> tf.Graph:
    return tf.function(lambda x, y: pm.pipeline_step.run(x, y).gradients).get_concrete_function(
        x, y).graph


def calls(graph: tf.Graph):
    """[(called function, whether it is kept out of line)] for every call op of `graph` (a
    traced step)."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    names = [op.get_attr("f").name for op in graph.get_operations()
             if op.type in ("StatefulPartitionedCall", "PartitionedCall")]
    return [(n, "_noinline" in library[n].attr) for n in names]


def stage_calls(pm, x, y):
    """{called function: whether it is kept out of line} for the stage calls of the traced
    step (their forward functions and the backward functions TensorFlow derives from them)."""
    return {n: kept for n, kept in calls(traced_step(pm, x, y)) if "_forward" in n}


def split_calls(pm, x, y):
    """[whether it is kept out of line] for each call of the split stages' F, I and W in the
    traced step (zb-h1)."""
    return [kept for n, kept in calls(traced_step(pm, x, y))
            if any(part in n for part in ("_forward_packed", "_input_packed", "_weight_packed"))]


def unrolled(name: str, inline):
    """PLANS[name] unrolled, compiled with SGD, `inline_stage_calls=inline`."""
    pm = dapple.PipelinedModel(dense_mlp(), PLANS[name](), micro_batch_loop=False,
                               inline_stage_calls=inline)
    pm.compile(optimizer="sgd", loss=LOSS)
    return pm


@pytest.mark.parametrize("inline", [False, True])
def test_a_split_backward_is_inlined_with_the_stage_calls(inline):
    pm = unrolled("zb-h1", inline)
    kept = split_calls(pm, *data(32, 0))
    assert len(kept) == 3 * 4 * 2, kept      # F, I and W of 4 micro-batches on 2 stages
    assert set(kept) == {not inline}, kept


@pytest.mark.parametrize("inline", [None, False, True])
def test_the_stage_calls_stay_out_of_line_unless_asked(inline):
    pm = unrolled("1f1b", inline)
    found = stage_calls(pm, *data(32, 0))
    assert len(found) == 4, found          # 2 stages: a forward and a backward function each
    assert set(found.values()) == {not inline}, found


@pytest.mark.parametrize("inline", [False, True])
def test_the_gradient_sums_are_added_in_the_step_when_its_stage_calls_are_inlined(inline):
    pm = unrolled("1f1b", inline)
    graph = traced_step(pm, *data(32, 0))
    adds = [kept for n, kept in calls(graph) if "_in_place" in n or "_assign_sums" in n]
    in_step = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    if inline:      # 4 micro-batches: the first two set each sum, the last two add to it
        assert adds == [] and len(in_step) == 2 * len(pm.model.trainable_variables), in_step
    else:
        assert adds and set(adds) == {True} and in_step == [], (adds, in_step)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_inlined_stage_calls_train_as_the_plain_model_does(name):
    pm = dapple.PipelinedModel(dense_mlp(), PLANS[name](),
                               micro_batch_loop=name.endswith("-looped"), inline_stage_calls=True)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    assert all(f.inlined for f in pm.pipeline_step.functions)
    plain = dense_mlp()
    plain.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=LOSS)
    for seed in (1, 2, 3):
        x, y = data(32, seed)
        pm.train_step(x, y)
        plain.train_on_batch(x, y)
    for a, b in zip(pm.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    looped = pm.pipeline_step.schedule_loops + sum(l.traces for l in pm.pipeline_step.lane_loops)
    assert (looped > 0) == name.endswith("-looped")
