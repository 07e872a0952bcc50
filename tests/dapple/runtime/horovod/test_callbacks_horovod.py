"""Keras callbacks under `dapple launch` (`scripts/callbacks_rank.py`): checkpoints written by
ModelCheckpoint load into the plain model and predict what the pipelined model predicts, and
EarlyStopping's restored best weights are every rank's, whether the callbacks are given on every
rank or on rank 0 only. The references are plain Keras runs of the same data."""
import json
import os
import subprocess
import sys

import pytest

from hvdrun import LIGHT_RANK_ENV, REPO, SCRIPTS
from planner.formats.plan import straight_plan


def launch(tmp_path, replicas, *args, check=True):
    plan = tmp_path / "plan.json"
    boundaries = {1: [], 2: [2], 3: [1, 3]}[len(replicas)]
    straight_plan(boundaries, 5, 2, 12, replicas=replicas).save(str(plan))
    env = dict(os.environ, **LIGHT_RANK_ENV, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "dapple.cli", "launch", f"--plan={plan}",
                          "--step_timeout=60", "--", sys.executable,
                          os.path.join(SCRIPTS, args[0]), *args[1:]],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    if not check:
        return None, out
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    reports = {r["rank"]: r for r in (json.loads(line.split("DAPPLE_RESULT ", 1)[1])
                                      for line in out.stdout.splitlines()
                                      if "DAPPLE_RESULT " in line)}
    assert sorted(reports) == list(range(sum(replicas))), out.stdout[-3000:]
    return reports, out


@pytest.mark.horovod
@pytest.mark.parametrize("replicas, where", [
    ([1, 1, 1], "all"), pytest.param([1, 1, 1], "rank0", marks=pytest.mark.slow),
    ([1, 2], "all")])
def test_checkpoints_hold_every_stage_and_best_weights_reach_every_rank(tmp_path, replicas,
                                                                        where):
    folder = tmp_path / "files"
    folder.mkdir()
    reports, out = launch(tmp_path, replicas, "callbacks_rank.py", where, str(folder), "1")
    for r in reports.values():
        assert r["epochs"] == 4, r                 # EarlyStopping stopped after epoch 3
        assert r["predict_diff"] < 1e-5, r         # every rank trains on epoch 1's weights
    zero = reports[0]
    assert zero["best_file_diff"] < 1e-6, zero
    assert zero["last_file_diff"] < 1e-5 and zero["last_files_agree"] < 1e-6, zero
    assert zero["csv_rows"] == 4, zero
    # One writer, atomically: the three checkpoints and the log, no temporary files left.
    assert zero["files"] == ["best.weights.h5", "last.weights.h5", "log.csv", "model.h5"], zero
    # One progress bar: rank 0's (each epoch's header once, whichever ranks got callbacks).
    assert out.stdout.count("Epoch 1/6") == 1 and out.stdout.count("Epoch 4/6") == 1, \
        out.stdout[-3000:]


@pytest.mark.horovod
def test_backup_and_restore_resumes_every_ranks_stage_and_optimizer(tmp_path):
    backup = str(tmp_path / "backup")
    _, out = launch(tmp_path, [1, 1, 1], "backup_rank.py", "interrupt", backup, check=False)
    assert out.returncode != 0, out.stdout[-3000:]
    assert sorted(os.listdir(backup)) == ["rank0", "rank1", "rank2"]   # each rank's own state
    reports, _ = launch(tmp_path, [1, 1, 1], "backup_rank.py", "resume", backup)
    for r in reports.values():
        assert r["epochs"] == [2, 3], r
        assert r["predict_diff"] < 1e-5, r       # as if never interrupted (Adam's slots too)
