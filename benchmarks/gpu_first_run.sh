#!/usr/bin/env bash
# dapple's first run on a multi-GPU host, in one go: the table the README asks for.
#
#   DAPPLE_GPU=1 scripts/setup_env.sh          # tensorflow[and-cuda] 2.18.1, Horovod with NCCL
#   benchmarks/gpu_first_run.sh [OUTPUT_DIR]   # default out/gpu_first_run
#
# 1. the machine's GPUs and the links between them (nvidia-smi), and what TensorFlow and
#    Horovod see;
# 2. a profile of one example model (dapple profile, on GPU 0);
# 3. the planner's plan for this host (dapple plan);
# 4. the pipelined step time (dapple verify --timing: the plan on this host's GPUs, one
#    process, after checking its gradients against the plain model's) against plain Horovod
#    data parallelism on every GPU (benchmarks/plain_dp_step.py under horovodrun), same model,
#    global batch, loss and optimizer;
# 5. predicted (cost model), simulated and measured step time of the plan;
# then a markdown table of it all in OUTPUT_DIR/first_run.md.
#
# Settings (environment): MODEL (module:builder), MODEL_ARGS (JSON), PROFILE_BATCH,
# GLOBAL_BATCH, TOPOLOGY (what dapple plan takes; default from nvidia-smi: 1xN, the smallest
# GPU's memory, NVLink's bandwidth if the GPUs have NVLink, else PCIe's 12 GB/s), TOLERANCE
# (verify's gradient tolerance; GPUs compute in TF32, default 1e-3), STEPS, PYTHON, NVIDIA_SMI.
# With GPUs the model is a BERT-base-style encoder (examples/bert.py, 12 x 768, 128 tokens).
#
# With fewer than 2 GPUs (a CPU machine) the script still runs: it prints what it found,
# profiles and plans a small encoder on the CPU (every step up to the plan is exercised), and
# skips the timed runs, saying why (tests/benchmarks/test_gpu_first_run.py runs it so).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/gpu_first_run}
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
SMI=${NVIDIA_SMI:-nvidia-smi}
SKIPPED=()
skip() { echo "   SKIPPED: $*"; SKIPPED+=("$*"); }
dapple() { "$BIN/dapple" "$@"; }

echo "== 1. GPUs and links"
if command -v "$SMI" >/dev/null 2>&1 && "$SMI" -L >/dev/null 2>&1; then
  "$SMI" -L
  "$SMI" topo -m || true
  SMI_GPUS=$("$SMI" -L | grep -c '^GPU' || true)
else
  SMI_GPUS=0
  skip "listing GPUs and links: nvidia-smi is missing or finds no GPU on this machine"
fi
GPUS=$("$PY" -c "import dapple, tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))" \
       2>"$OUT/tensorflow.log") || { cat "$OUT/tensorflow.log" >&2; exit 1; }
echo "   TensorFlow sees $GPUS GPU(s)"
if [[ "$SMI_GPUS" -gt 0 && "$GPUS" -eq 0 ]]; then
  echo "   nvidia-smi lists $SMI_GPUS GPU(s) but this environment's TensorFlow has none: build" \
       "the GPU stack with DAPPLE_GPU=1 scripts/setup_env.sh"
fi
if "$BIN/horovodrun" --check-build 2>/dev/null | grep -q '\[X\] NCCL'; then
  echo "   Horovod: built with NCCL"
else
  echo "   Horovod: built without NCCL (DAPPLE_GPU=1 scripts/setup_env.sh builds it with NCCL)"
fi

MODEL=${MODEL:-examples.bert:build}
if [[ "$GPUS" -ge 2 ]]; then
  BERT_BASE='{}'
  MODEL_ARGS=${MODEL_ARGS:-$BERT_BASE}
  PROFILE_BATCH=${PROFILE_BATCH:-16}
  GLOBAL_BATCH=${GLOBAL_BATCH:-$((16 * GPUS))}
  if [[ -z "${TOPOLOGY:-}" ]]; then
    MEM_MIB=$("$SMI" --query-gpu=memory.total --format=csv,noheader,nounits | sort -n | head -1)
    TOPOLOGY="1x$GPUS,mem=$((MEM_MIB / 1024))GB"
    if ! "$SMI" topo -m 2>/dev/null | grep -q 'NV[0-9]'; then
      TOPOLOGY="$TOPOLOGY,nvlink=12GB/s"   # no NVLink: PCIe between the GPUs
    fi
  fi
else
  SMALL='{"num_layers": 2, "hidden": 64, "heads": 2, "seq_len": 16, "vocab": 256}'
  MODEL_ARGS=${MODEL_ARGS:-$SMALL}
  PROFILE_BATCH=${PROFILE_BATCH:-8}
  GLOBAL_BATCH=${GLOBAL_BATCH:-16}
  TOPOLOGY=${TOPOLOGY:-1x2}
  echo "   fewer than 2 GPUs: a small model on the CPU, planned for $TOPOLOGY, checks the steps" \
       "up to the plan; the timed runs are skipped"
fi

echo
echo "== 2. profile $MODEL $MODEL_ARGS at batch $PROFILE_BATCH"
dapple profile --model="$MODEL" --model_args="$MODEL_ARGS" --batch_size="$PROFILE_BATCH" \
  --output="$OUT/profile.json"

echo
echo "== 3. plan for $TOPOLOGY, global batch $GLOBAL_BATCH"
dapple plan --profile="$OUT/profile.json" --topology="$TOPOLOGY" --global_batch_size="$GLOBAL_BATCH" \
  --even_slices --schedule=1f1b --output="$OUT/plan.json" | tee "$OUT/plan.txt"

echo
echo "== 4. pipelined step (dapple) against plain Horovod data parallelism"
PIPE_MS="" DP_MS="" PRED_MS="" SIM_MS=""
if [[ "$GPUS" -ge 2 ]]; then
  if dapple verify --plan="$OUT/plan.json" --model="$MODEL" --model_args="$MODEL_ARGS" --timing \
       --profile="$OUT/profile.json" --topology="$TOPOLOGY" --intra_op_threads=0 \
       --tolerance="${TOLERANCE:-1e-3}" --timing_runs="${STEPS:-20}" | tee "$OUT/verify.txt"; then
    read -r PRED_MS SIM_MS PIPE_MS < <(sed -nE \
      's/^step time, ms: +predicted ([0-9.]+) +simulated ([0-9.]+) +measured ([0-9.]+).*/\1 \2 \3/p' \
      "$OUT/verify.txt") || true
  else
    echo "   dapple verify failed (see $OUT/verify.txt): no pipelined timing"
  fi
  if ! "$BIN/horovodrun" -np "$GPUS" -H "localhost:$GPUS" "$PY" benchmarks/plain_dp_step.py \
       --model="$MODEL" --model_args="$MODEL_ARGS" --global_batch_size="$GLOBAL_BATCH" \
       --steps="${STEPS:-20}" | tee "$OUT/plain_dp.txt"; then
    echo "   plain Horovod data parallelism failed (see $OUT/plain_dp.txt)"
  fi
  DP_MS=$(sed -nE 's/.*DAPPLE_RESULT .*"step_ms": ([0-9.]+).*/\1/p' "$OUT/plain_dp.txt" | head -1)
  echo "   pipelined ${PIPE_MS:-?} ms, plain data parallel ${DP_MS:-?} ms per step"
else
  skip "pipelined against plain data-parallel step time: needs 2 or more GPUs, found $GPUS"
fi

echo
echo "== 5. predicted against measured"
if [[ -n "$PIPE_MS" ]]; then
  echo "   predicted $PRED_MS ms, simulated $SIM_MS ms, measured $PIPE_MS ms" \
       "(measured / predicted $(awk "BEGIN {printf \"%.2f\", $PIPE_MS / $PRED_MS}"))"
else
  skip "predicted against measured step time: no pipelined run on GPUs"
fi

SHAPE=$("$PY" -c "import sys; from planner.formats.plan import Plan; p = Plan.load(sys.argv[1]); \
print(f'{p.shape()}, M={p.micro_batches}')" "$OUT/plan.json")
SPEEDUP=""
if [[ -n "$PIPE_MS" && -n "$DP_MS" ]]; then
  SPEEDUP=$(awk "BEGIN {printf \"%.2f\", $DP_MS / $PIPE_MS}")
fi
GPU_NAME=$( ("$SMI" --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1)
{
  echo "| host | model | global batch | plan | dapple step (ms) | Horovod DP step (ms) | speedup | predicted (ms) | simulated (ms) |"
  echo "|---|---|---|---|---|---|---|---|---|"
  echo "| ${GPUS} x ${GPU_NAME:-no GPU} ($TOPOLOGY) | $MODEL $MODEL_ARGS | $GLOBAL_BATCH | $SHAPE | ${PIPE_MS:--} | ${DP_MS:--} | ${SPEEDUP:--} | ${PRED_MS:--} | ${SIM_MS:--} |"
} > "$OUT/first_run.md"
echo
echo "== summary ($OUT/first_run.md; the profile, plan and logs are beside it)"
cat "$OUT/first_run.md"
if [[ ${#SKIPPED[@]} -gt 0 ]]; then
  echo
  echo "skipped on this machine:"
  printf '  - %s\n' "${SKIPPED[@]}"
fi
