#!/usr/bin/env bash
# Issue 36 item 1 on a GPU: each switch of bench/jobs/gpu_switch_cases.py left on in a GPT-style
# bf16 job (8 layers, width 768, 16 x 512 tokens), under diagnose beside the healthy job; then the
# table of predicted vs measured costs (bench/gpu_switch_table.py). Results in $OUT:
#   gpu_switch_table.md, gpu_switch_runs.tgz (the run folders, trimmed)
# usage (repo root, on the device machine): bash bench/gpu_switch_cases.sh [CASE ...]
# py-spy: $TRAINDX_PYSPY or the bundle's (bench/gpu_env.sh). About 3 minutes on one H200.
source "$(dirname "$0")/gpu_env.sh"
CASES=${*:-anomaly deterministic memory_history launch_blocking no_caching float64}
STEPS=${STEPS:-30}
RUNS=/tmp/gpu_switch_runs; rm -rf "$RUNS"; mkdir -p "$RUNS"
for c in healthy $CASES; do
  log "switch $c"
  timeout -k 5 100 diagnose --quiet --steps "$STEPS" --run-dir "$RUNS/$c" -- \
    $PY bench/jobs/gpu_switch_cases.py --case $c --steps $((STEPS + 5)) > "$RUNS/$c.out" 2>&1
  echo "rc $?"; grep -E "^step (5|$((STEPS - 1))) " "$RUNS/$c.out" | tr '\n' ' '; echo
done
$PY bench/gpu_switch_table.py "$RUNS" $CASES | tee "$OUT/gpu_switch_table.md"
(cd /tmp && tar czf "$OUT/gpu_switch_runs.tgz" --exclude="*-gil.speedscope.json" --exclude="*.pt.trace.json*" gpu_switch_runs)
