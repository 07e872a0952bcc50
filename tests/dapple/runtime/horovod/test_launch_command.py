"""`dapple launch` builds the horovodrun command from the plan (without running it), and refuses
host lists that disagree with the plan. Expected commands are written out by hand."""
import subprocess
import sys

import pytest

from dapple.runtime import launch
from planner.formats.plan import straight_plan

HVD = "horovodrun"


def plan_for(replicas, per_host=None):
    plan = straight_plan(list(range(1, len(replicas))), len(replicas), 2, replicas=replicas)
    if per_host is not None:
        plan.topology = {"name": "t", "devices_per_host": per_host}
    return plan


def test_one_host_plan_runs_on_localhost():
    cmd = launch.horovodrun_command(plan_for([1, 2]), ["python", "train.py", "--epochs=2"],
                                    horovodrun=HVD)
    assert cmd == [HVD, "-np", "3", "-H", "localhost:3", "--gloo", "python", "train.py",
                   "--epochs=2"]


def test_plan_with_a_schedule_the_runtime_does_not_run_is_refused():
    plan = straight_plan([1], 2, 4, replicas=[1, 1])
    plan.schedule = "dualpipe"          # a name this dapple does not know
    with pytest.raises(launch.LaunchError, match="schedule 'dualpipe'.*--schedule=1f1b"):
        launch.horovodrun_command(plan, ["python", "train.py"], horovodrun=HVD)


def test_relaxed_plans_launch():
    plan = straight_plan([1], 2, 4, replicas=[1, 1], schedule="2bw")
    assert launch.horovodrun_command(plan, ["python", "t.py"], horovodrun=HVD)[:3] == [
        HVD, "-np", "2"]


def test_two_servers_of_eight_gpus():
    plan = plan_for([8, 8], per_host=[8, 8])
    cmd = launch.horovodrun_command(plan, ["python", "t.py"], horovodrun=HVD,
                                    hosts=launch.parse_hosts("h1:8,h2:8"), controller="mpi",
                                    network_interface="eth0")
    assert cmd == [HVD, "-np", "16", "-H", "h1:8,h2:8", "--mpi", "--network-interface", "eth0",
                   "python", "t.py"]


def test_other_hosts_ssh_port_and_identity_file_go_to_horovodrun(tmp_path):
    key = tmp_path / "id_cluster"
    key.write_text("")
    cmd = launch.horovodrun_command(plan_for([8, 8], per_host=[8, 8]), ["python", "t.py"],
                                    horovodrun=HVD, hosts=launch.parse_hosts("h1:8,h2:8"),
                                    ssh=launch.Ssh(2200, str(key)))
    assert cmd == [HVD, "-np", "16", "-H", "h1:8,h2:8", "--gloo", "--ssh-port", "2200",
                   "--ssh-identity-file", str(key), "python", "t.py"]


def test_a_bad_ssh_port_or_identity_file_says_what_is_wrong(tmp_path):
    with pytest.raises(launch.LaunchError, match=r"--ssh_port=0 is not a port: give 1 to 65535"):
        launch.Ssh(port=0)
    with pytest.raises(launch.LaunchError, match=r"--ssh_identity_file=.*nope: no such file"):
        launch.Ssh(identity_file=str(tmp_path / "nope"))


def test_multi_host_plan_needs_host_names():
    with pytest.raises(launch.LaunchError, match=r"--hosts=host1:8,host2:8"):
        launch.horovodrun_command(plan_for([8, 8], per_host=[8, 8]), ["python", "t.py"])


def test_hosts_and_plan_device_count_disagree():
    with pytest.raises(launch.LaunchError, match=r"provide 12 slots .* plan uses 16 devices"):
        launch.horovodrun_command(plan_for([8, 8]), ["python", "t.py"],
                                  hosts=launch.parse_hosts("a:8,b:4"))


def test_hosts_with_other_slots_per_host_than_planned():
    with pytest.raises(launch.LaunchError, match=r"\[12, 4\] slots per host .* \[8, 8\]"):
        launch.horovodrun_command(plan_for([8, 8], per_host=[8, 8]), ["python", "t.py"],
                                  hosts=launch.parse_hosts("a:12,b:4"))


@pytest.mark.parametrize("text, message", [("a:8,,b:8", "empty entry"), ("a:x", "whole number"),
                                           ("a:0", "at least one slot"), ("a:2,a:2", "twice"),
                                           (":4", "no host name")])
def test_bad_host_lists(text, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.parse_hosts(text)


def test_host_without_slots_has_one():
    assert launch.parse_hosts("a,b:3") == [("a", 1), ("b", 3)]


def test_nothing_to_run():
    with pytest.raises(launch.LaunchError, match="after `--`"):
        launch.horovodrun_command(plan_for([1, 1]), [])


def test_environment_and_printed_line(tmp_path):
    env = launch.launch_env(str(tmp_path / "p.json"), step_timeout=30, first_step_timeout=90)
    assert env == {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "DAPPLE_PLAN": str(tmp_path / "p.json"),
                   "DAPPLE_STEP_TIMEOUT_SECONDS": "30", "DAPPLE_FIRST_STEP_TIMEOUT_SECONDS": "90"}
    line = launch.shell_line([HVD, "-np", "2", "python", "a b.py"], {"X": "1"})
    assert line == "X=1 horovodrun -np 2 python 'a b.py'"


def test_cli_dry_run_prints_the_command(tmp_path):
    path = tmp_path / "plan.json"
    plan_for([1, 1]).save(str(path))
    out = subprocess.run([sys.executable, "-m", "dapple.cli", "launch", f"--plan={path}",
                          "--horovodrun=hvdrun", "--dry_run", "--", "python", "train.py"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("hvdrun -np 2 -H localhost:2 --gloo python train.py")
    assert f"DAPPLE_PLAN={path}" in out.stdout


def test_cli_ssh_options_reach_horovodrun_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    plan_for([1, 1]).save(str(path))
    base = [sys.executable, "-m", "dapple.cli", "launch", f"--plan={path}",
            "--horovodrun=hvdrun", "--dry_run"]
    out = subprocess.run(base + ["--ssh_port=2200", "--", "python", "train.py"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("--gloo --ssh-port 2200 python train.py")
    out = subprocess.run(base + [f"--ssh_identity_file={tmp_path / 'nope'}", "--", "python",
                                 "train.py"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no such file" in out.stderr, out.stderr


def test_cli_refuses_disagreeing_hosts(tmp_path):
    path = tmp_path / "plan.json"
    plan_for([1, 1]).save(str(path))
    out = subprocess.run([sys.executable, "-m", "dapple.cli", "launch", f"--plan={path}",
                          "--hosts=a:3", "--dry_run", "--", "python", "train.py"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "3 slots" in out.stderr and "2 devices" in out.stderr


@pytest.mark.horovod
def test_launch_runs_fit_across_processes(tmp_path):
    """`dapple launch` really runs: fit (with accuracy and validation data), evaluate and
    predict under horovodrun (1:2 plan, 3 ranks) give every rank what plain Keras gives."""
    import json
    import os

    from hvdrun import LIGHT_RANK_ENV, REPO, SCRIPTS

    path = tmp_path / "plan.json"
    straight_plan([3], 5, 2, 12, replicas=[1, 2]).save(str(path))
    env = dict(os.environ, **LIGHT_RANK_ENV, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "dapple.cli", "launch", f"--plan={path}",
                          "--step_timeout=60", "--", sys.executable,
                          os.path.join(SCRIPTS, "fit_rank.py")],
                         capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "horovodrun -np 3 -H localhost:3 --gloo" in out.stdout.splitlines()[0]
    reports = [json.loads(line.split("DAPPLE_RESULT ", 1)[1])
               for line in out.stdout.splitlines() if "DAPPLE_RESULT " in line]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2]
    for r in reports:
        assert r["history_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], r
        assert r["weight_diff"] < 1e-5 and r["history_diff"] < 1e-5, r
        assert r["eval_diff"] < 1e-5 and r["predict_diff"] < 1e-5, r
        assert r["predict_rows"] == 17, r
