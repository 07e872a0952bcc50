"""`dapple emulate --runtime=tensorflow`: the TensorFlow-cluster job of `dapple launch
--runtime=tensorflow` across emulated hosts (a shaped 1 Gbit/s link between them), a server per
slot in its host's namespace at that host's address, the script once as the chief in host 0.

Transparency: the script (`tests/dapple/runtime/horovod/scripts/pipelined_rank.py`) computes
the plain Keras model's gradients, loss and weights after 3 Adam steps itself and reports the
differences (< 1e-5): a 2-stage pipeline with one stage per host (its boundary crosses the
link) and 2-replica data parallelism with one replica per host (the replicas' gradient sum
crosses it). Teardown: after success and after a failing script, no namespace, hosts file,
server or chief is left. Without a plan, `dapple topology --measure` times the link over
Send/Recv. A server that hangs on the other host (SIGSTOP) ends the job within 60
s, named by the chief's watchdog (`dapple.runtime.tf_cluster.watchdog`)."""
import json
import os
import re
import signal
import sys

import pytest

from emulaterun import emulate, leftovers, start_emulate
from topology.model import Topology
from tests.dapple.runtime.tf_cluster.tfrun import (SCRIPTS, finish, plan_file, processes_with,
                                                   stop_server_and_finish, wait_for)

TOLERANCE = 1e-5
CLUSTER = "2x1,net=1Gbps"
HOST_ADDRESSES = '["10.77.0.1:2222", "10.77.0.2:2222"]'     # task t on host t


def emulate_tf(tmp_path, argv, devices=2, cluster=CLUSTER, timeout=240):
    return emulate(cluster, argv, timeout=timeout,
                   flags=["--runtime=tensorflow", f"--plan={plan_file(tmp_path, devices)}"])


def cluster_of(result):
    m = re.search(r"tasks (\[.*?\]) serving", result.output)
    assert m, result.output[-3000:]
    return m.group(1)


def assert_nothing_left(result, chief_pid=None):
    assert not result.timed_out, result.output[-3000:]
    assert leftovers(result) == [], result.output[-2000:]
    assert processes_with(f"--cluster={cluster_of(result)}") == [], "a server outlived the job"
    if chief_pid is not None:
        assert not os.path.exists(f"/proc/{chief_pid}"), "the chief outlived the job"


@pytest.mark.horovod
@pytest.mark.parametrize("cluster, args, addresses", [
    pytest.param(CLUSTER, ["--cuts=2", "--replicas=1,1", "--micro_batches=4",
                           "--schedule=1f1b"], HOST_ADDRESSES,
                 id="2-stage-boundary-crosses-hosts"),
    pytest.param(CLUSTER, ["--cuts=", "--replicas=2", "--micro_batches=2"], HOST_ADDRESSES,
                 id="dp2-gradient-sum-crosses-hosts"),
    # stage 0 on host 0, stage 1's two replicas on host 1: the boundary's split crosses
    pytest.param("1+2,net=1Gbps", ["--cuts=3", "--replicas=1,2", "--micro_batches=4",
                                   "--schedule=gpipe"],
                 '["10.77.0.1:2222", "10.77.0.2:2222", "10.77.0.2:2223"]',
                 id="1:2-boundary-crosses-hosts", marks=pytest.mark.slow),
])
def test_weights_after_3_steps_equal_plain_keras_across_hosts(can_emulate, tmp_path, cluster,
                                                              args, addresses):
    devices = addresses.count(":")
    result = emulate_tf(tmp_path, ["pipelined_rank.py"] + args, devices, cluster)
    assert result.returncode == 0, result.output[-4000:]
    assert cluster_of(result) == addresses           # task t on the host of plan device t
    reports = [json.loads(t) for t in result.results().values()]
    assert len(reports) == 1, result.output[-4000:]      # the script ran once, as the chief
    rep = reports[0]
    assert rep["own_gradients"] > 0, rep
    assert rep["grad_diff"] < TOLERANCE, rep
    assert rep["loss_diff"] < TOLERANCE, rep
    assert rep["weight_diff"] < TOLERANCE, rep
    assert_nothing_left(result)


def chief_pid(result):
    return int(re.search(r"chief pid (\d+)", result.output).group(1))


@pytest.mark.horovod
@pytest.mark.parametrize("mode, status, said", [("ok", 0, "step 2 done"),
                                                ("fail", 1, "injected failure in step 2")],
                         ids=["success", "failing-script"])
def test_the_job_ends_with_the_scripts_status_and_tears_everything_down(can_emulate, tmp_path,
                                                                        mode, status, said):
    result = emulate_tf(tmp_path, [sys.executable, os.path.join(SCRIPTS, "fault_task.py"),
                                   f"--mode={mode}"])
    assert result.returncode == status, result.output[-3000:]
    assert said in result.output and "step 1 done" in result.output, result.output[-3000:]
    assert_nothing_left(result, chief_pid(result))


@pytest.mark.horovod
def test_a_hung_server_on_the_other_host_ends_the_job_within_60_s_naming_it(can_emulate,
                                                                             tmp_path):
    proc = start_emulate(CLUSTER, [sys.executable, os.path.join(SCRIPTS, "fault_task.py"),
                                   "--mode=loop"],
                         flags=["--runtime=tensorflow", f"--plan={plan_file(tmp_path, 2)}"])
    seen = wait_for(proc, "step 1 done")
    result, seconds = stop_server_and_finish(proc, seen, f"--cluster={HOST_ADDRESSES} --task=1")
    assert result.returncode == 75, result.output[-3000:]
    print(f"the job ended {seconds:.1f} s after the stop")
    assert seconds < 60
    assert ("[0]<stderr>:dapple: task 1 (10.77.0.2:2222) has not answered a status request"
            in result.output), result.output[-3000:]
    assert_nothing_left(result, chief_pid(result))


@pytest.mark.horovod
def test_sigterm_to_the_launcher_ends_every_task_and_tears_down(can_emulate, tmp_path):
    proc = start_emulate(CLUSTER, [sys.executable, os.path.join(SCRIPTS, "fault_task.py"),
                                   "--mode=loop"],
                         flags=["--runtime=tensorflow", f"--plan={plan_file(tmp_path, 2)}"])
    seen = wait_for(proc, "step 1 done")
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, timeout=60)
    result.output = seen + result.output
    assert result.returncode == 143, result.output[-3000:]
    assert "received SIGTERM; ending every task" in result.output
    assert_nothing_left(result, chief_pid(result))


def test_a_plan_that_does_not_fit_the_hosts_is_refused_before_anything_is_built(can_emulate,
                                                                                 tmp_path):
    result = emulate_tf(tmp_path, [sys.executable, "-c", "pass"], devices=3, timeout=60)
    assert result.returncode == 2, result.output[-3000:]
    assert ("dapple emulate: the plan does not fit the emulated hosts (host0:1,host1:1): "
            "--hosts provide 2 slots") in result.output, result.output[-3000:]
    assert "namespaces" not in result.output


def test_a_plan_needs_the_tensorflow_runtime(can_emulate):
    result = emulate(CLUSTER, [sys.executable, "-c", "pass"], timeout=60,
                     flags=["--plan=plan.json"])
    assert result.returncode == 2, result.output[-3000:]
    assert "--plan goes with --runtime=tensorflow" in result.output


@pytest.mark.horovod
def test_measure_without_a_plan_times_send_recv_between_the_hosts(can_emulate, tmp_path):
    """No plan: a task per slot, as `dapple launch --runtime=tensorflow --hosts` runs one.
    `dapple topology --measure`, the chief, times the shaped link between the two hosts over
    Send/Recv; figures checked only loosely (the shaping took effect), never as timings."""
    path = tmp_path / "topology.json"
    result = emulate("2x1,net=100Mbps", ["dapple", "topology", "--measure", "--format=json",
                                         f"--output={path}", "--message_size=2MiB"],
                     timeout=240, flags=["--runtime=tensorflow"])
    assert result.returncode == 0, result.output[-4000:]
    assert cluster_of(result) == HOST_ADDRESSES
    topo = Topology.from_dict(json.loads(path.read_text()))
    assert topo.devices_per_host == (1, 1)
    assert topo.measured["method"] == "tensorflow send/recv"
    assert [p["hosts"] for p in topo.measured["inter_host"]] == [[0, 1]]
    assert 0.3 * 100e6 / 8 < topo.inter_host_bandwidth < 1.5 * 100e6 / 8      # shaped
    assert_nothing_left(result)
