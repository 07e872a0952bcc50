"""A Keras 3 model under `horovodrun -np 3` (#30): `tests.models.residual_bn_shared` built
with `import keras` (BatchNormalization, a residual across the cut, a layer called in both
stages), a 2:1 plan at M=4, each rank starting from other weights. After 3 steps of SGD with
momentum every weight and moving statistic, gathered on every rank, equals the plain Keras 3
model's trained right in the rank (`scripts/keras3_rank.py`: its gradients slice by slice,
since each slice normalizes with its own statistics; its moving statistics moved by the whole
batch; its own optimizer), within 1e-5; so does the checkpoint rank 0 writes, read by a fresh
plain Keras 3 model's `load_weights`. The ranks import TensorFlow before dapple, without
TF_USE_LEGACY_KERAS (#30's check: no import-order rule, no variable).
"""
import json
import os
import re

import pytest

from hvdrun import horovodrun

keras = pytest.importorskip("keras")
if keras.__version__.startswith(("1.", "2.")):
    pytest.skip("`import keras` is not Keras 3 here", allow_module_level=True)

TOLERANCE = 1e-5


@pytest.mark.horovod
def test_keras3_weights_after_three_steps_equal_plain_keras3(tmp_path):
    checkpoint = str(tmp_path / "k3.weights.h5")
    result = horovodrun(3, ["keras3_rank.py", "--cuts=3", "--replicas=2,1",
                            "--micro_batches=4", f"--checkpoint={checkpoint}"], timeout=300,
                        env={"TF_USE_LEGACY_KERAS": None})   # #30: no variable, TF first
    assert result.returncode == 0, result.output[-4000:]
    reports = {r: json.loads(text) for r, text in result.results().items()}
    assert sorted(reports) == [0, 1, 2], result.output[-4000:]
    assert sorted((rep["stage"], rep["replica"]) for rep in reports.values()) == \
        [(0, 0), (0, 1), (1, 0)]
    for rank, rep in reports.items():
        assert rep["loss_diff"] < TOLERANCE, rep
        assert sorted(rep["weight_diff"]) == sorted(rep["moved"]), rep
        assert "bn/moving_mean" in rep["weight_diff"], rep
        for path, diff in rep["weight_diff"].items():
            assert diff < TOLERANCE, (rank, path, diff)
            if path != "d1/bias":              # d1's bias feeds BatchNormalization: gradient 0
                assert rep["moved"][path] > 1e-3, (rank, path)      # it did train
        assert rep["checkpoint_diff"] < TOLERANCE, rep


def _reports(result):
    assert result.returncode == 0, result.output[-4000:]
    reports = {r: json.loads(text) for r, text in result.results().items()}
    assert sorted(reports) == [0, 1, 2], result.output[-4000:]
    return reports


@pytest.mark.horovod
@pytest.mark.parametrize("where", ["all", pytest.param("rank0", marks=pytest.mark.slow)])
def test_keras3_fit_with_callbacks_equals_plain_keras3_fit_on_three_ranks(tmp_path, where):
    """Keras 3's own fit (`scripts/keras3_fit_rank.py fit`, 2:1 on 3 ranks), callbacks given on
    every rank or on rank 0 only: History, weights (rank 0's EarlyStopping decision and
    restored best weights on every rank) and ModelCheckpoint's files as the plain model's fit,
    then `predict` as its; one writer; one progress bar."""
    folder = tmp_path / "files"
    result = horovodrun(3, ["keras3_fit_rank.py", "fit", str(folder), where], timeout=300,
                        env={"TF_USE_LEGACY_KERAS": None})
    reports = _reports(result)
    for rank, rep in reports.items():
        assert rep["epochs"] == rep["want_epochs"] == [0, 1], rep     # EarlyStopping, alike
        assert rep["keys"] == rep["want_keys"], rep
        assert rep["history_diff"] < TOLERANCE and rep["weight_diff"] < TOLERANCE, rep
        assert rep["predict_diff"] < TOLERANCE, rep                   # every rank, every row
    assert sorted(reports[0]["file_diff"]) == ["w1.weights.h5", "w2.weights.h5"]
    assert all(d < TOLERANCE for d in reports[0]["file_diff"].values()), reports[0]
    # One writer (rank 0), atomically: the checkpoints, the log, the TensorBoard events.
    assert sorted(os.listdir(folder)) == ["log.csv", "tb", "w1.weights.h5", "w2.weights.h5"]
    # Only rank 0's output has the progress bar.
    bar_ranks = {int(r) for r in re.findall(r"^\[(\d+)\]<stdout>:.*Epoch 1/5", result.output,
                                            re.M)}
    assert bar_ranks == {0}, result.output[-4000:]


@pytest.mark.horovod
@pytest.mark.slow   # for time: tf_keras's on three ranks and Keras 3's in one process stay
def test_keras3_backup_and_restore_resumes_on_three_ranks_as_plain_keras3(tmp_path):
    """Interrupted at epoch 2 (every rank), then a new job resumes from each rank's backup
    (`backup_dir/rank{R}`: its stage's Adam state): weights as plain Keras 3's run with the
    same interrupt and resume."""
    backup = str(tmp_path / "backup")
    stopped = _reports(horovodrun(3, ["keras3_fit_rank.py", "interrupt", backup], timeout=300,
                                  env={"TF_USE_LEGACY_KERAS": None}))
    assert all(rep["stopped"] == "interrupted" for rep in stopped.values()), stopped
    assert sorted(os.listdir(backup)) == ["rank0", "rank1", "rank2"]
    reports = _reports(horovodrun(3, ["keras3_fit_rank.py", "resume", backup], timeout=300,
                                  env={"TF_USE_LEGACY_KERAS": None}))
    for rep in reports.values():
        assert rep["epochs"] == rep["want_epochs"] == [2, 3], rep
        assert rep["history_diff"] < TOLERANCE and rep["weight_diff"] < TOLERANCE, rep
    assert not os.path.exists(os.path.join(backup, "rank0"))    # deleted at the end
