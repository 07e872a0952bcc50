"""`dapple topology --measure` on TensorFlow's distributed runtime: run as the chief under
`dapple launch --runtime=tensorflow`, it times Send/Recv between the tasks and writes the
topology JSON that `dapple plan --transfers=tensorflow` reads; outside any cluster (and not
under Horovod) it says how to run it. Figures are checked only for sense, never as timings
(docs/cluster.md, "Measuring the links", reports measured ones)."""
import json
import math
import os
import subprocess
import sys

from tests.dapple.runtime.horovod.hvdrun import REPO, light_rank_env
from tests.planner.test_plan_cli import write_profile
from tfrun import finish, plan_file, start

from dapple.tf_link_measure import devices_per_host
from topology.model import Topology

DAPPLE = os.path.join(os.path.dirname(sys.executable), "dapple")


def test_tasks_are_grouped_by_host_in_order():
    assert devices_per_host(["localhost:1", "localhost:2", "h2:2222", "h2:2223", "h3:2222"]) \
        == [2, 2, 1]
    assert devices_per_host(["localhost:1"]) == [1]


def test_measure_under_the_tensorflow_launcher_writes_a_topology_to_plan_with(tmp_path):
    """Launched with --hosts and no plan (the topology comes before any plan)."""
    path = tmp_path / "topology.json"
    command = [sys.executable, "-m", "dapple.cli", "launch", "--runtime=tensorflow",
               "--hosts=localhost:2", "--", DAPPLE, "topology", "--measure", "--format=json",
               f"--output={path}", "--message_size=2MiB"]
    result = finish(subprocess.Popen(command, cwd=REPO, env=light_rank_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True), timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    printed = [line.split(":", 1)[1] for line in result.output.splitlines()
               if line.startswith("[0]<stdout>:{")]
    assert len(printed) == 1, result.output[-4000:]
    topo = Topology.from_dict(json.loads(path.read_text()))
    assert Topology.from_dict(json.loads(printed[0])) == topo
    assert topo.devices_per_host == (2,)
    record = topo.measured
    assert record["method"] == "tensorflow send/recv"
    assert [p["ranks"] for p in record["intra_host"]] == [[0, 1]]
    assert record["inter_host"] == [] and record["assumed"]          # one host
    for figure in (topo.intra_host_bandwidth, topo.intra_host_latency):
        assert 0 < figure and math.isfinite(figure)
    # CPU tasks: a transfer end takes compute, measured on the chief against task 1
    assert record["transfer_cpu"]["ranks"] == [0, 1]
    assert 0 < topo.transfer_cpu_latency < 0.1 and 0 < topo.transfer_cpu_bandwidth
    assert math.isfinite(topo.transfer_cpu_bandwidth)
    profile, _ = write_profile(tmp_path)
    planned = subprocess.run([DAPPLE, "plan", f"--profile={profile}", f"--topology={path}",
                              "--transfers=tensorflow", "--global_batch_size=32"],
                             capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "links measured at" in planned.stdout


def test_the_measured_bandwidth_agrees_with_transfers_timed_another_way(tmp_path):
    """Tasks 0-1 (measured by the command's code) and 1-2 (a pair without the chief, as between
    hosts): each measured bandwidth against 32 MiB over the whole time of one call moving them
    (a lower bound of the link's rate), within a factor of 10: the measurement times real
    transfers, not a graph TensorFlow pruned."""
    result = finish(start(plan_file(tmp_path, 3), ["link_measure_check.py", str(2 * 2 ** 20)],
                          hosts="localhost:3"), timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    printed = [line.split(":", 1)[1] for line in result.output.splitlines()
               if line.startswith("[0]<stdout>:{")]
    figures = json.loads(printed[-1])
    assert figures["method"] == "tensorflow send/recv"
    assert [p[:2] for p in figures["pairs"]] == [[0, 1], [1, 2]]
    for _, _, measured, direct in figures["pairs"]:
        assert direct / 10 < measured < direct * 10, figures


def test_measure_outside_any_cluster_says_how_to_run_it():
    env = {k: v for k, v in os.environ.items()
           if k != "DAPPLE_TF_CLUSTER" and not k.startswith("HOROVOD_")}
    env.update(CUDA_VISIBLE_DEVICES="", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    result = subprocess.run([DAPPLE, "topology", "--measure"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2
    assert "dapple topology: --measure times the links between a job's processes" in \
        result.stderr
    assert "dapple launch --runtime=tensorflow" in result.stderr and "horovodrun" in \
        result.stderr


def test_the_launcher_wants_a_plan_or_with_the_tensorflow_runtime_hosts():
    result = subprocess.run([sys.executable, "-m", "dapple.cli", "launch",
                             "--runtime=tensorflow", "--", "true"], capture_output=True,
                            text=True, env=light_rank_env(), timeout=120)
    assert result.returncode == 2
    assert "--plan=plan.json is required (with --runtime=tensorflow, --hosts alone" in \
        result.stderr
