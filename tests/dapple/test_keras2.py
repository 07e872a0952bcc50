"""Which Keras dapple runs (`dapple.keras2`, `dapple.seed_workaround`; #30 item 2: no
import-order rule).

`import dapple` sets no TF_USE_LEGACY_KERAS and may come after `import tensorflow`: `tf.keras`
stays what TensorFlow makes it. A Keras 3 model then trains like plain Keras 3, and a tf_keras
model (TF_USE_LEGACY_KERAS=1, or `import tf_keras` while `tf.keras` is Keras 3) like plain
tf_keras; a tf_keras model given a Keras 3 optimizer is refused naming both. A Keras 3 model
dapple cannot cut gets one error naming its Keras version and the one-line fix;
`tf.keras.utils.set_random_seed` then seeded layers work on Python 3.12. TensorFlow picks its
Keras once, at import, so each check runs in a fresh Python without the TF_USE_LEGACY_KERAS that
tests/conftest.py sets for this process (the Keras 2 suite's opt-in).
"""
import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata

import pytest
import tensorflow as tf

import dapple
from planner.formats.plan import straight_plan
from tests.paths import REPO as ROOT

TF_MINOR = tuple(int(p) for p in tf.__version__.split(".")[:2])
HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None
FIX = "import tf_keras as keras"
SCRIPT = os.path.join(ROOT, "tests", "dapple", "scripts", "keras_choice.py")


def fresh(code, *, legacy=None, args=None):
    """Run `code` (or `python args...`) in a fresh interpreter from the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    if legacy is not None:
        env["TF_USE_LEGACY_KERAS"] = legacy
    env.setdefault("DAPPLE_NUM_CPU_DEVICES", "3")
    env["PYTHONPATH"] = ROOT
    command = [sys.executable] + (args if args is not None else ["-c", code])
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def keras3_version():
    try:
        version = metadata.version("keras")
    except metadata.PackageNotFoundError:
        return None
    return version if version.startswith("3.") else None


needs_keras3 = pytest.mark.skipif(
    TF_MINOR < (2, 16) or keras3_version() is None or not HAS_TF_KERAS,
    reason="needs TensorFlow 2.16+ (tf.keras Keras 3 by default), keras 3 and tf_keras")


def choice(mode, legacy=None) -> dict:
    """tests/dapple/scripts/keras_choice.py in a fresh process: TensorFlow imported first."""
    proc = fresh(None, legacy=legacy, args=[SCRIPT, mode])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("DAPPLE_RESULT ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0].split(" ", 1)[1])


def test_import_dapple_sets_nothing_and_leaves_tf_keras_alone():
    for first in ("import dapple, tensorflow as tf", "import tensorflow as tf, dapple"):
        proc = fresh(f"import os, sys\n{first}\n"
                     "root = tf.keras.Model.__module__.split('.')[0]\n"
                     "print(root, sys.modules[root].__version__, "
                     "os.environ.get('TF_USE_LEGACY_KERAS', 'unset'))")
        assert proc.returncode == 0, proc.stderr
        root, version, env = proc.stdout.split()
        assert env == "unset", (first, proc.stdout)
        # TensorFlow 2.16+'s tf.keras is Keras 3, 2.15's Keras 2: what TensorFlow makes it.
        assert version.startswith("3." if TF_MINOR >= (2, 16) else "2."), (first, proc.stdout)
    if HAS_TF_KERAS and TF_MINOR >= (2, 16):     # the user's opt-in holds, dapple first or not
        for first in ("import dapple, tensorflow as tf", "import tensorflow as tf, dapple"):
            proc = fresh(f"{first}\nprint(tf.keras.Model.__module__.split('.')[0])", legacy="1")
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.split() == ["tf_keras"], (first, proc.stdout)


def test_without_tf_keras_import_dapple_works():
    """Without tf_keras, dapple imports and sets nothing; Keras 3 models need none."""
    proc = fresh("import sys, os\n"
                 "sys.modules['tf_keras'] = None   # as if not installed\n"
                 "import tensorflow as tf, dapple\n"
                 "print(os.environ.get('TF_USE_LEGACY_KERAS', 'unset'))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["unset"], proc.stdout


@needs_keras3
def test_tensorflow_first_no_variable_keras3_model_equals_plain_keras3():
    """#30's check: TensorFlow imported first, no environment variable; #30's model (BN, a
    residual across the cut, a layer called twice) on 2:1 over 3 devices at M=4."""
    r = choice("keras3")
    assert r["env"] == "unset" and r["tf.keras"].startswith("keras 3."), r
    assert r["grads"][0] == r["grads"][1] == r["grads"][2] == 10, r
    for path, largest in r["grad_largest"].items():     # the test can fail
        assert largest > 1e-3 or path == "d1/bias", (path, largest)   # d1 feeds BN: grad 0
    assert r["grad_diff"] < 1e-5, r
    assert r["moving_paths"] == ["bn/moving_mean", "bn/moving_variance"], r
    assert r["moving_moved"] > 1e-2, r                   # the statistics did move
    assert r["moving_diff"] < 1e-5, r


@needs_keras3
@pytest.mark.parametrize("mode,legacy", [("tf_keras_env", "1"), ("tf_keras_import", None)])
def test_tf_keras_model_trains_like_plain_tf_keras(mode, legacy):
    """The user's opt-in to tf_keras: TF_USE_LEGACY_KERAS=1 (tf.keras is tf_keras), or
    `import tf_keras` while tf.keras is Keras 3; TensorFlow imported first either way."""
    r = choice(mode, legacy)
    assert r["model_keras"].startswith("tf_keras 2."), r
    assert r["tf.keras"].startswith("tf_keras 2." if legacy else "keras 3."), r
    assert r["weights_moved"] > 1e-2, r
    assert r["loss_diff"] < 1e-5 and r["weight_diff"] < 1e-5, r
    assert r["fit_keys"] == [["loss"], ["loss"]] and r["callback_epochs"] == [0, 1], r
    assert r["fit_loss_diff"] < 1e-5 and r["fit_weight_diff"] < 1e-5, r


@needs_keras3
def test_a_mixed_setup_is_refused_naming_both_kerases():
    r = choice("mixed")
    tf_keras_name, keras_name = r["versions"]
    assert r["error"] == (
        f"PipelinedModel.compile: the model 'mlp_with_skip' is {tf_keras_name}'s Functional "
        f"(Keras 2), the optimizer is {keras_name}'s SGD (Keras 3): a mixed setup. Give it the "
        f"model's Keras (`tf_keras.optimizers`), or build the model with keras"), r


def test_mixed_metrics_losses_and_callbacks_are_refused_too():
    """In this process (tf.keras is tf_keras: conftest's opt-in): each of compile's and fit's
    Keras objects is checked against the model's Keras."""
    keras = pytest.importorskip("keras")
    if keras.__version__.startswith(("1.", "2.")):
        pytest.skip("`import keras` is not Keras 3 here")
    from tests import models
    model = models.mlp_with_skip()
    pm = dapple.PipelinedModel(model, straight_plan([2], 5, 2, 8))
    for kwargs, role in [({"metrics": ["accuracy", keras.metrics.AUC()]}, "metric"),
                         ({"loss": {"out": keras.losses.MeanSquaredError()}}, "loss"),
                         ({"weighted_metrics": [keras.metrics.MeanSquaredError()]},
                          "weighted metric")]:
        kwargs.setdefault("loss", "mse")
        with pytest.raises(TypeError, match=rf"the {role} is keras 3\.\S+'s \w+ \(Keras 3\): "
                                            r"a mixed setup"):
            pm.compile("sgd", **kwargs)
    pm.compile(tf.keras.optimizers.SGD(0.1), loss="mse")
    import numpy as np
    with pytest.raises(TypeError, match=r"PipelinedModel.fit: .* the callback is keras 3\.\S+'s "
                                        r"History \(Keras 3\)"):
        pm.fit(np.zeros((8, 6), "float32"), np.zeros((8, 5), "float32"), batch_size=8,
               callbacks=[keras.callbacks.History()], verbose=0)


def test_a_non_keras_model_is_refused_by_name():
    with pytest.raises(TypeError, match=r"PipelinedModel: dapple needs a Keras model "
                                        r"\(keras.Model, or tf_keras.Model for Keras 2\), got "
                                        r"builtins.object"):
        dapple.PipelinedModel(object(), straight_plan([1], 2, 2, 8))


@pytest.mark.skipif(keras3_version() is None, reason="`import keras` is not Keras 3 here "
                    "(TensorFlow 2.15's keras 2.15)")
def test_a_keras3_model_gets_one_clear_error(tmp_path):
    version = keras3_version()
    proc = fresh(
        "import numpy as np, dapple\n"
        "from planner.formats.plan import straight_plan\n"
        "import keras\n"
        "unbuilt = keras.Sequential([keras.layers.Dense(3)])   # no layer graph yet\n"
        "for name, call in [('PipelinedModel', lambda: dapple.PipelinedModel(unbuilt, "
        "straight_plan([1], 2, 2, 8))), ('profile', lambda: dapple.profile(unbuilt, "
        "np.zeros((4, 4), 'float32')))]:\n"
        "    try:\n"
        "        call(); print(name, 'accepted')\n"
        "    except TypeError as e:\n"
        "        print(e)\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["PipelinedModel", "dapple.profile"], lines
    for line in lines:
        assert f"is a Keras {version} model (`import keras`)" in line, line
        assert FIX in line, line
    plan = tmp_path / "plan.json"
    straight_plan([1], 2, 2, 8).save(str(plan))
    cli = fresh(None, args=["-m", "dapple.cli", "verify", f"--plan={plan}",
                            "--model=tests.models:keras3_unbuilt"])
    assert cli.returncode == 2, cli.stdout + cli.stderr
    assert (f"--model=tests.models:keras3_unbuilt: the model 'keras3_unbuilt' is a Keras "
            f"{version} model (`import keras`) of type Sequential") \
        in cli.stderr and FIX in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr


@pytest.mark.skipif(keras3_version() is None, reason="`import keras` is not Keras 3 here "
                    "(TensorFlow 2.15's keras 2.15)")
def test_a_keras3_layer_inside_a_keras2_model_is_refused_by_name():
    """Called on Keras 2 tensors, a Keras 3 layer becomes TensorFlow-op layers that capture its
    variables untracked: they would never train."""
    import keras
    x = tf.keras.Input((4,))
    h = tf.keras.layers.Dense(5, name="mine")(x)
    model = tf.keras.Model(x, keras.layers.Dense(3, name="theirs")(h), name="mixed")
    with pytest.raises(TypeError, match=r"PipelinedModel: model 'mixed' computes with keras "
                                        r".*'s variable 'theirs/.*a keras layer \('theirs'\) "
                                        r"was called inside this tf_keras model.*never train"):
        dapple.PipelinedModel(model, straight_plan([1], len(model.layers), 1, 8))


SEEDED_DENSE = ("import tensorflow as tf\n"
                "tf.keras.utils.set_random_seed(7)\n"
                "dense = tf.keras.layers.Dense(3)\n"
                "dense.build((None, 4))\n")


@pytest.mark.skipif(sys.version_info < (3, 12), reason="tf_keras's float seed bound fails only "
                    "on Python 3.12+ (this is %d.%d)" % sys.version_info[:2])
@pytest.mark.skipif(TF_MINOR < (2, 16), reason="the bug is tf_keras's (TensorFlow 2.16+)")
def test_set_random_seed_then_seeded_layers_work_on_python_312():
    # Without dapple the bug is there: the test below exercises it.
    bare = fresh(SEEDED_DENSE, legacy="1")          # tf.keras is tf_keras: the user's opt-in
    assert "'float' object cannot be interpreted as an integer" in bare.stderr, (
        "tf_keras no longer fails here: dapple.seed_workaround may go", bare.stderr)
    # With dapple, the layer draws the seed Python 3.11 draws: randint(1, int(1e9)); whether
    # tf_keras comes through tf.keras (the variable) or `import tf_keras`, before or after dapple.
    check = ("seed = random.Random(7).randint(1, 10**9)\n"
             "want = tf.keras.initializers.GlorotUniform(seed=seed)((4, 3))\n"
             "print(np.array_equal(dense.kernel.numpy(), want.numpy()))")
    for prefix, legacy in [("import dapple, random, numpy as np\n", "1"),
                           ("import tensorflow, dapple, random, numpy as np\n", "1"),
                           ("import dapple, random, numpy as np, tf_keras\n", None),
                           ("import tf_keras, dapple, random, numpy as np\n", None)]:
        code = prefix + SEEDED_DENSE + check
        if legacy is None:                  # tf.keras is Keras 3 here: name tf_keras
            code = code.replace("import tensorflow as tf\n", "import tf_keras, types\n"
                                "tf = types.SimpleNamespace(keras=tf_keras)\n")
        proc = fresh(code, legacy=legacy)
        assert proc.returncode == 0, (prefix, proc.stderr)
        assert proc.stdout.split() == ["True"], (prefix, proc.stdout)
