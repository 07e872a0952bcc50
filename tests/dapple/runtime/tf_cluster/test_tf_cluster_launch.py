"""The TensorFlow-cluster launcher's plain parts (no processes): tasks and their addresses, and
the errors a user gets for a cluster that cannot work."""
import json
import os

import pytest

from dapple.runtime.launch import LaunchError, Ssh
from dapple.runtime.tf_cluster import launch
from dapple.runtime.tf_cluster.cluster import ClusterError, parse_addresses


def test_one_task_per_slot_host_by_host_with_free_local_ports():
    tasks = launch.task_addresses([("localhost", 2), ("gpu2", 3)])
    assert [h for h, _ in tasks] == [0, 0, 1, 1, 1]
    local = [a for h, a in tasks if h == 0]
    assert all(a.startswith("localhost:") for a in local) and len(set(local)) == 2
    assert [a for h, a in tasks if h == 1] == ["gpu2:2222", "gpu2:2223", "gpu2:2224"]
    assert [a for _, a in launch.task_addresses([("localhost", 2)], port=5000)] == [
        "localhost:5000", "localhost:5001"]


def test_the_chief_runs_here_so_the_first_host_must_be_this_machine():
    with pytest.raises(LaunchError, match="list this machine first"):
        launch.task_addresses([("gpu1", 8), ("localhost", 8)])


def test_remote_servers_start_over_ssh_in_this_directory():
    argv = launch.remote("gpu2", ["python", "-m", "dapple.runtime.tf_cluster.server", "--task=3"],
                         {"A": "b c"})
    assert argv[:6] == ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
    assert argv[6] == "gpu2"
    assert argv[7].startswith(f"cd {os.getcwd()} && env A='b c' python -m")


def test_remote_servers_take_the_ssh_port_and_identity_file(tmp_path):
    key = tmp_path / "id_cluster"
    key.write_text("")
    argv = launch.remote("gpu2", ["python"], {}, Ssh(2200, str(key)))
    assert argv[6:11] == ["-p", "2200", "-i", str(key), "gpu2"]


def test_a_bad_cluster_description_says_what_is_expected():
    assert parse_addresses(json.dumps(["h:1", "h:2"])) == ["h:1", "h:2"]
    for bad in ("h:1", "[]", '["h"]', "[1]"):
        with pytest.raises(ClusterError, match="host:port"):
            parse_addresses(bad)


def test_the_tensorflow_runtime_outside_a_cluster_says_how_to_launch(monkeypatch):
    import dapple  # noqa: F401  (Keras 2 first)
    from dapple.runtime.tf_cluster.runtime import TFClusterRuntime
    from planner.formats.plan import straight_plan
    monkeypatch.delenv("DAPPLE_TF_CLUSTER", raising=False)
    with pytest.raises(ClusterError, match="dapple launch --runtime=tensorflow"):
        TFClusterRuntime(straight_plan([2], 5, 2, 8))


def test_the_task_watchdogs_timeout_must_be_seconds(monkeypatch):
    from dapple.runtime.tf_cluster import watchdog
    monkeypatch.setenv(watchdog.ENV_TASK_TIMEOUT, "12.5")
    assert watchdog.timeout_from_environment() == 12.5
    monkeypatch.delenv(watchdog.ENV_TASK_TIMEOUT)
    assert watchdog.timeout_from_environment() == watchdog.DEFAULT_TIMEOUT_SECONDS
    for bad in ("soon", "-1"):
        monkeypatch.setenv(watchdog.ENV_TASK_TIMEOUT, bad)
        with pytest.raises(ValueError, match="expected seconds >= 0"):
            watchdog.timeout_from_environment()


def test_the_task_watchdog_names_a_task_that_does_not_answer():
    """Nothing listens at task 1's address: it never answers, and is named after the timeout
    (the chief's own task 0 is never asked)."""
    import threading
    import time
    from dapple.runtime.tf_cluster.watchdog import TaskWatchdog
    silent, called = [], threading.Event()
    addresses = ["localhost:1", f"localhost:{launch.free_port()}"]
    dog = TaskWatchdog(addresses, timeout=1.0,
                       on_silent=lambda *a: (silent.append(a), called.set()))
    started = time.monotonic()
    dog.start()
    try:
        assert called.wait(20), "the watchdog never reported the silent task"
    finally:
        dog.stop()
    (task, address, seconds), = silent
    assert (task, address) == (1, addresses[1]) and seconds > 1.0
    assert time.monotonic() - started < 10


def test_the_task_watchdog_names_the_longest_silent_task_first():
    from dapple.runtime.tf_cluster.watchdog import TaskWatchdog
    dog = TaskWatchdog(["localhost:1"] + [f"localhost:{launch.free_port()}"] * 3, timeout=30.0)
    dog.last_answer = {1: 100.0, 2: 60.0, 3: 40.0}        # task 3 silent longest
    assert dog.silent(now=110.0) == [3, 2]
    assert dog.silent(now=50.0) == []


def test_a_chief_exits_while_its_task_watchdog_is_asking():
    """Each run ends its main thread at another point of the watchdog's requests; before the
    requests were blocking calls, about half of the runs hung at interpreter shutdown (a gRPC
    polling thread refused, its request never completed, closing the channel waiting on it)."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "scripts", "watchdog_at_exit.py")
    for seconds in ("0.1", "0.25", "0.4", "0.55", "0.7", "0.85"):
        try:
            run = subprocess.run([sys.executable, script, seconds], capture_output=True,
                                 text=True, timeout=60)
        except subprocess.TimeoutExpired as hung:
            raise AssertionError(f"the chief hung at exit after {seconds} s: "
                                 f"{hung.stderr!s:.2000}") from None
        assert run.returncode == 0 and "main thread done" in run.stdout, run.stderr[-2000:]
        assert "can't create new thread" not in run.stderr, run.stderr[-2000:]


def test_grouped_devices_make_one_task_per_host_holding_its_slots():
    hosts = [("localhost", 2), ("gpu2", 3)]
    tasks = launch.task_addresses(hosts, group_devices=True)
    assert [h for h, _ in tasks] == [0, 1] and tasks[1][1] == "gpu2:2222"
    assert launch.task_devices(hosts, True) == [2, 3]
    assert launch.task_devices(hosts, False) == [1, 1, 1, 1, 1]
    assert launch.server_argv(["h:1", "h:2"], 1, 3)[-2:] == ["--task=1", "--devices=3"]


def test_a_bad_device_count_description_says_what_is_expected():
    from dapple.runtime.tf_cluster.cluster import parse_device_counts
    assert parse_device_counts("[2, 1]", 2) == [2, 1]
    for bad in ("[2]", "[0, 1]", "two", '["2", 1]', "[true, 1]"):
        with pytest.raises(ClusterError, match="DAPPLE_TF_TASK_DEVICES"):
            parse_device_counts(bad, 2)
