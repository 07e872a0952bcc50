"""benchmarks/plain_dp_step.py, the data-parallel baseline of benchmarks/gpu_first_run.sh, on 2
CPU ranks: each rank trains on its own half of the global batch (its first loss is the plain
model's on those rows, computed here in one process), and the loss averaged over the ranks is
the plain model's on the whole batch."""
import json
import os

import pytest
import tensorflow as tf

from dapple.user_model import build_model, random_inputs, random_targets
from hvdrun import REPO, horovodrun

MODEL = "tests.models:mlp_with_skip"


@pytest.mark.horovod
def test_plain_data_parallel_step_splits_the_global_batch_among_the_ranks():
    script = os.path.join(REPO, "benchmarks", "plain_dp_step.py")
    result = horovodrun(2, [script, f"--model={MODEL}", "--global_batch_size=16", "--steps=3",
                            "--warmup=1"], timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    found = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(found) == [0, 1], result.output[-4000:]

    model = build_model(MODEL)
    x, y = random_inputs(model, 16), random_targets(model, 16)
    mse = tf.keras.losses.MeanSquaredError()
    for rank, rep in found.items():
        assert rep["ranks"] == 2 and rep["rows_per_rank"] == 8 and rep["device"] == "CPU", rep
        assert rep["step_ms"] > 0 and rep["step_ms"] == found[0]["step_ms"], rep
        rows = slice(8 * rank, 8 * (rank + 1))
        own = float(mse(y[rows], model(x[rows], training=True)))
        assert rep["first_local_loss"] == pytest.approx(own, rel=1e-5), (rank, rep, own)
        whole = float(mse(y, model(x, training=True)))
        assert rep["first_loss"] == pytest.approx(whole, rel=1e-5), (rank, rep, whole)
