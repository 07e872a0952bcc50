#!/usr/bin/env bash
# Creates .venv and installs dapple's pinned stack into it. Idempotent: a second run, with
# everything in place, checks versions and returns in seconds.
#
#   DAPPLE_GPU=1   install tensorflow[and-cuda] and build Horovod with NCCL (GPU machines)
#   PYTHON=...     the interpreter to create .venv from (default: python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."

TF_VERSION=2.15.1
HOROVOD_VERSION=0.28.1
VENV=.venv
STAMP="$VENV/.dapple-env-ok"
WANT="tf=$TF_VERSION horovod=$HOROVOD_VERSION gpu=${DAPPLE_GPU:-0} setup=$(md5sum pyproject.toml setup.py scripts/setup_env.sh | md5sum | cut -c1-12)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade "pip<25" "setuptools<70" wheel

if [[ "${DAPPLE_GPU:-0}" == "1" ]]; then
  TF_REQ="tensorflow[and-cuda]==$TF_VERSION"
else
  TF_REQ="tensorflow-cpu==$TF_VERSION"
fi
echo "[setup] installing $TF_REQ, numpy<2, absl-py (first run: a few minutes)"
$PIP install --quiet "$TF_REQ" "numpy<2" absl-py cmake==3.27.9 packaging psutil cloudpickle pyyaml

if ! $VENV/bin/python -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
  echo "[setup] building horovod==$HOROVOD_VERSION from source with TensorFlow + Gloo (first run: ~8 minutes on 2 cores)"
  export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
         HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
  if [[ "${DAPPLE_GPU:-0}" == "1" ]]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
  fi
  # pip keeps the built wheel in its own cache, so a later fresh .venv on this machine skips the build.
  $PIP install --no-build-isolation "horovod==$HOROVOD_VERSION"
fi

echo "[setup] installing dapple (editable) with its test tools"
$PIP install --quiet --no-build-isolation -e ".[test,report]"
echo "$WANT" > "$STAMP"
echo "[setup] done"
