#!/usr/bin/env bash
# Issue 46, item 6 (proof of generality) on a GPU: eight slowdown classes no issue names, from
# users' reports (bench/jobs/unnamed_cases.py cites each), each with its fixed twin, under
# `diagnose --steps $STEPS` (py-spy, the default torch.profiler window). bench/gpu_unnamed_table.py
# prints per run the top places, the findings (id, severity, saving), the step medians, and per
# case: cause found at its module/line and by which finding, predicted saving vs the twin's
# measured difference (±30 %), twin quiet (nothing above low). Results in $OUT:
#   gpu_unnamed_table.md, runs-unnamed.tgz (the run folders less py-spy's GIL profiles)
# usage (repo root, on the device machine, the bundle installed as in bench/gpu_view.sh's header):
#   bash .gpu-bundle/b/install.sh | tail -1; export PYTHONPATH=/opt/gpu-boot
#   python3 -m pip install -q --no-deps --no-build-isolation -e . ; bash bench/gpu_unnamed_cases.sh
# 16 runs of 30 steps: at the mechanism cases' 30-50 s a run, 8-13 minutes on one H100, past one
# device command's 10 minutes: run it in two halves, e.g.
#   bash bench/gpu_unnamed_cases.sh ema_loop clip_loop attn_manual mha_weights
#   bash bench/gpu_unnamed_cases.sh rmsnorm embed_dense sample_loss cat_loop
# Without CUDA: tiny sizes on the CPU (--small) with an explicit window (steps 3-4).
source "$(dirname "$0")/gpu_env.sh"
CASES=${*:-ema_loop clip_loop attn_manual mha_weights rmsnorm embed_dense sample_loss cat_loop}
STEPS=${STEPS:-30}
RUNS=${RUNS:-/tmp/gpu_unnamed_runs}; rm -rf "$RUNS"; mkdir -p "$RUNS"
EXTRA=(); SMALL=(); LIMIT=150
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "no CUDA: tiny sizes on the CPU, explicit profiler window"; SMALL=(--small); EXTRA=(--torch-profile 3-4)
  STEPS=${STEPS_CPU:-8}; LIMIT=400
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi
for c in $CASES; do
  for arm in bad fixed; do
    flag=""; [ $arm = fixed ] && flag=--fixed
    log "$c $arm"
    timeout -k 5 $LIMIT diagnose --quiet --steps "$STEPS" ${EXTRA[@]+"${EXTRA[@]}"} --run-dir "$RUNS/$c-$arm" -- \
      $PY bench/jobs/unnamed_cases.py --case $c $flag ${SMALL[@]+"${SMALL[@]}"} --steps $((STEPS + 5)) > "$RUNS/$c-$arm.out" 2>&1
    echo "rc $?"; grep -E "^step (5|$((STEPS - 1))) " "$RUNS/$c-$arm.out" | tr '\n' ' '; echo
  done
done
$PY bench/gpu_unnamed_table.py "$RUNS" $CASES | tee "$OUT/gpu_unnamed_table.md"
dirs=$(for c in $CASES; do echo "$(basename "$RUNS")/$c-bad $(basename "$RUNS")/$c-fixed"; done)
(cd "$(dirname "$RUNS")" && tar czf "$OUT/runs-unnamed.tgz" --exclude='*-gil.speedscope.json' $dirs)
ls -la "$OUT"
