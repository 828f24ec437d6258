#!/usr/bin/env bash
# Issue 47's main figure: what `diagnose` costs a healthy host-bound GPU job. The job
# (bench/jobs/hostbound_mlp.py: a 12-block MLP, width 512, 16x128 tokens, bf16 autocast, fused
# AdamW, one synchronize per step, ~10 ms steps on an H100) runs bare, under `diagnose`
# (defaults) and under `diagnose --always-on`, interleaved (bare, default, always-on, bare, ...),
# PAIRS repetitions. Prints per arm: the median step of each run, the median of the pair ratios
# (each arm over the bare run beside it), the ratio of medians, the step times' spread
# (IQR / median) against bare's, and the cost each diagnose run states of itself (its
# `traindx.cost` finding). Raw JSON: $OUT/overhead-hostbound.json.
#
#   bash bench/gpu_overhead_hostbound.sh                         # on the GPU machine (the bundle:
#                                                                #  bench/gpu_env.sh), ~6 min
#   CPU=1 PAIRS=2 STEPS=40 bash bench/gpu_overhead_hostbound.sh  # a tiny CPU run that tests it
# Knobs: PAIRS (5), STEPS (300), SKIP (warm-up steps left out, 30), EXTRA (more arms, e.g.
# EXTRA='--variant nopyspy=--no-pyspy'), JOB_ARGS (the job's sizes).
set -uo pipefail
cd "$(dirname "$0")/.."
PAIRS=${PAIRS:-5}
STEPS=${STEPS:-300}
SKIP=${SKIP:-30}
if [ "${CPU:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}
  PY=${PY:-python3}
  JOB_ARGS=${JOB_ARGS:---device cpu --width 32 --tokens 64 --blocks 4}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  SKIP=${SKIP_CPU:-5}
else
  source bench/gpu_env.sh  # the bundle's site, its py-spy, $OUT, $PY
  JOB_ARGS=${JOB_ARGS:-}
  $PY -c "import traindx" 2>/dev/null ||
    $PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 ||
    { tail -5 "$OUT/pip.log"; exit 1; }
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
fi
mkdir -p "$OUT"
echo "== $(date +%T) host-bound overhead: $PAIRS pairs, $STEPS steps, first $SKIP left out; $($PY -c "import os; print(len(os.sched_getaffinity(0)))") cores"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# shellcheck disable=SC2086  # JOB_ARGS and EXTRA are word lists
$PY bench/overhead.py --reps "$PAIRS" --skip "$SKIP" --stated --json "$OUT/overhead-hostbound.json" \
  --variant "always-on=--always-on" ${EXTRA:-} -- \
  $PY bench/jobs/hostbound_mlp.py --steps "$STEPS" $JOB_ARGS 2>&1 | grep -v '^[ {}\["]'
echo "raw: $OUT/overhead-hostbound.json"
