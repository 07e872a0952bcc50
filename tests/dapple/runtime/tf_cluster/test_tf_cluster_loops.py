"""Loops on TensorFlow's distributed runtime: `PipelinedModel(model, plan, pipeline_loop=True)`
under `dapple launch --runtime=tensorflow` runs a pipeline's steady periods as a
`tf.while_loop` whose body spans the tasks, and a data-parallel plan's lanes as loops
(`micro_batch_loop`, the default). Gradients, loss and weights after 3 Adam steps equal the plain
single-process Keras model's (max abs difference < 1e-5; `pipelined_rank.py`), the step holds
the While ops the schedule needs (so it cannot silently unroll), and every loop's gradient
accumulators live on their unit's task. BatchNormalization's moving statistics after 3 looped
steps equal plain `train_on_batch`'s."""
import json

import pytest

from tfrun import plan_file, tf_launch
from test_tf_cluster_transparency import no_server_left

TOLERANCE = 1e-5

CASES = [
    # (id, processes, script arguments, While ops in the step, default suite)
    ("1f1b", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=1f1b"], 1,
     True),
    ("gpipe", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=gpipe"], 2,
     False),
    ("interleaved-v2", 2, ["--cuts=1,2,3", "--replicas=1,1", "--micro_batches=8",
                           "--virtual_stages=2"], 1, False),
    ("zb-h1", 2, ["--cuts=2", "--replicas=1,1", "--micro_batches=4", "--schedule=zb-h1"], 1,
     False),
    ("2:1", 3, ["--cuts=2", "--replicas=2,1", "--micro_batches=4", "--schedule=1f1b"], 1,
     False),
    ("1:2", 3, ["--cuts=3", "--replicas=1,2", "--micro_batches=4", "--schedule=1f1b"], 1,
     False),
    # one stage: each lane's loop, in the lane's own function
    ("dp2-lanes", 2, ["--cuts=", "--replicas=2", "--micro_batches=2"], 2, False),
]


def task_of(device: str) -> int:
    return int(device.split("/task:")[1].split("/")[0])


@pytest.mark.horovod
@pytest.mark.parametrize("case, processes, args, while_ops", [
    pytest.param(c, n, a, w, marks=() if default else pytest.mark.slow, id=c)
    for c, n, a, w, default in CASES])
def test_looped_weights_after_3_steps_equal_plain_keras(tmp_path, case, processes, args,
                                                        while_ops):
    result = tf_launch(plan_file(tmp_path, processes),
                       ["pipelined_rank.py", "--pipeline_loop"] + args)
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    assert rep["grad_diff"] < TOLERANCE, rep
    assert rep["loss_diff"] < TOLERANCE, rep
    assert rep["weight_diff"] < TOLERANCE, rep
    assert rep["while_ops"] == while_ops, rep
    # every looped unit's accumulators on its own task: units in (stage, replica) order, as
    # `unit_devices` lists their devices
    units = sorted(rep["accumulator_devices"], key=lambda u: tuple(map(int, u.split(","))))
    assert len(units) == (0 if case == "dp2-lanes" else len(rep["unit_devices"])), rep
    for unit, device in zip(units, rep["unit_devices"]):
        assert all(task_of(d) == task_of(device) for d in rep["accumulator_devices"][unit]), rep
    no_server_left(result)


@pytest.mark.horovod
def test_looped_batchnorm_moving_statistics_after_3_steps_equal_plain(tmp_path):
    result = tf_launch(plan_file(tmp_path, 3), ["semantics_rank.py", "--case=batchnorm",
                                                "--steps=3", "--pipeline_loop"])
    assert result.returncode == 0, result.output[-4000:]
    (rep,) = [json.loads(t) for t in result.results().values()]
    for name in ("dense_batchnorm", "conv_batchnorm"):
        assert rep[name + "_schedule_loops"] > 0, rep    # the steps ran looped
        assert rep[name + "_moved"] > 1e-2, rep          # the statistics did move
        assert rep[name] < 1e-5, rep
    no_server_left(result)
