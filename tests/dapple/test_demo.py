"""`make demo` (`dapple demo`) runs as a new user's shell runs it, without TF_USE_LEGACY_KERAS:
it trains a Keras 3 model (what `keras` is beside TensorFlow 2.18) pipelined, and the weights it
writes load into the plain model with Keras's own `load_weights` and differ from the untrained
ones."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.paths import REPO


def test_demo_trains_a_keras3_model_whose_weights_load_into_the_plain_model(tmp_path):
    keras = pytest.importorskip("keras")
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "dapple.cli", "demo", "--steps=4",
                           f"--output_dir={tmp_path}"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", done.stdout)]
    assert len(losses) == 4 and all(np.isfinite(losses)), done.stdout
    weights = re.search(r"weights in (\S+)$", done.stdout.strip()).group(1)
    assert weights.endswith(".weights.h5"), weights

    from dapple import demo_model
    if not keras.__version__.startswith("3."):
        pytest.skip("the demo's Keras 3 path needs keras 3 (TensorFlow 2.16+)")
    model = demo_model.build()
    assert type(model).__module__.startswith("keras."), type(model)
    before = [w.copy() for w in model.get_weights()]
    model.load_weights(weights)
    after = model.get_weights()
    assert len(after) == len(before)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))
