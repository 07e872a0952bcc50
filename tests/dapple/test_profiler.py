"""The Keras profiler: layer order, exact bytes (computed by hand), inputs, positive times,
the file it writes, and the `dapple profile` command."""
import dapple  # noqa: F401  (configures logical devices before TensorFlow initializes)
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from dapple.pipelined_model import PipelinedModel
from dapple.profiler import profile
from graph_rewrite.model_graph import model_signature
from planner.formats.plan import straight_plan
from planner.formats.profile import SharedParameters
from planner.formats.profile_readers import load_profile
from tests.paths import REPO as ROOT


def skip_model():
    """x(6) -> a: Dense 4 -> b: Dense 3 -> c: Concatenate(a, b) (7) -> out: Dense 2."""
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((6,), name="x")
    a = tf.keras.layers.Dense(4, name="a")(x)
    b = tf.keras.layers.Dense(3, name="b")(a)
    c = tf.keras.layers.Concatenate(name="c")([a, b])
    out = tf.keras.layers.Dense(2, name="out")(c)
    return tf.keras.Model(x, out, name="skip_model")


def embedding_model():
    """ids(5) int32 -> emb: Embedding(10, 3) -> flat: Flatten (15) -> out: Dense 2."""
    tf.keras.utils.set_random_seed(0)
    ids = tf.keras.Input((5,), dtype="int32", name="ids")
    e = tf.keras.layers.Embedding(10, 3, name="emb")(ids)
    f = tf.keras.layers.Flatten(name="flat")(e)
    out = tf.keras.layers.Dense(2, name="out")(f)
    return tf.keras.Model(ids, out, name="embedding_model")


def test_profile_of_a_model_with_a_skip_connection(tmp_path):
    model = skip_model()
    x = np.random.RandomState(0).randn(8, 6).astype("float32")
    y = np.zeros((8, 2), "float32")
    out = str(tmp_path / "skip.json")
    prof = profile(model, x, y, output=out, warmup=1, runs=3)

    assert [l.name for l in prof.layers] == ["a", "b", "c", "out"]
    assert [l.type for l in prof.layers] == ["Dense", "Dense", "Concatenate", "Dense"]
    assert prof.batch_size == 8
    # fp32 = 4 bytes; outputs are batch 8 x width; parameters (in x out + out) x 4.
    assert [l.output_bytes for l in prof.layers] == [8 * 4 * 4, 8 * 3 * 4, 8 * 7 * 4, 8 * 2 * 4]
    assert [l.parameter_bytes for l in prof.layers] == [(6 * 4 + 4) * 4, (4 * 3 + 3) * 4, 0,
                                                        (7 * 2 + 2) * 4]
    assert [list(l.inputs) for l in prof.layers] == [[-1], [0], [0, 1], [2]]
    assert prof.input_bytes == 8 * 6 * 4
    assert all(l.forward_ms > 0 and l.backward_ms > 0 for l in prof.layers)
    # I, the input-gradient part of each backward, measured on its own (W is the rest).
    assert all(0 <= l.input_gradient_ms <= l.backward_ms for l in prof.layers)
    assert prof.model_signature == model_signature(model)
    # The cut after "a" carries a's output (b and c read it); after "b" both a's and b's.
    assert prof.boundary_bytes(0) == 8 * 4 * 4
    assert prof.boundary_bytes(1) == 8 * 4 * 4 + 8 * 3 * 4

    with open(out) as f:
        written = json.load(f)
    assert written["format"] == "dapple-profile" and written["version"] == 1
    assert written["model_signature"] == model_signature(model)
    again = load_profile(out)
    assert [l.output_bytes for l in again.layers] == [l.output_bytes for l in prof.layers]
    assert [l.forward_ms for l in again.layers] == [l.forward_ms for l in prof.layers]
    assert [l.input_gradient_ms for l in again.layers] == \
        [l.input_gradient_ms for l in prof.layers]


def test_profile_of_integer_inputs_and_an_embedding():
    model = embedding_model()
    ids = np.random.RandomState(0).randint(0, 10, size=(4, 5)).astype("int32")
    prof = profile(model, ids, warmup=0, runs=1)
    assert [l.name for l in prof.layers] == ["emb", "flat", "out"]
    assert [l.output_bytes for l in prof.layers] == [4 * 5 * 3 * 4, 4 * 15 * 4, 4 * 2 * 4]
    assert [l.parameter_bytes for l in prof.layers] == [10 * 3 * 4, 0, (15 * 2 + 2) * 4]
    assert prof.input_bytes == 4 * 5 * 4
    assert all(l.forward_ms > 0 for l in prof.layers)
    assert prof.layers[0].backward_ms > 0          # the embedding's weights get gradients
    assert prof.layers[0].input_gradient_ms == 0.0  # integer ids: all of it is W


def test_a_plan_from_the_profile_is_accepted_and_one_from_another_model_refused():
    model = skip_model()
    prof = profile(model, np.ones((4, 6), "float32"), warmup=0, runs=1)
    plan = straight_plan([2], prof.num_layers, 2, 4)
    plan.profile = prof.summary()
    PipelinedModel(model, plan)
    other = profile(embedding_model(), np.ones((4, 5), "int32"), warmup=0, runs=1)
    plan.profile = other.summary()
    with pytest.raises(ValueError, match="measured on another model"):
        PipelinedModel(model, plan)


def test_profile_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="x has 4 rows but y has 3"):
        profile(skip_model(), np.ones((4, 6), "float32"), np.ones((3, 2), "float32"))


def test_dapple_profile_command_writes_a_profile(tmp_path):
    out = str(tmp_path / "conv.json")
    proc = subprocess.run(
        [sys.executable, "-m", "dapple.cli", "profile", "--model=tests.models:small_conv",
         "--batch_size=4", f"--output={out}", "--runs=1", "--warmup=0"],
        capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    prof = load_profile(out)
    assert [l.name for l in prof.layers] == ["c1", "c2", "pool", "flat", "out"]
    # small_conv: input 8x8x2; c1 output 4 x 8x8x4 floats; pool output 4 x 4x4x4.
    assert prof.layers[0].output_bytes == 4 * 8 * 8 * 4 * 4
    assert prof.layers[2].output_bytes == 4 * 4 * 4 * 4 * 4
    assert prof.input_bytes == 4 * 8 * 8 * 2 * 4


def test_dapple_profile_command_explains_a_bad_model_flag():
    proc = subprocess.run([sys.executable, "-m", "dapple.cli", "profile", "--model=nomodule"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "module:builder" in proc.stderr


class TiedProjection(tf.keras.layers.Layer):
    """Logits from the embedding matrix itself (a tied input embedding and output layer)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True)


def tied_model():
    """ids(5) int32 -> emb: Embedding(10, 3) -> d: Dense 3 -> proj: h @ emb^T (10)."""
    tf.keras.utils.set_random_seed(0)
    ids = tf.keras.Input((5,), dtype="int32", name="ids")
    emb = tf.keras.layers.Embedding(10, 3, name="emb")
    h = tf.keras.layers.Dense(3, name="d")(emb(ids))
    return tf.keras.Model(ids, TiedProjection(emb, name="proj")(h), name="tied")


def twice_model():
    """x(4) -> d: Dense 4 -> e: Dense 4 -> d again (runs at e's position) ->
    cat: Concatenate(d's first output, d's second) (8) -> out: Dense 2."""
    tf.keras.utils.set_random_seed(0)
    x = tf.keras.Input((4,), name="x")
    d = tf.keras.layers.Dense(4, name="d")
    a = d(x)
    c = d(tf.keras.layers.Dense(4, name="e")(a))
    h = tf.keras.layers.Concatenate(name="cat")([a, c])
    return tf.keras.Model(x, tf.keras.layers.Dense(2, name="out")(h), name="twice")


def stage_bytes(model, ranges):
    """Bytes of the variables each stage of a cut holds (what the runtime places there)."""
    from graph_rewrite.model_graph import cut_model
    return [sum(int(np.prod(v.shape)) * v.dtype.size for v in st.trainable_variables)
            for st in cut_model(model, ranges)]


def test_a_tied_embedding_is_one_shared_entry(tmp_path):
    model = tied_model()
    ids = np.random.RandomState(0).randint(0, 10, size=(4, 5)).astype("int32")
    out = str(tmp_path / "tied.json")
    prof = profile(model, ids, output=out, warmup=0, runs=1)
    assert [l.name for l in prof.layers] == ["emb", "d", "proj"]
    # The 10 x 3 fp32 embedding is used by emb (position 0) and proj (2): shared, not owned.
    assert [l.parameter_bytes for l in prof.layers] == [0, (3 * 3 + 3) * 4, 0]
    with open(out) as f:
        assert json.load(f)["shared_parameters"] == [{"bytes": 10 * 3 * 4, "positions": [0, 2]}]
    assert [l.output_bytes for l in prof.layers] == [4 * 5 * 3 * 4, 4 * 5 * 3 * 4,
                                                     4 * 5 * 10 * 4]
    assert [list(l.inputs) for l in prof.layers] == [[-1], [0], [1]]
    assert prof.compute_dtype == "float32"
    assert prof.total_parameter_bytes == 120 + 48
    assert [prof.parameter_bytes(a, b) for a, b in [(0, 0), (1, 1), (2, 2), (0, 1), (1, 2)]] == \
        [120, 48, 120, 168, 168]
    assert prof.layers[2].backward_ms > 0             # proj's gradient reaches the embedding
    for ranges in ([(0, 0), (1, 2)], [(0, 1), (2, 2)], [(0, 0), (1, 1), (2, 2)]):
        assert stage_bytes(model, ranges) == [prof.parameter_bytes(a, b) for a, b in ranges]


def test_a_layer_called_at_two_positions(tmp_path):
    model = twice_model()
    x = np.random.RandomState(0).randn(8, 4).astype("float32")
    prof = profile(model, x, warmup=0, runs=1)
    assert [l.name for l in prof.layers] == ["d", "e", "cat", "out"]
    # d's kernel and bias, (4 x 4 + 4) x 4 bytes, are used at positions 0 and 1.
    assert prof.shared_parameters == (SharedParameters(80, (0, 1)),)
    assert [l.parameter_bytes for l in prof.layers] == [0, 80, 0, (8 * 2 + 2) * 4]
    # d's second call runs at e's position: its output (8 x 4 floats) is counted there, and
    # it reads e's output at that same position (no input of its own to record).
    assert [l.output_bytes for l in prof.layers] == [128, 128 + 128, 8 * 8 * 4, 8 * 2 * 4]
    assert [list(l.inputs) for l in prof.layers] == [[-1], [0], [0, 1], [2]]
    assert prof.boundary_bytes(0) == 128
    # After e: d's first output and position 1's outputs (counted together, as a multi-output
    # layer: e's own output crosses in the profile although only d's second call reads it).
    assert prof.boundary_bytes(1) == 128 + 256
    assert [prof.parameter_bytes(a, b) for a, b in [(0, 0), (1, 1), (0, 1), (2, 3), (1, 3)]] == \
        [80, 160, 160, 72, 232]
    assert all(l.forward_ms > 0 for l in prof.layers)
    for ranges in ([(0, 0), (1, 3)], [(0, 1), (2, 3)], [(0, 0), (1, 1), (2, 3)]):
        assert stage_bytes(model, ranges) == [prof.parameter_bytes(a, b) for a, b in ranges]


def test_a_mixed_precision_profile_records_its_compute_dtype(tmp_path):
    x = np.random.RandomState(0).randn(8, 6).astype("float32")
    full = profile(skip_model(), x, warmup=0, runs=1)
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = skip_model()
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    out = str(tmp_path / "half.json")
    half = profile(model, x, output=out, warmup=0, runs=1)     # built in 16 bits, policy reset
    assert half.compute_dtype == "float16"
    with open(out) as f:
        assert json.load(f)["compute_dtype"] == "float16"
    assert [l.output_bytes for l in half.layers] == [l.output_bytes / 2 for l in full.layers]
    assert half.cut_bytes == [b / 2 for b in full.cut_bytes]
    # Weights stay float32 and the model input is not cast.
    assert [l.parameter_bytes for l in half.layers] == [l.parameter_bytes for l in full.layers]
    assert half.input_bytes == full.input_bytes
    # A float32 profile rescaled to float16 reads the same bytes as the measured one.
    assert full.with_compute_dtype("float16").cut_bytes == half.cut_bytes


def test_profiling_leaves_batchnorm_statistics_as_they_were():
    """The profiler runs layers in training mode; BatchNormalization would move its moving
    statistics each time, so the model the user trains next would start elsewhere."""
    from tests.models import conv_batchnorm
    model = conv_batchnorm()
    before = [v.numpy() for v in model.non_trainable_variables]
    x = np.random.RandomState(0).randn(8, 6, 6, 3).astype("float32") * 3 + 2
    profile(model, x, runs=2, warmup=1)
    for v, value in zip(model.non_trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), value)
