#!/usr/bin/env bash
# Issue 46 on a GPU: causes no rule is named after, each with its fixed twin, found by the places
# table and its mechanisms (derive/places.py, analyzers/gpu_places.py). Each case of
# bench/jobs/mechanism_cases.py (checkpoint: activation checkpointing around every block of a
# small transformer; nchw: a bf16 conv net with BatchNorm in NCHW; cast: an fp32 head inside bf16
# autocast) and its twin run under `diagnose --steps $STEPS` (py-spy, the default torch.profiler
# window); bench/gpu_mechanism_table.py prints for each run the top places, the findings (id,
# severity, saving) and the step medians, and per case: cause at its module, mechanism named,
# predicted saving vs the twin's measured difference (±30 %), twin quiet. Results in $OUT:
#   gpu_mechanism_table.md, runs-mechanism.tgz (the run folders less py-spy's GIL profiles)
# usage (repo root, on the device machine, the bundle installed as in bench/gpu_view.sh's header):
#   bash .gpu-bundle/b/install.sh | tail -1; export PYTHONPATH=/opt/gpu-boot
#   python3 -m pip install -q --no-deps --no-build-isolation -e . ; bash bench/gpu_mechanism_cases.sh
# About 3-5 minutes on one H100 (6 runs of 30 steps). A subset: bash bench/gpu_mechanism_cases.sh nchw
# Without CUDA (a check of the script): tiny sizes on the CPU with an explicit window (steps 3-4).
source "$(dirname "$0")/gpu_env.sh"
CASES=${*:-checkpoint nchw cast}
STEPS=${STEPS:-30}
RUNS=${RUNS:-/tmp/gpu_mechanism_runs}; rm -rf "$RUNS"; mkdir -p "$RUNS"
EXTRA=(); SMALL=()
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "no CUDA: tiny sizes on the CPU, explicit profiler window"; SMALL=(--small); EXTRA=(--torch-profile 3-4)
  STEPS=${STEPS_CPU:-8}
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
for c in $CASES; do
  for arm in bad fixed; do
    flag=""; [ $arm = fixed ] && flag=--fixed
    log "$c $arm"
    timeout -k 5 150 diagnose --quiet --steps "$STEPS" ${EXTRA[@]+"${EXTRA[@]}"} --run-dir "$RUNS/$c-$arm" -- \
      $PY bench/jobs/mechanism_cases.py --case $c $flag ${SMALL[@]+"${SMALL[@]}"} --steps $((STEPS + 5)) > "$RUNS/$c-$arm.out" 2>&1
    echo "rc $?"; grep -E "^step (5|$((STEPS - 1))) " "$RUNS/$c-$arm.out" | tr '\n' ' '; echo
  done
done
$PY bench/gpu_mechanism_table.py "$RUNS" $CASES | tee "$OUT/gpu_mechanism_table.md"
dirs=$(for c in $CASES; do echo "$(basename "$RUNS")/$c-bad $(basename "$RUNS")/$c-fixed"; done)
(cd "$(dirname "$RUNS")" && tar czf "$OUT/runs-mechanism.tgz" --exclude='*-gil.speedscope.json' $dirs)
ls -la "$OUT"
