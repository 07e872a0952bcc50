"""Keras training semantics across processes (`scripts/semantics_rank.py`): BatchNormalization
statistics, a tied embedding shared by two stages' ranks, global-norm clipping over the whole
model and mixed precision's skip decision, each against the plain single-process model."""
import json

import pytest

from hvdrun import horovodrun


def reports(case, ranks):
    result = horovodrun(ranks, ["semantics_rank.py", f"--case={case}"], timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    found = {r: json.loads(t) for r, t in result.results().items()}
    assert sorted(found) == list(range(ranks)), result.output[-4000:]
    return found.values()


@pytest.mark.horovod
def test_batchnorm_moving_statistics_equal_plain_fit():
    for rep in reports("batchnorm", 3):
        for name in ("dense_batchnorm", "conv_batchnorm"):
            assert rep[name + "_moved"] > 1e-2, rep          # the statistics did move
            assert rep[name] < 1e-5, rep


@pytest.mark.horovod
def test_tied_embedding_copies_stay_identical_and_equal_plain_sgd():
    for rep in reports("tied", 2):
        assert rep["embedding_moved"] > 1e-3, rep
        assert rep["own_embedding_diff"] < 1e-5, rep     # each rank's own copy, ungathered
        assert rep["weight_diff"] < 1e-5, rep


@pytest.mark.horovod
def test_global_clipnorm_clips_by_the_whole_models_norm():
    for rep in reports("clip", 3):
        assert rep["clip_changed_weights"] > 1e-3, rep
        assert rep["weight_diff"] < 1e-5, rep


@pytest.mark.horovod
def test_mixed_precision_skips_and_scales_alike_on_every_rank():
    for rep in reports("mixed", 3):
        got, want = zip(*rep["scales"])
        assert got == want, rep
        assert len(set(want)) > 2, rep                     # grew and was halved
        assert rep["weight_closeness"] <= 1.0, rep       # within fp16's 1e-3


@pytest.mark.horovod
def test_keras3_mixed_precision_with_global_clipnorm_skips_scales_and_clips_alike():
    """Keras 3's gradients reach its LossScaleOptimizer still scaled: the clip factor dapple
    computes over every rank's share divides their norm by the scale."""
    pytest.importorskip("keras", minversion="3")
    for rep in reports("keras3_mixed", 3):
        got, want = zip(*rep["scales"])
        assert got == want, rep
        assert want[5] == want[4] / 2 and max(want[:5]) > want[0], rep   # grew, then halved
        assert rep["moved"] > 1e-2, rep
        assert rep["weight_closeness"] <= 1.0, rep       # within fp16's 1e-3


@pytest.mark.horovod
def test_a_stage_without_trainable_variables_steps_with_the_others():
    for rep in reports("noweights", 2):
        assert rep["iterations"] == 3, rep                # the softmax-only rank stepped too
        assert rep["weight_diff"] < 1e-5, rep
