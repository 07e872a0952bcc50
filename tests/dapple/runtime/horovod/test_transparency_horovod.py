"""Transparency across processes: `dapple.PipelinedModel(model, plan)` under
`horovodrun -np N -H localhost:N --gloo` computes the plain single-process Keras model's
gradients and, after 3 Adam steps, its weights (float32, max abs difference < 1e-5).

Each rank computes the plain reference itself (same seed, same data) in
`scripts/pipelined_rank.py` and reports max differences; every step uses a new random global
batch, so every micro-batch holds different data (a transfer that delivered the wrong
micro-batch, or the same one twice, would show). The weights are compared after gathering every
stage's variables, so each rank checks the whole model.
"""
import json

import pytest

from hvdrun import horovodrun

TOLERANCE = 1e-5

CASES = [
    # (id, ranks, script arguments)
    ("straight2", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=A"]),
    ("straight3", 3, ["--cuts=1,3", "--replicas=1,1,1", "--micro_batches=4", "--schedule=B"]),
    ("2:1", 3, ["--cuts=2", "--replicas=2,1", "--micro_batches=2", "--schedule=A"]),
    ("1:2", 3, ["--cuts=3", "--replicas=1,2", "--micro_batches=4", "--schedule=gpipe"]),
    ("2:2", 4, ["--cuts=2", "--replicas=2,2", "--micro_batches=2", "--schedule=A"]),
    ("dp2", 2, ["--cuts=", "--replicas=2", "--micro_batches=2"]),
    # one micro-batch: the stage's call inlined (as every call by default), its gradients in
    # groups
    ("dp2-M1", 2, ["--cuts=", "--replicas=2", "--micro_batches=1"]),
    ("dp4", 4, ["--cuts=", "--replicas=4", "--micro_batches=2"]),
    # a hand-made plan listing devices out of replica order: rows reordered on both sides
    ("2:1-devices-2,0/1", 3, ["--cuts=2", "--replicas=2,1", "--micro_batches=2",
                              "--stage_devices=2,0/1"]),
    # interleaved: 4 chunks on 2 device groups, each rank runs two chunks
    ("interleaved-v2", 2, ["--cuts=1,2,3", "--replicas=1,1", "--micro_batches=4",
                           "--virtual_stages=2"]),
    ("interleaved-v2-2:1", 3, ["--cuts=1,2,3", "--replicas=2,1", "--micro_batches=2",
                               "--virtual_stages=2"]),
    ("interleaved-v2-dp2", 2, ["--cuts=2", "--replicas=2", "--micro_batches=4",
                               "--virtual_stages=2"]),
    # zero bubble: each backward split into I and W
    ("zb-h1", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=zb-h1"]),
    ("zb-h1-2:1", 3, ["--cuts=1", "--replicas=2,1", "--micro_batches=4", "--schedule=zb-h1"]),
    ("zb-h1-1:2", 3, ["--cuts=3", "--replicas=1,2", "--micro_batches=8", "--schedule=zb-h1",
                      "--global_batch=32"]),
    ("zb-h1-dp2", 2, ["--cuts=", "--replicas=2", "--micro_batches=1", "--schedule=zb-h1"]),
    # PipelinedModel(inline_stage_calls=False): each rank's stage calls kept out of line (by
    # default they are inlined into its step)
    ("straight2-out-of-line", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4",
                                  "--schedule=1f1b", "--out_of_line_stage_calls"]),
]


def check_ranks(result, ranks, weightless_stages=()):
    assert result.returncode == 0, result.output[-4000:]
    reports = {r: json.loads(text) for r, text in result.results().items()}
    assert sorted(reports) == list(range(ranks)), result.output[-4000:]
    for rank, rep in reports.items():
        # every rank computed its own stage's gradients, all of them
        assert rep["own_gradients"] == rep["stage_variables"], rep
        assert (rep["stage_variables"] == 0) == (rep["stage"] in weightless_stages), rep
        assert rep["grad_diff"] < TOLERANCE, rep
        assert rep["loss_diff"] < TOLERANCE, rep
        assert rep["weight_diff"] < TOLERANCE, rep
    return reports


# In the slow suite, for time: each has a default sibling (straight2, dp2, zb-h1-2:1).
SLOW_IDS = {"straight3", "dp4", "zb-h1-1:2"}


@pytest.mark.horovod
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c[0] in SLOW_IDS
                                               else ()) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_gradients_and_weights_equal_plain_model(case):
    name, ranks, args = case
    result = horovodrun(ranks, ["pipelined_rank.py"] + args, timeout=240)
    reports = check_ranks(result, ranks)
    stages = sorted({rep["stage"] for rep in reports.values()})     # device groups
    assert stages == list(range(len(args[1].split("=")[1].split(",")))), reports
    for rep in reports.values():    # across ranks a pipeline runs unrolled by default
        assert rep["pipeline_loop"] is False and rep["schedule_loops"] == 0, rep
        # inlined unless asked not to
        assert rep["inlined_stage_calls"] == ["--out_of_line_stage_calls" not in args], rep


@pytest.mark.horovod
def test_skip_connection_relayed_and_two_outputs():
    """Dict inputs with the second entering late, two outputs, replicas 1:2:1."""
    result = horovodrun(4, ["pipelined_rank.py", "--model=two_in_two_out", "--cuts=1,4",
                            "--replicas=1,2,1", "--micro_batches=2", "--schedule=B"],
                        timeout=240)
    check_ranks(result, 4)


@pytest.mark.horovod
def test_boundary_of_integers_only():
    """Stage 0 (no variables, replicas 2:1) hands stage 1 only int32 token ids: no gradient
    crosses that boundary, and every rank of it skips the backward collective alike (a rank
    that waited for one would hang the job)."""
    result = horovodrun(3, ["pipelined_rank.py", "--model=integer_boundary", "--cuts=1",
                            "--replicas=2,1", "--micro_batches=2", "--schedule=B"], timeout=240)
    reports = check_ranks(result, 3, weightless_stages=(0,))
    assert sorted(rep["stage"] for rep in reports.values()) == [0, 0, 1], reports


@pytest.mark.horovod
def test_checkpoint_written_once_restores_into_the_plain_model(tmp_path):
    """save_weights under horovodrun: one Keras-format file with every stage's variables,
    written by one rank (no temporary files left); a fresh plain model loads it and holds the
    plain reference's trained weights."""
    path = tmp_path / "ckpt.h5"
    result = horovodrun(4, ["pipelined_rank.py", "--cuts=2", "--replicas=2,2",
                            "--micro_batches=2", f"--checkpoint={path}"], timeout=240)
    reports = check_ranks(result, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.h5"]
    for rep in reports.values():
        assert rep["checkpoint_diff"] is not None and rep["checkpoint_diff"] < TOLERANCE, rep
