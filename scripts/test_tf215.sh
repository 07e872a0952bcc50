#!/usr/bin/env bash
# Runs dapple's test suite on the TensorFlow 2.15.1 stack (Python 3.11, numpy < 2, Keras 2 built
# into TensorFlow) in .venv-tf2.15, building that environment first if needed (~10 minutes the
# first time, mostly Horovod). CI checks the default stack (TensorFlow 2.18.1) only; run this by
# hand when a change may depend on the stack. Arguments go to pytest:
#
#   scripts/test_tf215.sh                 # the suite, as `make test` runs it
#   scripts/test_tf215.sh -m "" tests/dapple/runtime/horovod
set -euo pipefail
cd "$(dirname "$0")/.."
export DAPPLE_TF=2.15
bash scripts/setup_env.sh
exec "${DAPPLE_VENV:-.venv-tf2.15}/bin/python" -m pytest "$@"
