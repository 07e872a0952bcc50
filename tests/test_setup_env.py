"""scripts/setup_env.sh chooses a stack, an interpreter and an environment (checked with
--dry-run, which changes nothing), and the Makefile runs the environment of the chosen stack."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "setup_env.sh")


def clean_env(**extra):
    """This process's environment without a stack choice (scripts/test_tf215.sh sets one) and
    without an enclosing make's variables (`make test` runs this suite)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DAPPLE_TF", "DAPPLE_VENV", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return dict(env, **extra)


def setup(env, *args):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def bare_env(tmp_path, **extra):
    """PATH with only the tools the script needs (no python), and an empty pyenv root."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "cat", "md5sum", "cut", "sed", "dirname", "rm", "ls", "printf"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, tools / tool)
    (tmp_path / "pyenv").mkdir()
    return dict(PATH=str(tools), HOME=str(tmp_path), PYENV_ROOT=str(tmp_path / "pyenv"), **extra)


def test_an_unknown_stack_is_refused(tmp_path):
    proc = setup(clean_env(DAPPLE_TF="2.19", DAPPLE_VENV=str(tmp_path / "v")), "--dry-run")
    assert proc.returncode == 2
    assert "DAPPLE_TF=2.19 is not a stack dapple builds: use 2.18 (default) or 2.15" in proc.stderr
    assert not (tmp_path / "v").exists()


def test_no_python_for_the_stack_says_what_to_do(tmp_path):
    proc = setup(bare_env(tmp_path, DAPPLE_TF="2.15"), "--dry-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "TensorFlow 2.15.1 needs Python 3.11; none found on PATH or under pyenv" in proc.stderr
    assert "PYTHON=/path/to/python3.x" in proc.stderr


def test_a_pyenv_python_not_on_path_is_found(tmp_path):
    """pyenv's versions are searched (its shims fail for versions not selected)."""
    env = bare_env(tmp_path, DAPPLE_VENV=str(tmp_path / "v"))
    minor = "%d.%d" % sys.version_info[:2]
    version_bin = tmp_path / "pyenv" / "versions" / (minor + ".0") / "bin"
    version_bin.mkdir(parents=True)
    os.symlink(sys.executable, version_bin / ("python" + minor))
    proc = setup(dict(env, PYTHON=""), "--dry-run")
    if minor not in ("3.11", "3.12"):
        assert proc.returncode == 2
        return
    assert proc.returncode == 0, proc.stderr
    assert f"python: {version_bin / ('python' + minor)}" in proc.stdout
    assert f"python={minor} horovod=0.28.1" in proc.stdout
    assert "missing: would be created" in proc.stdout and not (tmp_path / "v").exists()


def test_the_default_stack_is_tensorflow_218_in_dot_venv(tmp_path):
    proc = setup(clean_env(PYTHON=sys.executable), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("stack: tensorflow==2.18.1 python=")
    assert "environment: .venv," in proc.stdout


def test_make_runs_the_chosen_stacks_environment():
    def dry(**env):
        return subprocess.run(["make", "-n", "--no-print-directory", "test"], capture_output=True, text=True, cwd=ROOT,
                              env=clean_env(**env)).stdout.splitlines()
    assert dry() == ["bash scripts/setup_env.sh", ".venv/bin/python -m pytest"]
    assert dry(DAPPLE_TF="2.15")[-1] == ".venv-tf2.15/bin/python -m pytest"


def test_a_gpu_build_names_what_it_lacks_before_building(tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    env = bare_env(tmp_path, DAPPLE_GPU="1", PYTHON=sys.executable, CUDA_HOME=str(cuda),
                   DAPPLE_VENV=str(tmp_path / "v"))
    proc = setup(env, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "stack: tensorflow[and-cuda]==2.18.1" in proc.stdout
    assert "nvcc (the CUDA 12 toolkit" in proc.stdout and f"nor in {cuda}/bin" in proc.stdout
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    proc = setup(dict(env, HOROVOD_NCCL_HOME=str(tmp_path)), "--dry-run")
    assert "horovod with NCCL: can be built (nvcc and NCCL found)" in proc.stdout, proc.stdout
