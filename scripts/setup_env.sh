#!/usr/bin/env bash
# Creates a virtual environment and installs one of dapple's pinned stacks into it. Idempotent:
# a second run, with everything in place, checks a stamp and returns in seconds.
#
#   DAPPLE_TF=2.18   (default) TensorFlow 2.18.1 + tf_keras 2.18 (Keras 2), Python 3.12, else
#                    3.11; into .venv
#   DAPPLE_TF=2.15   TensorFlow 2.15.1 (Keras 2 built in), numpy < 2, Python 3.11; into .venv-tf2.15
#   DAPPLE_GPU=1     tensorflow[and-cuda] and Horovod built with NCCL (GPU machines)
#   PYTHON=...       the interpreter to create the environment from (default: the first of the
#                    stack's Python versions found on PATH or under pyenv)
#   DAPPLE_VENV=...  the environment's directory (default above)
#
#   scripts/setup_env.sh --dry-run   prints the stack, the interpreter and the environment's
#                                    state, and changes nothing
#
# Horovod 0.28.1 is built from source against the installed TensorFlow (about 10 minutes on 2
# cores); the wheel is kept in ~/.cache/dapple/horovod under a name that says which TensorFlow,
# Python and GPU build it is for, so a later fresh environment of the same stack skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION=0.28.1
case "${DAPPLE_TF:-2.18}" in
  2.18|2.18.1)
    # tensorflow, not tensorflow-cpu: tf_keras requires `tensorflow`, and both wheels would
    # then share one directory. On a machine without CUDA it runs on the CPU.
    TF_VERSION=2.18.1; TF_PACKAGE=tensorflow; EXTRA_REQS="tf_keras==2.18.0"; PYTHONS="3.12 3.11"
    DEFAULT_VENV=.venv ;;
  2.15|2.15.1)
    TF_VERSION=2.15.1; TF_PACKAGE=tensorflow-cpu; EXTRA_REQS="numpy<2"; PYTHONS="3.11"
    DEFAULT_VENV=.venv-tf2.15 ;;
  *)
    echo "[setup] DAPPLE_TF=${DAPPLE_TF} is not a stack dapple builds: use 2.18 (default) or 2.15" >&2
    exit 2 ;;
esac
GPU=${DAPPLE_GPU:-0}
VENV=${DAPPLE_VENV:-$DEFAULT_VENV}
if [[ "$GPU" == "1" ]]; then
  TF_REQ="tensorflow[and-cuda]==$TF_VERSION"
else
  TF_REQ="$TF_PACKAGE==$TF_VERSION"
fi

# The interpreter: $PYTHON, else the first of $PYTHONS that runs (on PATH, then under pyenv).
# A pyenv shim for a version that is installed but not selected exists yet fails to run, so each
# candidate is run, and its real path taken from sys.executable.
find_python() {
  local v cand
  for v in $PYTHONS; do
    for cand in "python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v"*/bin/"python$v"; do
      if "$cand" -c "import venv, ensurepip" >/dev/null 2>&1; then
        "$cand" -c "import sys; print(sys.executable)"
        return 0
      fi
    done
  done
  return 1
}
if [[ -n "${PYTHON:-}" ]]; then
  PY=$("$PYTHON" -c "import sys; print(sys.executable)")
else
  PY=$(find_python) || {
    echo "[setup] TensorFlow $TF_VERSION needs Python $(echo $PYTHONS | sed 's/ / or /g'); none found" \
         "on PATH or under pyenv. Install one, or set PYTHON=/path/to/python3.x" >&2
    exit 2
  }
fi
PY_MINOR=$("$PY" -c "import sys; print('%d.%d' % sys.version_info[:2])")

# Which stack an environment holds. A different stack (TensorFlow, Python, GPU) means a new
# environment: Horovod is compiled against one TensorFlow and would not load with another.
STACK="$TF_REQ python=$PY_MINOR horovod=$HOROVOD_VERSION"
STAMP="$VENV/.dapple-env-ok"
WANT="$STACK setup=$(cat pyproject.toml setup.py scripts/setup_env.sh | md5sum | cut -c1-12)"
HELD=$(cat "$VENV/.dapple-stack" 2>/dev/null || echo unknown)

# What a Horovod build with NCCL needs besides TensorFlow: CUDA's compiler (Horovod compiles CUDA
# kernels) and NCCL's header and library. Prints what is missing; nothing when all is there.
gpu_build_missing() {
  local cuda=${CUDA_HOME:-/usr/local/cuda}
  if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x "$cuda/bin/nvcc" ]]; then
    echo "nvcc (the CUDA 12 toolkit; TensorFlow $TF_VERSION's wheels use CUDA 12): not on PATH" \
         "nor in ${cuda}/bin; install it or set CUDA_HOME"
  fi
  if [[ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" ]] && [[ ! -f /usr/include/nccl.h ]] \
     && [[ ! -f "$cuda/include/nccl.h" ]]; then
    echo "NCCL: no nccl.h in /usr/include or $cuda/include; install libnccl2 and libnccl-dev" \
         "(NVIDIA's CUDA apt repository) or set HOROVOD_NCCL_HOME"
  fi
}
if [[ "${1:-}" == "--dry-run" ]]; then
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then state="up to date"
  elif [[ ! -e "$VENV" ]]; then state="missing: would be created"
  elif [[ "$HELD" != "$STACK" ]]; then state="holds another stack ($HELD): would be recreated"
  else state="would be updated"; fi
  printf 'stack: %s\npython: %s\nenvironment: %s, %s\n' "$STACK" "$PY" "$VENV" "$state"
  if [[ "$GPU" == "1" ]]; then
    missing=$(gpu_build_missing)
    echo "horovod with NCCL: ${missing:-can be built (nvcc and NCCL found)}"
  fi
  exit 0
fi
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
if [[ -e "$VENV" && "$HELD" != "$STACK" ]]; then
  echo "[setup] $VENV holds another stack ($HELD); recreating it for: $STACK"
  rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $PY (Python $PY_MINOR)"
  "$PY" -m venv "$VENV"
  echo "$STACK" > "$VENV/.dapple-stack"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade "pip<25" "setuptools<70" wheel

echo "[setup] installing $TF_REQ $EXTRA_REQS, absl-py (first run: a few minutes)"
$PIP install --quiet "$TF_REQ" $EXTRA_REQS absl-py cmake==3.27.9 packaging psutil cloudpickle pyyaml

horovod_loads() {
  "$VENV/bin/python" -c "import horovod, horovod.tensorflow, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" \
    >/dev/null 2>&1
}
if ! horovod_loads; then
  WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/dapple/horovod/$HOROVOD_VERSION-tf$TF_VERSION-py$PY_MINOR-$([[ "$GPU" == 1 ]] && echo nccl || echo cpu)"
  install_cached() {
    $PIP install --quiet --no-deps --no-index --find-links "$WHEELS" "horovod==$HOROVOD_VERSION" && horovod_loads
  }
  if ! { ls "$WHEELS"/horovod-*.whl >/dev/null 2>&1 && install_cached; }; then
    if [[ "$GPU" == "1" ]]; then
      missing=$(gpu_build_missing)
      if [[ -n "$missing" ]]; then
        echo "[setup] DAPPLE_GPU=1 builds Horovod with NCCL, which needs:" >&2
        echo "$missing" | sed 's/^/  - /' >&2
        exit 2
      fi
    fi
    echo "[setup] building horovod==$HOROVOD_VERSION from source with TensorFlow $TF_VERSION + Gloo" \
         "$([[ "$GPU" == 1 ]] && echo "+ NCCL ")(first run: ~10 minutes on 2 cores)"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
           HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
    if [[ "$GPU" == "1" ]]; then
      export HOROVOD_GPU_OPERATIONS=NCCL
      if [[ -n "${CUDA_HOME:-}" ]]; then export HOROVOD_CUDA_HOME=$CUDA_HOME; fi
    fi
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    # Not pip's own wheel cache: it keys a wheel by the source archive only, so a Horovod built
    # against one TensorFlow would be reused for another of the same Python.
    $PIP wheel --no-cache-dir --no-build-isolation --no-deps -w "$WHEELS" "horovod==$HOROVOD_VERSION"
    install_cached
  fi
fi

echo "[setup] installing dapple (editable) with its test tools"
$PIP install --quiet --no-build-isolation -e ".[test,report]"
echo "$WANT" > "$STAMP"
echo "[setup] done: $VENV is Python $PY_MINOR with TensorFlow $TF_VERSION"
