"""Transparency on TensorFlow's distributed runtime: `dapple launch --runtime=tensorflow` runs
`tests/dapple/runtime/horovod/scripts/pipelined_rank.py` once, as the chief, with one `tf.distribute.Server`
per other plan device; `PipelinedModel(model, plan)` finds the cluster in its environment. Its
gradients, loss and weights after 3 Adam steps equal the plain single-process Keras model's,
computed in the same script (max abs difference < 1e-5), with different data in every
micro-batch. BatchNormalization's moving statistics after 3 steps equal plain `fit`'s."""
import json

import pytest

from tfrun import cluster_of, plan_file, processes_with, tf_launch

TOLERANCE = 1e-5

CASES = [
    # (id, processes, script arguments, default suite)
    ("2:1", 3, ["--cuts=2", "--replicas=2,1", "--micro_batches=2", "--schedule=A"], True),
    ("dp2", 2, ["--cuts=", "--replicas=2", "--micro_batches=2"], True),
    # three replicas each training their copy: sums by reduce-scatter and all-gather
    ("dp3", 3, ["--cuts=", "--replicas=3", "--micro_batches=2"], True),
    ("interleaved-v2", 2, ["--cuts=1,2,3", "--replicas=1,1", "--micro_batches=4",
                           "--virtual_stages=2"], True),
    ("1:2", 3, ["--cuts=3", "--replicas=1,2", "--micro_batches=4", "--schedule=gpipe"], False),
    ("straight2-1f1b", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4",
                           "--schedule=1f1b"], False),
    ("zb-h1", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=zb-h1"],
     False),
    # PipelinedModel(inline_stage_calls=False): the stage calls kept out of line (by default
    # this runtime inlines them into the client's step)
    ("straight2-out-of-line", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4",
                                  "--schedule=1f1b", "--out_of_line_stage_calls"], True),
]


def no_server_left(result):
    cluster = cluster_of(result)
    assert cluster is not None, result.output[-3000:]
    assert processes_with(f"--cluster={cluster}") == [], "a server outlived the launch"


@pytest.mark.horovod
@pytest.mark.parametrize("case, processes, args", [
    pytest.param(c, n, a, marks=() if default else pytest.mark.slow, id=c)
    for c, n, a, default in CASES])
def test_weights_after_3_steps_equal_plain_keras(tmp_path, case, processes, args):
    result = tf_launch(plan_file(tmp_path, processes), ["pipelined_rank.py"] + args)
    assert result.returncode == 0, result.output[-4000:]
    reports = [json.loads(t) for t in result.results().values()]
    assert len(reports) == 1, result.output[-4000:]      # the script ran once, as the chief
    rep = reports[0]
    assert rep["grad_diff"] < TOLERANCE, rep
    assert rep["loss_diff"] < TOLERANCE, rep
    assert rep["weight_diff"] < TOLERANCE, rep
    assert rep["own_gradients"] > 0, rep                    # the chief holds every gradient
    # across tasks a pipeline runs unrolled by default; a one-stage plan's lanes still loop
    assert rep["pipeline_loop"] is False and rep["schedule_loops"] == 0, rep
    assert (rep["lane_loops"] > 0) == case.startswith("dp"), rep
    assert rep["inlined_stage_calls"] == [not case.endswith("-out-of-line")], rep
    if case == "dp3":       # every replica trains its own copy and sums on its own device
        assert rep["summed_on_every_replica"] == [0], rep
    no_server_left(result)


@pytest.mark.horovod
def test_batchnorm_moving_statistics_after_3_steps_equal_plain_fit(tmp_path):
    result = tf_launch(plan_file(tmp_path, 3), ["semantics_rank.py", "--case=batchnorm",
                                                "--steps=3"])
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    for name in ("dense_batchnorm", "conv_batchnorm"):
        assert rep[name + "_moved"] > 1e-2, rep          # the statistics did move
        assert rep[name] < 1e-5, rep
    no_server_left(result)


@pytest.mark.horovod
@pytest.mark.parametrize("case, processes", [
    pytest.param("tied", 2, marks=pytest.mark.slow), pytest.param("clip", 3, marks=pytest.mark.slow),
    ("mixed", 3)])      # mixed: a stage's weights kept on its device are AutoCastVariables too
def test_training_semantics_equal_plain_keras(tmp_path, case, processes):
    """A tied embedding across the cut, global-norm clipping, mixed precision's loss scale."""
    result = tf_launch(plan_file(tmp_path, processes), ["semantics_rank.py", f"--case={case}"])
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    if case == "mixed":
        got, want = zip(*rep["scales"])
        assert got == want and len(set(want)) > 2, rep     # grew and was halved, as plain
        assert rep["weight_closeness"] <= 1.0, rep        # within fp16's 1e-3
    else:
        assert rep["weight_diff"] < TOLERANCE, rep
        assert rep.get("embedding_moved", 1.0) > 1e-3, rep
        assert rep.get("clip_changed_weights", 1.0) > 1e-3, rep


@pytest.mark.horovod
def test_fit_evaluate_predict_equal_plain_keras(tmp_path):
    """A user's unchanged script (`tests/dapple/runtime/horovod/scripts/fit_rank.py`: fit with accuracy,
    sample weights and validation data, evaluate, predict on the plan in $DAPPLE_PLAN) on a
    1:2 plan over 3 processes gives what plain Keras gives."""
    from planner.formats.plan import straight_plan
    path = str(tmp_path / "plan.json")
    straight_plan([3], 5, 2, 12, replicas=[1, 2]).save(path)
    result = tf_launch(path, ["fit_rank.py"])
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    assert rep["history_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], rep
    assert rep["weight_diff"] < TOLERANCE and rep["history_diff"] < TOLERANCE, rep
    assert rep["eval_diff"] < TOLERANCE and rep["predict_diff"] < TOLERANCE, rep
    assert rep["predict_rows"] == 17, rep
    no_server_left(result)


GROUPED = [
    # (id, --hosts, script arguments, the tasks each unit's device must be on, in unit order)
    ("2:1", "localhost:2,127.0.0.1:1", ["--cuts=2", "--replicas=2,1", "--micro_batches=2",
                                        "--schedule=A"], [0, 0, 1]),
    ("1:2", "localhost:1,127.0.0.1:2", ["--cuts=3", "--replicas=1,2", "--micro_batches=4"],
     [0, 1, 1]),
]


@pytest.mark.horovod
@pytest.mark.parametrize("case, hosts, args, unit_tasks", GROUPED, ids=[g[0] for g in GROUPED])
def test_a_process_per_host_holding_its_slots_devices_equals_plain_keras(
        tmp_path, case, hosts, args, unit_tasks):
    """`--group_devices`: 2 processes for 3 plan devices; the replicas of one host's stage are
    two devices of one process (a copy between them, no Send/Recv)."""
    result = tf_launch(plan_file(tmp_path, 3), ["pipelined_rank.py"] + args, hosts=hosts,
                       launch_args=["--group_devices"])
    assert result.returncode == 0, result.output[-4000:]
    assert len(json.loads(cluster_of(result))) == 2, result.output[-3000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    assert rep["grad_diff"] < TOLERANCE and rep["weight_diff"] < TOLERANCE, rep
    assert rep["loss_diff"] < TOLERANCE, rep
    tasks = [int(d.split("/task:")[1].split("/")[0]) for d in rep["unit_devices"]]
    assert tasks == unit_tasks, rep
    assert len(set(rep["unit_devices"])) == 3, rep          # three devices, not one shared
    no_server_left(result)
