"""The command line with Keras 3 models (#30): `dapple profile --model=` and `dapple verify
--model=` build a Keras 3 functional or built Sequential model (`import keras`) and take it
through the same adapter as `PipelinedModel`, each run in a subprocess as a user runs it. The
profile is checked against what Keras 3 itself says of the model (its layers, `count_params`,
output shapes); verify must pass transparent plans and report a failure where gradients differ
by design (Dropout drawing in training), so the check can fail."""
import json
import os
import subprocess
import sys

import pytest

from planner.formats.plan import straight_plan
from tests import models

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def keras3_residual_bn_shared():
    """#30's model in Keras 3: BatchNormalization, a residual across a cut at 3, `shared` called
    in both stages."""
    return models.residual_bn_shared(0, keras=keras)


def keras3_dropout():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dropout(0.5, name="drop")(keras.layers.Dense(8, name="d1")(x))
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="k3_dropout")


def dapple_cli(*args):
    return subprocess.run([sys.executable, "-m", "dapple.cli", *args], capture_output=True,
                          text=True, cwd=ROOT)


def verify(tmp_path, plan, builder, *extra):
    path = str(tmp_path / "plan.json")
    plan.save(path)
    return dapple_cli("verify", f"--plan={path}", f"--model={builder}", *extra)


def test_profile_command_measures_a_keras3_sequential(tmp_path):
    out = str(tmp_path / "k3.json")
    proc = dapple_cli("profile", "--model=tests.models:keras3_mlp", "--batch_size=8",
                      f"--output={out}", "--runs=1", "--warmup=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        layers = json.load(f)["layers"]
    plain = models.keras3_mlp()                 # what Keras 3 says of the same model
    assert [layer["name"] for layer in layers] == [layer.name for layer in plain.layers]
    for got, layer in zip(layers, plain.layers):
        assert got["parameter_bytes"] == 4 * layer.count_params(), got
        assert got["output_bytes"] == 4 * 8 * layer.output.shape[-1], got


def test_verify_passes_a_keras3_sequential_on_two_stages(tmp_path):
    proc = verify(tmp_path, straight_plan([1], 2, 4, None, replicas=[2, 1]),
                  "tests.models:keras3_mlp", "--batch_size=16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model 'keras3_mlp' with 4 trainable variables" in proc.stdout
    assert "OK: the pipelined gradients equal the plain model's" in proc.stdout


def test_verify_compares_a_keras3_batchnorm_model_slice_by_slice(tmp_path):
    proc = verify(tmp_path, straight_plan([3], 6, 4, 16),
                  "tests.dapple.test_keras3_cli:keras3_residual_bn_shared")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 slices of 4 rows (ghost batches)" in proc.stdout
    assert "BatchNormalization layers (e.g. 'bn')" in proc.stdout and "OK" in proc.stdout


def test_verify_reports_keras3_gradients_that_differ(tmp_path):
    """Dropout drawing in training: the pipelined masks are not the plain model's, so verify
    fails and names the layer; at rate 0 (the default) it passes."""
    plan = straight_plan([2], 3, 2, 16)
    builder = "tests.dapple.test_keras3_cli:keras3_dropout"
    drawing = verify(tmp_path, plan, builder, "--random_layers=train")
    assert drawing.returncode == 1, drawing.stdout + drawing.stderr
    assert "FAILED" in drawing.stderr and "(e.g. 'drop')" in drawing.stderr
    quiet = verify(tmp_path, plan, builder)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert "random layers: 1 layer(s)" in quiet.stdout and "OK" in quiet.stdout


def test_an_unbuilt_keras3_sequential_is_refused_by_the_cli(tmp_path):
    proc = dapple_cli("profile", "--model=tests.models:keras3_unbuilt")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("--model=tests.models:keras3_unbuilt: the model 'keras3_unbuilt' is a Keras "
            f"{keras.__version__} model (`import keras`) of type Sequential") in proc.stderr
    assert "Traceback" not in proc.stderr
