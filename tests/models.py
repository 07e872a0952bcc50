"""Tiny Keras models for the tests, each built deterministically from a seed so that two calls
give two models with identical initial weights (one to pipeline, one as the plain reference)."""
import numpy as np
import tensorflow as tf


def mlp_with_skip(seed=0, keras=None):
    """5 layers: d1 -> d2 -> add(d1, d2) -> d3 -> out. Cuts after d1 or d2 carry the skip.
    `keras`: the Keras module to build with (default `tf.keras`; `import keras` for Keras 3)."""
    keras = keras or tf.keras
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h1 = keras.layers.Dense(12, activation="tanh", name="d1")(x)
    h2 = keras.layers.Dense(12, activation="relu", name="d2")(h1)
    s = keras.layers.Add(name="add")([h1, h2])
    h3 = keras.layers.Dense(10, activation="tanh", name="d3")(s)
    out = keras.layers.Dense(5, name="out")(h3)
    return keras.Model(x, out, name="mlp_with_skip")


def two_in_two_out(seed=0, keras=None):
    """Dict inputs, the second input entering late, and two outputs (`keras`: as above)."""
    keras = keras or tf.keras
    keras.utils.set_random_seed(seed)
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    ha = keras.layers.Dense(8, activation="tanh", name="da")(a)
    hb = keras.layers.Dense(8, activation="tanh", name="db")(b)
    h = keras.layers.Concatenate(name="cat")([ha, hb])
    h = keras.layers.Dense(8, activation="relu", name="dh")(h)
    cls = keras.layers.Dense(3, name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model({"a": a, "b": b}, [cls, reg], name="two_in_two_out")


def small_conv(seed=0):
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((8, 8, 2))
    h = tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(x)
    h = tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c2")(h)
    h = tf.keras.layers.MaxPooling2D(name="pool")(h)
    h = tf.keras.layers.Flatten(name="flat")(h)
    out = tf.keras.layers.Dense(3, name="out")(h)
    return tf.keras.Model(x, out, name="small_conv")


def data_for(model, batch, seed):
    """Random inputs matching the model's inputs, and labels for its outputs (class ids for
    outputs named like classifiers, reals otherwise)."""
    rng = np.random.RandomState(seed)
    def values(t):
        if t.dtype.is_integer:         # token ids below every integer model's vocabulary
            return rng.randint(0, 10, size=(batch, *t.shape[1:])).astype(t.dtype.name)
        return rng.randn(batch, *t.shape[1:]).astype("float32")
    if isinstance(model.input, dict):
        x = {k: values(t) for k, t in model.input.items()}
    else:
        x = values(model.input)
    ys = []
    for out in model.outputs:
        if out.shape[-1] > 1:
            ys.append(rng.randint(0, out.shape[-1], size=batch).astype("int32"))
        else:
            ys.append(rng.randn(batch, 1).astype("float32"))
    return x, (ys[0] if len(ys) == 1 else ys)


def integer_boundary(seed=0, vocab=10, length=4):
    """Token ids reshaped, then embedded and classified. Cut after the reshape, the first
    stage has no variables and its boundary carries only int32 ids (no gradient goes back)."""
    tf.keras.utils.set_random_seed(seed)
    ids = tf.keras.Input((length,), dtype="int32", name="ids")
    h = tf.keras.layers.Reshape((length,), name="ids_reshape")(ids)
    h = tf.keras.layers.Embedding(vocab, 3, name="embed")(h)
    h = tf.keras.layers.Flatten(name="flat")(h)
    return tf.keras.Model(ids, tf.keras.layers.Dense(5, name="out")(h), name="integer_boundary")


def plain_loss_and_grads(model, loss, x, y):
    """The reference: the plain Keras model's loss and gradients on the whole global batch."""
    losses = loss if isinstance(loss, list) else [loss]
    ys = y if isinstance(y, list) else [y]
    with tf.GradientTape() as tape:
        preds = model(x, training=True)
        preds = preds if isinstance(preds, list) else [preds]
        total = tf.add_n([l(t, p) for l, t, p in zip(losses, ys, preds)])
    return total, tape.gradient(total, model.trainable_variables)


def assert_trains_like_plain_model(pm, model, reference, loss, make_optimizer, batch, steps=3):
    """Compile `pm` with `make_optimizer()`, train it and the plain `reference` (the same
    optimizer, GradientTape on the whole batch) on `steps` different global batches: every
    step's loss within 1e-5, then every weight."""
    pm.compile(optimizer=make_optimizer(), loss=loss)
    ref_opt = make_optimizer()
    for step in range(steps):
        x, y = data_for(model, batch, seed=100 + step)      # different data every step
        got_loss = pm.train_step(x, y)
        want_loss, grads = plain_loss_and_grads(reference, loss, x, y)
        ref_opt.apply_gradients(zip(grads, reference.trainable_variables))
        assert abs(float(got_loss) - float(want_loss)) < 1e-5
    pm.gather_weights()
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def overflowing_batches(steps, batch, bad_step, seed=0):
    """`steps` batches for float32_logits_mlp (6 features, 4 classes); at `bad_step` one row
    overflows float16 in d1: a non-finite gradient, in one slice."""
    rng = np.random.RandomState(seed)
    for step in range(steps):
        x = rng.randn(batch, 6).astype("float32")
        if step == bad_step:
            x[5] = 1e6
        yield x, rng.randint(0, 4, batch).astype("int32")


def loss_scale_steps(pm, plain, batches, bad_step, scale_of):
    """Train `pm` and the plain model `plain` (`train_on_batch`) step by step on `batches`:
    each step's loss within 1e-3, both non-finite at `bad_step` and `pm`'s weights unchanged
    by it (the step skipped). Returns (pm's scale, plain's scale) after each step, each read
    by `scale_of(optimizer)` (Keras 2: `loss_scale`; Keras 3: `dynamic_scale`)."""
    scales = []
    for step, (x, y) in enumerate(batches):
        before = [w.copy() for w in pm.model.get_weights()]
        got = float(pm.train_step(x, y))
        want = float(plain.train_on_batch(x, y))
        if step == bad_step:
            assert not np.isfinite(got) and not np.isfinite(want)
            for a, b in zip(pm.model.get_weights(), before):
                np.testing.assert_array_equal(a, b)    # skipped: nothing applied
        else:
            assert abs(got - want) <= 1e-3 * max(1.0, abs(want))
        scales.append((scale_of(pm.optimizer), scale_of(plain.optimizer)))
    return scales


def assert_ran_as_loops(pm, loop=True):
    """`pm`'s step built its lanes (`graph_rewrite.micro_batch_loop`) or its pipeline's periods
    (`graph_rewrite.schedule_loop`) as loops iff `loop`: the lane loop's function was traced,
    or the stages were split. Keeps a looped case from passing on the unrolled path."""
    step = pm.pipeline_step
    traced = step.lane_loops[0].traces > 0 or bool(step.stage_splits)
    assert traced == loop, f"lanes {'not ' if loop else ''}built as loops"


def losses_for(model):
    sce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if len(model.outputs) == 1:
        return sce
    return [sce, tf.keras.losses.MeanSquaredError()]


def dense_batchnorm(seed=0, momentum=0.9):
    """Dense -> BatchNormalization -> Dense -> Dense: the non-fused (2-D input) kernel."""
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((5,), name="x")
    h = tf.keras.layers.Dense(8, name="d1")(x)
    h = tf.keras.layers.BatchNormalization(momentum=momentum, name="bn")(h)
    h = tf.keras.layers.Dense(8, activation="relu", name="d2")(h)
    out = tf.keras.layers.Dense(3, name="out")(h)
    return tf.keras.Model(x, out, name="dense_batchnorm")


def conv_batchnorm(seed=0, momentum=0.9):
    """Two branches Conv2D -> BatchNormalization (the fused 4-D kernel), the second one's after
    a cut at 4; neither BN reads another's output, so plain statistics are defined per slice."""
    tf.keras.utils.set_random_seed(seed)
    x = tf.keras.Input((6, 6, 3), name="x")
    a = tf.keras.layers.Conv2D(4, 3, padding="same", name="c1")(x)
    a = tf.keras.layers.BatchNormalization(momentum=momentum, name="bn")(a)
    a = tf.keras.layers.ReLU(name="relu")(a)
    b = tf.keras.layers.Conv2D(4, 1, name="c2")(x)
    b = tf.keras.layers.BatchNormalization(momentum=0.8, name="bn2")(b)
    h = tf.keras.layers.Add(name="add")([a, b])
    h = tf.keras.layers.Flatten(name="flat")(h)
    out = tf.keras.layers.Dense(3, name="out")(h)
    return tf.keras.Model(x, out, name="conv_batchnorm")


def ghost_batch_loss_and_grads(model, loss, x, y, slice_rows):
    """The reference for batch-dependent layers: the plain Keras model run on consecutive
    slices of `slice_rows` rows (each slice normalizes with its own statistics), each slice's
    loss weighted by its share of the batch; moving statistics are left as they were."""
    state = [v.numpy() for v in model.non_trainable_variables]
    n = len(y)
    total, grads = 0.0, None
    for lo in range(0, n, slice_rows):
        with tf.GradientTape() as tape:
            part = loss(y[lo:lo + slice_rows], model(x[lo:lo + slice_rows], training=True))
            part = part * (slice_rows / n)
        g = tape.gradient(part, model.trainable_variables)
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        total += float(part)
    for v, value in zip(model.non_trainable_variables, state):
        v.assign(value)
    return total, grads


def ghost_batch_train_step(model, loss, optimizer, x, y, slice_rows):
    """One training step of the plain model with per-slice normalization (the pipeline's, see
    above): the gradients of `ghost_batch_loss_and_grads`, the moving statistics moved once by
    a training forward of the whole batch (what the plain model's `train_on_batch` moves them
    by), then the optimizer's update. Returns the loss."""
    total, grads = ghost_batch_loss_and_grads(model, loss, x, y, slice_rows)
    model(x, training=True)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return total


def residual_bn_shared(seed=0, keras=None):
    """#30's model: BatchNormalization, a residual (bn's output to `add`, across a cut at 3)
    and a layer called twice (`shared`: on bn's output in stage 0, on the sum in stage 1 of a
    cut at 3). Layers: d1, bn, shared, d2, add, out. `keras`: as for mlp_with_skip."""
    keras = keras or tf.keras
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h1 = keras.layers.BatchNormalization(momentum=0.8, name="bn")(
        keras.layers.Dense(8, name="d1")(x))
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h2 = keras.layers.Dense(8, activation="relu", name="d2")(shared(h1))
    b = shared(keras.layers.Add(name="add")([h1, h2]))
    return keras.Model(x, keras.layers.Dense(5, name="out")(b), name="residual_bn_shared")


class TiedOutput(tf.keras.layers.Layer):
    """Logits from the input embedding's own matrix (weight tying, as in transformer LMs)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        table = tf.cast(self.embedding.embeddings, h.dtype)
        return tf.matmul(h, table, transpose_b=True)


def tied_language_model(seed=0, vocab=24, width=8, length=6, heads=2):
    """A one-block transformer language model from Keras layers, its output projection tied to
    its input embedding: token + position embedding, self-attention, feed-forward, layer norms."""
    tf.keras.utils.set_random_seed(seed)
    ids = tf.keras.Input((length,), dtype="int32", name="ids")
    embedding = tf.keras.layers.Embedding(vocab, width, name="embed")
    h = embedding(ids)
    positions = tf.keras.layers.Embedding(length, width, name="positions")(
        tf.range(length)[None, :] * tf.ones_like(ids))
    h = tf.keras.layers.Add(name="add_pos")([h, positions])
    a = tf.keras.layers.MultiHeadAttention(heads, width // heads, name="attention")(
        h, h, use_causal_mask=True)
    h = tf.keras.layers.LayerNormalization(name="norm1")(tf.keras.layers.Add(name="res1")([h, a]))
    f = tf.keras.layers.Dense(2 * width, activation="relu", name="ffn1")(h)
    f = tf.keras.layers.Dense(width, name="ffn2")(f)
    h = tf.keras.layers.LayerNormalization(name="norm2")(tf.keras.layers.Add(name="res2")([h, f]))
    logits = TiedOutput(embedding, name="tied_logits")(h)
    return tf.keras.Model(ids, logits, name="tied_language_model")


def token_batch(batch, seed, vocab=24, length=6):
    rng = np.random.RandomState(seed)
    x = rng.randint(0, vocab, size=(batch, length)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def float32_logits_mlp(seed=0, keras=None):
    """Dense layers with float32 logits, as Keras recommends under a mixed-precision policy
    (`keras`: the Keras module to build with, default `tf.keras`)."""
    keras = keras or tf.keras
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="d1")(x)
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    h = keras.layers.Dense(16, activation="relu", name="d3")(h)
    return keras.Model(x, keras.layers.Dense(4, name="out", dtype="float32")(h))


def keras3_mlp():
    """The same kind of model written with `import keras`: a built Keras 3 Sequential (the CLI
    takes it: tests/dapple/test_keras3_cli.py)."""
    import keras
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d1"),
                             keras.layers.Dense(2, name="d2")], name="keras3_mlp")


def keras3_unbuilt():
    """A Keras 3 Sequential without an input shape: no layer graph, refused by name."""
    import keras
    return keras.Sequential([keras.layers.Dense(3)], name="keras3_unbuilt")
