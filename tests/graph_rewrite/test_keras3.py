"""Keras 3 models (`import keras`, the Keras TensorFlow ships) through `PipelinedModel`, the thin
path of #30 (docs/keras3.md): a functional model cut into stages on the local runtime computes
the plain Keras 3 model's gradients, and trains to its weights. The references are Keras 3's
own: a `tf.GradientTape` step of the plain model, and the plain model's `train_on_batch` with
the same Keras 3 optimizer; never dapple's code. What the path does not support yet is refused
by name.
"""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import numpy as np
import pytest
import tensorflow as tf

from graph_rewrite.model_graph import layer_order
from planner.formats.plan import straight_plan
from tests import models
from tests.models import assert_ran_as_loops
from tests import keras3_models
from tests.keras3_models import keras, loss_fn, mlp_with_skip, residual_bn_shared, two_in_two_out


GLOBAL_BATCH = 24


def shared_dense(seed=0):
    """`shared` is called twice: on d1's output and, after d2, on the sum."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    h1 = keras.layers.Dense(6, activation="relu", name="d1")(x)
    a = shared(h1)
    h2 = keras.layers.Dense(6, activation="tanh", name="d2")(a)
    b = shared(keras.layers.Add(name="add")([h1, h2]))
    return keras.Model(x, keras.layers.Dense(5, name="out")(b), name="k3_shared")


def sequential_mlp(seed=0):
    """A built Keras 3 Sequential: its graph is its `_functional`'s."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh",
                                                                   name="d1"),
                             keras.layers.Dense(8, activation="relu", name="d2"),
                             keras.layers.Dense(5, name="out")], name="k3_sequential")


def data(seed):
    return keras3_models.data(GLOBAL_BATCH, seed)


def plan_for(model, cuts, replicas, micro_batches=4):
    return straight_plan(cuts, len(layer_order(model)), micro_batches, GLOBAL_BATCH,
                         replicas=replicas, schedule="1f1b")


CASES = [
    # (builder, cut positions, replicas)
    (mlp_with_skip, [2], [1, 1]),          # the skip d1 -> add crosses the cut
    (mlp_with_skip, [1], [2, 1]),          # 2:1 on 3 devices
    (shared_dense, [2], [1, 1]),           # the shared layer's calls in both stages
    (sequential_mlp, [1], [1, 2]),         # a Sequential, 1:2
]


def case_id(case):
    builder, cuts, replicas = case
    return f"{builder.__name__}-{':'.join(map(str, replicas))}-cuts{cuts}"


def cases(*indices):
    """pytest.mark.parametrize over CASES (those at `indices`, or all)."""
    chosen = [CASES[i] for i in indices] if indices else CASES
    return pytest.mark.parametrize("case", chosen, ids=[case_id(c) for c in chosen])


def pipelined(case):
    """(model, its plain twin with the same weights, the model's PipelinedModel)."""
    builder, cuts, replicas = case
    model, reference = builder(), builder()
    return model, reference, dapple.PipelinedModel(model, plan_for(model, cuts, replicas))


@cases()
def test_gradients_equal_plain_keras3_model(case):
    model, reference, pm = pipelined(case)
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    x, y = data(seed=7)
    got = pm.gradients(x, y)
    with tf.GradientTape() as tape:
        want_loss = loss_fn()(y, reference(x, training=True))
    want = tape.gradient(want_loss, reference.trainable_variables)
    assert [v.path for v in model.trainable_variables] == \
        [v.path for v in reference.trainable_variables]
    assert len(got) == len(want) == len(model.trainable_variables)
    for g, w, v in zip(got, want, model.trainable_variables):
        assert float(np.max(np.abs(np.asarray(w)))) > 0, v.path    # the test can fail
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=v.path)


@cases(0, 2)
def test_weights_after_three_steps_equal_train_on_batch(case):
    model, reference, pm = pipelined(case)
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn())
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn(),
                      jit_compile=False)
    before = [np.array(w) for w in model.get_weights()]
    for step in range(3):
        x, y = data(seed=100 + step)          # different data every step
        got_loss = pm.train_step(x, y)
        want_loss = reference.train_on_batch(x, y)
        assert abs(float(got_loss) - float(want_loss)) < 1e-5
    for got, want, start in zip(model.get_weights(), reference.get_weights(), before):
        assert np.max(np.abs(want - start)) > 1e-3           # the weights did train
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@cases(1, 3)
def test_predict_equals_plain_keras3_predict(case):
    """Before compile, in global batches, the last one partial (padded, its padding dropped)."""
    model, reference, pm = pipelined(case)
    x = np.random.RandomState(5).randn(2 * GLOBAL_BATCH + 5, 6).astype("float32")
    got = pm.predict(x)
    want = reference.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    assert got.shape == want.shape == (2 * GLOBAL_BATCH + 5, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@cases(0, 3)
def test_evaluate_equals_plain_keras3_evaluate(case):
    model, reference, pm = pipelined(case)
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn(), jit_compile=False)
    rng = np.random.RandomState(9)
    x = rng.randn(3 * GLOBAL_BATCH, 6).astype("float32")
    y = rng.randint(0, 5, size=3 * GLOBAL_BATCH).astype("int32")
    got = pm.evaluate(x, y, batch_size=GLOBAL_BATCH)
    want = reference.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    assert abs(float(got) - float(want)) < 1e-5
    assert pm.evaluate(x, y, return_dict=True) == {"loss": got}


def test_dict_inputs_and_two_outputs_train_like_plain_keras3():
    """Losses per output with loss_weights; 3 stages (1:2:1), the input `b` entering late."""
    model, reference = two_in_two_out(), two_in_two_out()
    losses = [loss_fn(), keras.losses.MeanSquaredError()]
    weights = [1.0, 0.5]
    pm = dapple.PipelinedModel(model, plan_for(model, [1, 4], [1, 2, 1]))
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses, loss_weights=weights)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses, loss_weights=weights,
                      jit_compile=False)
    for step in range(2):
        rng = np.random.RandomState(20 + step)
        x = {"a": rng.randn(GLOBAL_BATCH, 4).astype("float32"),
             "b": rng.randn(GLOBAL_BATCH, 3).astype("float32")}
        y = [rng.randint(0, 3, size=GLOBAL_BATCH).astype("int32"),
             rng.randn(GLOBAL_BATCH, 1).astype("float32")]
        got_loss = pm.train_step(x, y)
        want_loss = reference.train_on_batch(x, y)
        want_loss = want_loss[0] if isinstance(want_loss, list) else want_loss
        assert abs(float(got_loss) - float(want_loss)) < 1e-5
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_optimizer", [lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                            lambda: keras.optimizers.Adam(0.01)],
                         ids=["sgd_momentum", "adam"])
def test_train_step_traces_the_pipeline_once(make_optimizer):
    """Keras 3's optimizer variables are built before the step is traced (else TensorFlow
    traces the whole pipeline twice: tests/dapple/test_trace_once.py)."""
    from tests.dapple.test_trace_once import counting_runs
    model, _, pm = pipelined(CASES[1])
    pm.compile(optimizer=make_optimizer(), loss=loss_fn())
    calls = counting_runs(pm)
    x, y = data(seed=4)
    pm.train_step(x, y)
    pm.train_step(x, y)
    assert len(calls) == 1


@cases(0, 3)
def test_fit_equals_plain_keras3_fit(case, capsys):
    """Two epochs of 3 global batches, unshuffled, with validation data, compiled metrics and a
    Keras 3 callback: History (loss, metrics, their val_) and weights as the plain model's
    `fit`; `evaluate`'s dict as its."""
    model, reference, pm = pipelined(case)
    metrics = ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")]
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn(),
               metrics=metrics)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn(),
                      jit_compile=False, metrics=[
                          "accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2,
                                                                                   name="top2")])
    rng = np.random.RandomState(11)
    x = rng.randn(3 * GLOBAL_BATCH, 6).astype("float32")
    y = rng.randint(0, 5, size=3 * GLOBAL_BATCH).astype("int32")
    val = (x[:GLOBAL_BATCH] * 0.5, y[:GLOBAL_BATCH])
    seen = []
    got = pm.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=1,
                 validation_data=val, callbacks=[keras.callbacks.LambdaCallback(
                     on_epoch_end=lambda epoch, logs: seen.append(epoch))])
    want = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                         validation_data=val)
    assert seen == [0, 1] and "3/3" in capsys.readouterr().out     # Keras 3's progress bar
    assert sorted(got.history) == sorted(want.history)
    for key in want.history:            # loss, accuracy, top2 and their val_
        np.testing.assert_allclose(got.history[key], want.history[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    assert pm.evaluate(*val, return_dict=True) == pytest.approx(
        reference.evaluate(*val, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True),
        rel=1e-5)
    for got_w, want_w in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_profile_counts_keras3_layers_parameters_and_edges():
    """`dapple.profile` on a Keras 3 model: its layers in Keras's order, each one's parameter
    bytes as Keras counts them, output bytes from Keras's output shapes, the skip edge."""
    model = mlp_with_skip()
    x, _ = data(seed=2)
    profile = dapple.profile(model, x, warmup=0, runs=1)
    names = [layer.name for layer in profile.layers]
    assert names == ["d1", "d2", "add", "d3", "out"]
    for layer in profile.layers:
        keras_layer = model.get_layer(layer.name)
        assert layer.parameter_bytes == 4 * keras_layer.count_params()
        assert layer.output_bytes == 4 * GLOBAL_BATCH * keras_layer.output.shape[-1]
        assert layer.forward_ms > 0
    assert sorted(profile.layers[names.index("add")].inputs) == [0, 1]
    assert profile.batch_size == GLOBAL_BATCH and profile.input_bytes == x.nbytes


def test_weights_saved_load_into_plain_keras3_and_back(tmp_path):
    """A pipelined model's checkpoint after a step is Keras 3's own file: the plain model's
    `load_weights` reads the trained weights; `PipelinedModel.load_weights` puts them back."""
    model, fresh, pm = pipelined(CASES[0])
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    pm.train_step(*data(seed=3))
    trained = [np.array(w) for w in model.get_weights()]
    path = str(tmp_path / "k3.weights.h5")
    pm.save_weights(path)
    with pytest.raises(ValueError, match=r"Keras 3 saves weights to a path ending \.weights\.h5"):
        pm.save_weights(str(tmp_path / "k3.h5"))
    fresh.load_weights(path)                                 # plain Keras 3 reads the file
    for got, want in zip(fresh.get_weights(), trained):
        np.testing.assert_array_equal(got, want)
    untrained = mlp_with_skip()                              # loaded under another plan
    pm_untrained = dapple.PipelinedModel(untrained, plan_for(untrained, [1], [2, 1]))
    assert not np.array_equal(untrained.get_weights()[0], trained[0])
    pm_untrained.load_weights(path)
    for got, want in zip(untrained.get_weights(), trained):
        np.testing.assert_array_equal(got, want)


def conv_bn(seed=0):
    """Conv2D -> BatchNormalization (axis -1 of a 4-D input) in both branches."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((4, 4, 2), name="x")
    a = keras.layers.BatchNormalization(name="bn")(keras.layers.Conv2D(3, 3, padding="same",
                                                                       name="c1")(x))
    b = keras.layers.BatchNormalization(momentum=0.7, name="bn2")(
        keras.layers.Conv2D(3, 1, name="c2")(x))
    h = keras.layers.Flatten(name="flat")(keras.layers.Add(name="add")([a, b]))
    return keras.Model(x, keras.layers.Dense(5, name="out")(h), name="k3_conv_bn")


BN_CASES = [
    # (builder, cuts, replicas, M, lanes as loops)
    (residual_bn_shared, [3], [2, 1], 4, False),    # the 2:1 on 3 devices, M = 4
    (conv_bn, [], [2], 4, True),                    # data parallel, each lane one loop
]


def bn_data(builder, seed):
    model_input = builder().input.shape[1:]
    rng = np.random.RandomState(seed)
    # an offset and a scale, so that mean and variance both move visibly
    return ((rng.randn(GLOBAL_BATCH, *model_input) * 2.0 + 1.5).astype("float32"),
            rng.randint(0, 5, size=GLOBAL_BATCH).astype("int32"))


def bn_pipelined(case, lr=0.1):
    builder, cuts, replicas, m, loop = case
    model = builder()
    plan = plan_for(model, cuts, replicas, micro_batches=m)
    pm = dapple.PipelinedModel(model, plan, micro_batch_loop=loop)
    pm.compile(optimizer=keras.optimizers.SGD(lr), loss=loss_fn())
    return model, pm


bn_cases = pytest.mark.parametrize("case", BN_CASES, ids=lambda c: c[0].__name__)


@bn_cases
def test_batch_normalization_gradients_equal_plain_keras3_per_slice(case):
    """Each slice normalizes with its own statistics (as in Keras 2: test_batch_normalization):
    the reference is a `tf.GradientTape` of the plain Keras 3 model run on the plan's slices
    (every BatchNormalization of these plans lies in a stage of one slice size)."""
    from tests.models import ghost_batch_loss_and_grads
    builder, cuts, replicas, m, _ = case
    model, pm = bn_pipelined(case)
    x, y = bn_data(builder, seed=3)
    got = pm.gradients(x, y)
    reference = builder()
    _, want = ghost_batch_loss_and_grads(reference, loss_fn(), x, y,
                                         GLOBAL_BATCH // (m * replicas[0]))
    assert len(got) == len(want) == len(model.trainable_variables)
    for g, w, v in zip(got, want, model.trainable_variables):
        assert float(np.max(np.abs(np.asarray(w)))) > 0, v.path    # the test can fail
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5,
                                   err_msg=v.path)
    _, whole = ghost_batch_loss_and_grads(reference, loss_fn(), x, y, GLOBAL_BATCH)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(got, whole)) > 1e-4           # slices do differ: not vacuous


@bn_cases
def test_batch_normalization_moving_statistics_equal_plain_keras3_train_on_batch(case):
    """One update per step from the whole global batch: the moving mean and variance after
    each of 2 steps equal the plain Keras 3 model's `train_on_batch`. The learning rate is 0:
    the weights a step trains differ by design (per-slice normalization, above), and so would
    the next step's batch statistics."""
    builder, cuts, replicas, m, loop = case
    model, pm = bn_pipelined(case, lr=0.0)
    reference = builder()
    reference.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss_fn(), jit_compile=False)
    initial = {v.path: v.numpy() for v in builder().non_trainable_variables}
    for step in range(2):
        x, y = bn_data(builder, seed=30 + step)
        pm.train_step(x, y)
        reference.train_on_batch(x, y)
        assert_ran_as_loops(pm, loop)
        got = {v.path: v.numpy() for v in model.non_trainable_variables}
        want = {v.path: v.numpy() for v in reference.non_trainable_variables}
        assert sorted(got) == sorted(want) == sorted(initial) and got
        for path in want:
            assert np.max(np.abs(want[path] - initial[path])) > 1e-2, f"{path} did not move"
            np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{path} after step {step + 1}")


@bn_cases
def test_batch_normalization_weights_after_three_steps_equal_plain_keras3(case):
    """Weights and moving statistics after 3 steps of SGD with momentum (different data each
    step) equal plain Keras 3's: its gradients slice by slice, its moving statistics moved by
    a training forward of the whole batch, its optimizer (`tests.models.
    ghost_batch_train_step`); the reference of the horovodrun test too."""
    builder, cuts, replicas, m, _ = case
    model, pm = bn_pipelined(case)
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn())
    reference, optimizer = builder(), keras.optimizers.SGD(0.1, momentum=0.9)
    before = [np.array(w) for w in model.get_weights()]
    for step in range(3):
        x, y = bn_data(builder, seed=40 + step)
        got_loss = pm.train_step(x, y)
        want_loss = models.ghost_batch_train_step(reference, loss_fn(), optimizer, x, y,
                                                  GLOBAL_BATCH // (m * replicas[0]))
        assert abs(float(got_loss) - want_loss) < 1e-5
    for got, want, start, v in zip(model.get_weights(), reference.get_weights(), before,
                                   model.weights):
        if not v.path.endswith(("d1/bias", "c1/bias", "c2/bias")):  # these feed a BN: grad 0
            assert np.max(np.abs(want - start)) > 1e-3, v.path      # every other weight moved
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=v.path)


def test_frozen_batch_normalization_keeps_its_statistics_like_plain_keras3():
    """A non-trainable BatchNormalization runs in inference mode in Keras 3 (`training and
    self.trainable`): its moving statistics stay, and gradients equal the plain model's."""
    case = BN_CASES[0]
    model, reference = residual_bn_shared(), residual_bn_shared()
    for m in (model, reference):
        m.get_layer("bn").trainable = False
    pm = dapple.PipelinedModel(model, plan_for(model, case[1], case[2], micro_batches=case[3]))
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    before = [v.numpy() for v in model.non_trainable_variables]
    assert len(before) == 4                  # bn's gamma and beta are frozen too
    x, y = bn_data(residual_bn_shared, seed=5)
    got = pm.gradients(x, y)
    with tf.GradientTape() as tape:
        want_loss = loss_fn()(y, reference(x, training=True))
    want = tape.gradient(want_loss, reference.trainable_variables)
    for g, w, v in zip(got, want, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=v.path)
    pm.train_step(x, y)
    for v, value in zip(model.non_trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)


def test_batch_normalization_options_that_cannot_be_pipelined_are_named():
    from graph_rewrite.batch_statistics import UnsupportedLayerError
    for option in (dict(renorm=True), dict(synchronized=True)):
        x = keras.Input((4,))
        h = keras.layers.BatchNormalization(name="odd_bn", **option)(x)
        model = keras.Model(x, keras.layers.Dense(2, name="out")(h), name="k3_odd_bn")
        with pytest.raises(UnsupportedLayerError, match=f"'odd_bn'.*{list(option)[0]}"):
            dapple.PipelinedModel(model, straight_plan([1], 2, 2, 8))


def test_recomputing_a_keras3_dropout_is_refused_by_name():
    x = keras.Input((4,))
    h = keras.layers.Dropout(0.5, name="drop")(keras.layers.Dense(4, name="d")(x))
    model = keras.Model(x, keras.layers.Dense(2, name="out")(h), name="k3_dropout")
    plan = straight_plan([1], 3, 2, 8)
    plan.recompute = True
    with pytest.raises(ValueError, match=r"layer 'drop' \(Dropout\) draws random numbers"):
        dapple.PipelinedModel(model, plan)


def masked_lstm(mask=True):
    """Embedding(mask_zero) -> LSTM -> Dense -> Dense. Keras 3's graph computes the mask in an
    operation of its own (`not_equal`, from the tokens) and passes it to the LSTM."""
    keras.utils.set_random_seed(0)
    x = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=mask, name="embedding")(x)
    h = keras.layers.LSTM(6, name="lstm")(h)
    h = keras.layers.Dense(6, activation="relu", name="hidden")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="k3_masked_lstm")


def masked_pooling(mask=True):
    """Masking -> Dense -> GlobalAveragePooling1D -> Dense: the mask's operations (`not_equal`,
    `any`) sit among the layers, and the pooling averages the unmasked steps only."""
    keras.utils.set_random_seed(0)
    x = keras.Input((7, 4))
    h = keras.layers.Masking(0.0, name="masking")(x) if mask else x
    h = keras.layers.Dense(5, activation="tanh", name="d")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="k3_masked_pooling")


def padded(builder, seed):
    rng = np.random.RandomState(seed)
    if builder is masked_lstm:
        x = rng.randint(1, 20, (8, 7)).astype("int32")
    else:
        x = rng.randn(8, 7, 4).astype("float32")
    x[::2, 4:] = 0                          # every other row padded: the mask matters
    return x, rng.randint(0, 3, 8).astype("int32")


@pytest.mark.parametrize("builder, cut, crossing", [
    (masked_lstm, 1, "the tokens and the embedding's output"),
    (masked_lstm, 2, "the mask and the embedding's output"),
    (masked_pooling, 3, "the mask and the Dense's output"),
], ids=["lstm-after-embedding", "lstm-after-mask", "pooling-after-dense"])
def test_a_mask_crossing_a_cut_trains_like_plain_keras3(builder, cut, crossing):
    """A Keras 3 mask is an argument like any other tensor, so it crosses a cut (unlike a Keras
    2 mask, which rides on its tensor and is refused there: test_transparency)."""
    model, reference = builder(), builder()
    n = len(layer_order(model))
    pm = dapple.PipelinedModel(model, straight_plan([cut], n, 2, 8))
    pm.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    x, y = padded(builder, seed=1)
    with tf.GradientTape() as tape:
        want_loss = loss_fn()(y, reference(x, training=True))
    want = tape.gradient(want_loss, reference.trainable_variables)
    got = pm.gradients(x, y)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(w),
                                   rtol=1e-5, atol=1e-6, err_msg=crossing)
    unmasked = builder(mask=False)      # not vacuous: without the mask the gradients differ
    with tf.GradientTape() as tape:
        other_loss = loss_fn()(y, unmasked(x, training=True))
    other = tape.gradient(other_loss, unmasked.trainable_variables)
    assert max(float(np.max(np.abs(tf.convert_to_tensor(o) - tf.convert_to_tensor(w))))
               for o, w in zip(other, want)) > 1e-3


def test_profile_of_a_masked_keras3_model_lists_the_mask_operation():
    """The mask's operation is a position of the profile (the plan cuts the same order), with no
    parameters and no backward."""
    model = masked_lstm()
    x, _ = padded(masked_lstm, seed=2)
    profile = dapple.profile(model, x, warmup=0, runs=1)
    assert [layer.name for layer in profile.layers] == [
        layer.name for layer in layer_order(model)]
    kinds = [type(operation).__name__ for operation in layer_order(model)]
    assert kinds == ["Embedding", "NotEqual", "LSTM", "Dense", "Dense"]
    mask, lstm = profile.layers[1], profile.layers[2]
    assert mask.parameter_bytes == 0 and mask.backward_ms == 0
    assert lstm.parameter_bytes == 4 * model.get_layer("lstm").count_params()


def ops_between_layers(seed=0):
    """`keras.ops` called on the graph's tensors: operations that are not layers (Tanh, Add,
    Multiply), each a position of the plan, the skip `a` crossing the cuts after them."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    a = keras.layers.Dense(8, name="d1")(x)
    h = keras.layers.Dense(8, name="d2")(keras.ops.tanh(a))
    h = keras.ops.add(h, a) * 0.5
    return keras.Model(x, keras.layers.Dense(5, name="out")(h), name="k3_ops")


@pytest.mark.parametrize("cut", [1, 3, 4])
def test_keras_ops_between_layers_train_like_plain_keras3(cut):
    model, reference = ops_between_layers(), ops_between_layers()
    assert [type(op).__name__ for op in layer_order(model)] == [
        "Dense", "Tanh", "Dense", "Add", "Multiply", "Dense"]
    pm = dapple.PipelinedModel(model, straight_plan([cut], 6, 4, GLOBAL_BATCH))
    pm.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn())
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn(),
                      jit_compile=False)
    for step in range(3):
        x, y = data(seed=200 + step)
        assert abs(float(pm.train_step(x, y)) - float(reference.train_on_batch(x, y))) < 1e-5
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
