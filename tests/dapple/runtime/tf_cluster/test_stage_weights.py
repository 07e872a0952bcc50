"""Each stage's weights kept and trained on the stage's first device
(`dapple.runtime.tf_cluster.stage_weights`), on logical CPU devices of one process where the
model's variables live on the first: training equals plain Keras's, the optimizer's slots and
updates are on the stage's device and the model's variables are untouched until gathered, and
the model's values reach the stages again whenever they may have changed (between calls,
`load_weights`, a second `compile`) without ever overwriting training not yet gathered."""
import dapple  # noqa: F401  (Keras 2 and logical devices first)
import numpy as np
import pytest
import tensorflow as tf

from dapple.runtime.tf_cluster.stage_weights import ENV_WEIGHTS, StageWeightsRuntime
from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models

BATCH = 24


def pipelined(model, cuts=(2,), replicas=(1, 1), schedule="1f1b", micro_batches=4):
    plan = straight_plan(list(cuts), len(layer_order(model)), micro_batches, BATCH,
                         replicas=list(replicas), schedule=schedule)
    pm = dapple.PipelinedModel(model, plan)
    pm.runtime = StageWeightsRuntime(plan)
    return pm


def momentum():
    return tf.keras.optimizers.SGD(0.1, momentum=0.9)


def plain_step(reference, optimizer, x, y):
    loss = models.losses_for(reference)
    _, grads = models.plain_loss_and_grads(reference, loss, x, y)
    optimizer.apply_gradients(zip(grads, reference.trainable_variables))


def assert_same_weights(model, reference):
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("builder, cuts, replicas, schedule, micro_batches", [
    (models.mlp_with_skip, [2], [1, 1], "1f1b", 4),
    (models.mlp_with_skip, [2], [1, 2], "gpipe", 2),          # a replica refreshes from home
    (models.mlp_with_skip, [], [2], "1f1b", 2),               # lanes as loops
    (models.mlp_with_skip, [2], [1, 1], "zb-h1", 4),          # split backward
    (models.dense_batchnorm, [2], [1, 1], "1f1b", 1),
], ids=["2-stage", "1:2", "dp2-loop", "zb-h1", "batchnorm"])
def test_training_on_the_stages_devices_equals_plain_keras(builder, cuts, replicas, schedule,
                                                            micro_batches):
    model, reference = builder(seed=3), builder(seed=3)
    pm = pipelined(model, cuts, replicas, schedule, micro_batches)
    models.assert_trains_like_plain_model(pm, model, reference, models.losses_for(model),
                                          momentum, BATCH)


def test_the_optimizer_trains_each_stage_on_its_device_and_the_model_when_gathered():
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    pm.compile(optimizer=momentum(), loss=models.losses_for(model))
    second = tf.DeviceSpec.from_string(pm.pipeline_step.device(1, 0)).device_index
    stage1 = pm.pipeline_step.stages[1].trainable_variables
    before = [v.numpy() for v in stage1]
    ref_opt = momentum()
    for step in range(2):
        x, y = models.data_for(model, BATCH, seed=step)
        pm.train_step(x, y)
        plain_step(reference, ref_opt, x, y)
    for v, old in zip(stage1, before):                 # trained elsewhere: not read back yet
        np.testing.assert_array_equal(v.numpy(), old)
    slots = [s for s in pm.optimizer.variables if "/" in s.name]    # momentum/<variable>
    on_second = [s for s in slots if tf.DeviceSpec.from_string(s.device).device_index == second]
    assert len(on_second) == len(stage1), [(s.name, s.device) for s in slots]
    pm.gather_weights()
    assert_same_weights(model, reference)


def test_changes_to_the_model_between_calls_reach_the_stages():
    model = models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    pm.compile(optimizer=momentum(), loss=models.losses_for(model))
    x, y = models.data_for(model, BATCH, seed=1)
    pm.train_step(x, y)
    pm.evaluate(x, y)
    pm.gather_weights()
    other = models.mlp_with_skip(seed=7)
    model.set_weights(other.get_weights())              # the user's code, between calls
    want = other.predict(x, verbose=0)
    np.testing.assert_allclose(pm.predict(x), want, rtol=1e-5, atol=1e-6)
    model.set_weights(models.mlp_with_skip(seed=3).get_weights())
    np.testing.assert_allclose(pm.predict(x), models.mlp_with_skip(seed=3).predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_load_weights_wins_over_training_not_gathered(tmp_path):
    model = models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=models.losses_for(model))
    path = str(tmp_path / "w.h5")
    pm.save_weights(path)
    x, y = models.data_for(model, BATCH, seed=1)
    for _ in range(2):
        pm.train_step(x, y)
    pm.load_weights(path)
    np.testing.assert_allclose(pm.predict(x), models.mlp_with_skip(seed=3).predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_compile_again_keeps_what_was_trained():
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    pm.compile(optimizer=momentum(), loss=models.losses_for(model))
    x, y = models.data_for(model, BATCH, seed=1)
    pm.train_step(x, y)
    plain_step(reference, momentum(), x, y)
    pm.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss=models.losses_for(model))
    pm.train_step(x, y)
    plain_step(reference, tf.keras.optimizers.SGD(0.05), x, y)
    pm.gather_weights()
    assert_same_weights(model, reference)


def test_training_not_gathered_is_not_overwritten_by_the_model():
    """A user's loop of train_step: each call says the model may have changed; the stages'
    newer weights must win until gathered."""
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    pm.compile(optimizer=momentum(), loss=models.losses_for(model))
    ref_opt = momentum()
    for step in range(3):
        x, y = models.data_for(model, BATCH, seed=step)
        pm.train_step(x, y)
        pm.evaluate(x, y)
        plain_step(reference, ref_opt, x, y)
    pm.gather_weights()
    assert_same_weights(model, reference)


@pytest.mark.parametrize("mode, copies", [("chief", False), ("copies", True)])
def test_the_other_placements_still_train_like_plain_keras(monkeypatch, mode, copies):
    monkeypatch.setenv(ENV_WEIGHTS, mode)
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    models.assert_trains_like_plain_model(pm, model, reference, models.losses_for(model),
                                          momentum, BATCH)
    step = pm.pipeline_step
    assert bool(step.functions[1].copies.on(step.device(1, 0))) == copies
    assert step.functions[1].copies.home is None


def test_a_bad_placement_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_WEIGHTS, "gpu")
    model = models.mlp_with_skip(seed=3)
    pm = pipelined(model)
    with pytest.raises(ValueError, match="DAPPLE_TF_WEIGHTS='gpu': expected one of stage"):
        pm.compile(optimizer="sgd", loss=models.losses_for(model))


def test_replicas_train_their_own_copies_with_the_same_updates():
    """1:2: stage 1's replicas (devices 1 and 2) each sum both replicas' gradients on their own
    device and take the same update, with slots of their own; nothing is refreshed."""
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model, replicas=(1, 2), schedule="gpipe", micro_batches=2)
    models.assert_trains_like_plain_model(pm, model, reference, models.losses_for(model),
                                          momentum, BATCH)
    step = pm.pipeline_step
    assert step.sum_on_every_replica == {1}
    copies = step.functions[1].copies
    third = step.device(1, 1)
    assert copies.trained == [step.device(1, 0), third]
    for copy, v in zip(copies.on(third), copies.variables):
        np.testing.assert_array_equal(copy.numpy(), v.numpy())     # gathered from replica 0
    index = tf.DeviceSpec.from_string(third).device_index
    slots = [s for s in pm.optimizer.variables if "/" in s.name
             and tf.DeviceSpec.from_string(s.device).device_index == index]
    assert len(slots) == len(copies.variables)


def test_under_global_clipnorm_replicas_refresh_from_the_first():
    model, reference = models.mlp_with_skip(seed=3), models.mlp_with_skip(seed=3)
    pm = pipelined(model, replicas=(1, 2), schedule="gpipe", micro_batches=2)
    models.assert_trains_like_plain_model(
        pm, model, reference, models.losses_for(model),
        lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05), BATCH)
    assert pm.pipeline_step.sum_on_every_replica == set()
    assert pm.pipeline_step.functions[1].copies.trained == [pm.pipeline_step.device(1, 0)]


def _update_math_off_its_device(placed: bool):
    """The ops of one momentum update of weights on devices 0 and 1 (each one's gradient made
    on its device) that read something on device 1 but are not placed there."""
    from dapple.runtime.tf_cluster.stage_weights import apply_beside_weights
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    weights = []
    for device in devices:
        with tf.device(device):
            weights += [tf.Variable(tf.ones([4, 3])), tf.Variable(tf.zeros([3]))]
    optimizer = momentum()
    optimizer.build(weights)

    def update():
        grads = []
        for w in weights:
            with tf.device(w.device):
                grads.append(tf.ones_like(w) * 0.5)
        if placed:
            apply_beside_weights(optimizer, zip(grads, weights), devices)
        else:
            optimizer.apply_gradients(zip(grads, weights))

    graph = tf.function(update).get_concrete_function().graph
    on_1 = {inner.name for outer, inner in graph.captures
            if getattr(outer, "device", "").endswith("CPU:1")}

    def on_device_1(t):      # placed there, a handle of a variable there, or a read of one
        return (t.device.endswith("CPU:1") or t.name in on_1
                or any(h.name in on_1 for h in t.op.inputs if h.dtype == tf.resource))
    ops = [op for op in graph.get_operations()
           if op.type not in ("ReadVariableOp", "Placeholder") and op.inputs
           and any(on_device_1(t) for t in op.inputs)]
    assert len(ops) >= 3 * len(weights) // 2, [op.type for op in graph.get_operations()]
    return [f"{op.name} ({op.type})" for op in ops if not op.device.endswith("CPU:1")]


def test_the_optimizer_updates_a_stage_beside_its_weights():
    """Keras's optimizer leaves its update math unplaced (on a cluster: the chief's device, so a
    remote stage's gradients, slots and new values would cross the network every step) and
    passes every gradient through one op; `apply_beside_weights` runs every op that reads
    something on a stage's device there."""
    assert _update_math_off_its_device(placed=False) != []     # what it is for
    assert _update_math_off_its_device(placed=True) == []
