"""dapple runs Keras 2 models (`dapple.keras2`, `dapple.seed_workaround`).

`import dapple` makes `tf.keras` Keras 2 (TF_USE_LEGACY_KERAS=1 before TensorFlow loads) or says
what to do when TensorFlow came first; a Keras 3 model gets one error naming its Keras version
and the one-line fix; `tf.keras.utils.set_random_seed` then seeded layers work on Python 3.12.
TensorFlow picks its Keras once, at import, so each check runs in a fresh Python without the
TF_USE_LEGACY_KERAS that tests/conftest.py sets for this process.
"""
import importlib.util
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


def fresh(code, *, legacy=None, args=None):
    """Run `code` (or `python args...`) in a fresh interpreter from the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    if legacy is not None:
        env["TF_USE_LEGACY_KERAS"] = legacy
    command = [sys.executable] + (args if args is not None else ["-c", code])
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def keras3_version():
    try:
        version = metadata.version("keras")
    except metadata.PackageNotFoundError:
        return None
    return version if version.startswith("3.") else None


def test_import_dapple_makes_tf_keras_keras_2():
    proc = fresh("import os, sys, dapple, tensorflow as tf\n"
                 "root = tf.keras.Model.__module__.split('.')[0]\n"
                 "print(root, sys.modules[root].__version__, "
                 "os.environ.get('TF_USE_LEGACY_KERAS', 'unset'))")
    assert proc.returncode == 0, proc.stderr
    root, version, env = proc.stdout.split()
    assert version.startswith("2."), proc.stdout
    # tf_keras where it is installed (TensorFlow 2.16+ needs it), else TensorFlow 2.15's keras.
    assert (root, env) == (("tf_keras", "1") if HAS_TF_KERAS else ("keras", "unset")), proc.stdout


def test_without_tf_keras_the_variable_is_left_alone():
    """TensorFlow 2.15 reads TF_USE_LEGACY_KERAS too: set without tf_keras, its tf.keras would
    not load. Without tf_keras, TensorFlow 2.16+ gets the error saying what to install."""
    proc = fresh("import sys, os\n"
                 "sys.modules['tf_keras'] = None   # as if not installed\n"
                 "import dapple, tensorflow as tf\n"
                 "print(os.environ.get('TF_USE_LEGACY_KERAS', 'unset'), tf.keras.Model.__module__)")
    if TF_MINOR >= (2, 16):
        assert proc.returncode != 0
        assert "Keras2Error: tf.keras is Keras 3 here, and dapple needs Keras 2: with " \
               f"TensorFlow {tf.__version__} that is the tf_keras package, not installed. pip " \
               f"install 'tf_keras=={TF_MINOR[0]}.{TF_MINOR[1]}.*'" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["unset", "keras.src.engine.training"], proc.stdout


@pytest.mark.skipif(TF_MINOR < (2, 16) or not HAS_TF_KERAS, reason="TensorFlow 2.15's tf.keras "
                    "is Keras 2 whatever is imported first")
def test_tensorflow_imported_first_gets_what_to_do():
    proc = fresh("import tensorflow\nimport dapple")
    assert proc.returncode != 0
    assert "Keras2Error: tf.keras is Keras 3 here" in proc.stderr, proc.stderr
    assert "Put `import dapple` before `import tensorflow`" in proc.stderr
    assert "set TF_USE_LEGACY_KERAS=1" in proc.stderr
    # The variable set by the user before TensorFlow is the other way.
    ok = fresh("import tensorflow\nimport dapple", legacy="1")
    assert ok.returncode == 0, ok.stderr


def test_a_non_keras_model_is_refused_by_name():
    with pytest.raises(TypeError, match=r"PipelinedModel: dapple needs a tf.keras.Model "
                                        r"\(Keras 2\), got builtins.object"):
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
                            "--model=tests.models:keras3_mlp"])
    assert cli.returncode == 2, cli.stdout + cli.stderr
    assert f"--model=tests.models:keras3_mlp: the model 'keras3_mlp' is a Keras {version}" \
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
    bare = fresh(SEEDED_DENSE, legacy="1")
    assert "'float' object cannot be interpreted as an integer" in bare.stderr, (
        "tf_keras no longer fails here: dapple.seed_workaround may go", bare.stderr)
    # With dapple, the layer draws the seed Python 3.11 draws: randint(1, int(1e9)).
    proc = fresh("import dapple, random, numpy as np\n" + SEEDED_DENSE +
                 "seed = random.Random(7).randint(1, 10**9)\n"
                 "want = tf.keras.initializers.GlorotUniform(seed=seed)((4, 3))\n"
                 "print(np.array_equal(dense.kernel.numpy(), want.numpy()))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"], proc.stdout
