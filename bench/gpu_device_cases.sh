#!/usr/bin/env bash
# Issue 37 on a GPU: GPU time judged against the device. Each case of bench/jobs/gpu_math_cases.py
# and its fixed twin under diagnose (30 steps, py-spy and the default torch.profiler window, which
# now counts FLOPs), then `diagnose --fix` on the cases --fix can change by itself (fp32 and
# tf32_off: the fp32_matmul_high runtime patch; cudnn_shapes: cudnn_benchmark_off), then the
# table of predicted vs measured (bench/gpu_device_table.py). Results in $OUT:
#   gpu_device_table.md, fix-<case>.json, runs-<case>-<case>.tgz (two cases each) and runs-fix.tgz (the run folders)
# usage (repo root, on the device machine, this branch checked out; the bundle installed as in
# bench/gpu_view.sh's header):
#   bash .gpu-bundle/b/install.sh | tail -1; export PYTHONPATH=/opt/gpu-boot
#   python3 -m pip install -q --no-deps --no-build-isolation -e . ; bash bench/gpu_device_cases.sh
# About 8 minutes on one H200 (16 runs of 30 steps and three --fix loops); a subset:
#   bash bench/gpu_device_cases.sh fp32 dtoh_metric cudnn_shapes     (GPU_DEVICE_FIX=off: no --fix)
source "$(dirname "$0")/gpu_env.sh"
CASES=${*:-fp32 tf32_off cudnn_shapes dtoh_metric odd_matmul sdpa_math foreach_off grow_memory}
FIX=${GPU_DEVICE_FIX:-on}
STEPS=${STEPS:-30}
RUNS=/tmp/gpu_device_runs; rm -rf "$RUNS"; mkdir -p "$RUNS"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for c in $CASES; do
  for arm in bad fixed; do
    flag=""; [ $arm = fixed ] && flag=--fixed
    log "$c $arm"
    timeout -k 5 120 diagnose --quiet --steps "$STEPS" --run-dir "$RUNS/$c-$arm" -- \
      $PY bench/jobs/gpu_math_cases.py --case $c $flag --steps $((STEPS + 5)) > "$RUNS/$c-$arm.out" 2>&1
    echo "rc $?"; grep -E "^step (5|$((STEPS - 1))) " "$RUNS/$c-$arm.out" | tr '\n' ' '; echo
    grep -E "^(Verdict|MFU|GPU \()|MFU" "$RUNS/$c-$arm.out" | head -4
  done
done
$PY bench/gpu_device_table.py "$RUNS" $CASES | tee "$OUT/gpu_device_table.md"
if [ "$FIX" = on ]; then
  for c in fp32 tf32_off cudnn_shapes; do
    case " $CASES " in *" $c "*) ;; *) continue ;; esac
    log "--fix $c"
    timeout -k 5 420 diagnose --fix --quiet --steps "$STEPS" --run-dir "$RUNS/fix-$c" -- \
      $PY bench/jobs/gpu_math_cases.py --case $c --steps $((STEPS + 5)) > "$RUNS/fix-$c.out" 2>&1
    echo "rc $?"; tail -5 "$RUNS/fix-$c.out"
    cp "$RUNS/fix-$c/fix.json" "$OUT/fix-$c.json" 2>/dev/null
  done
fi
# one archive per two cases (at most 8 files of 16 MiB come back from the device)
set -- $CASES
while [ $# -gt 0 ]; do
  pair="$1 ${2:-}"; shift; [ $# -gt 0 ] && shift
  dirs=$(for c in $pair; do echo gpu_device_runs/$c-bad gpu_device_runs/$c-fixed; done)
  (cd /tmp && tar czf "$OUT/runs-${pair// /-}.tgz" --exclude='*-gil.speedscope.json' $dirs)
done
[ "$FIX" = on ] && (cd /tmp && tar czf "$OUT/runs-fix.tgz" --exclude='*-gil.speedscope.json' gpu_device_runs/fix-*)
ls -la "$OUT"
