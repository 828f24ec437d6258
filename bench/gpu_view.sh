#!/usr/bin/env bash
# Issue 20 item 4 on a GPU: the GPU's own view. Each GPU case of bench/jobs/gpu_cases.py and its
# fixed twin under diagnose (40 steps, py-spy and the default torch.profiler window), then the
# per-step GPU clock's cost. The run folders come back in $OUT/gpu_view_runs.tgz; the predicted
# saving of each case's finding vs the twin's measured difference is computed from them by
# bench/gpu_view_table.py (here or on any machine: `python bench/gpu_view_table.py RUNS_DIR`).
#   bash bench/gpu_view.sh [CASE ...]   (from the repo root on the GPU machine)
#   GPU_VIEW_OVERHEAD=off bash bench/gpu_view.sh pageable empty_cache item_sync
#                                       (those cases and their twins only, no overhead runs)
# On this workplace's H200 (the device runs the session's checkout, so this branch merged), two
# calls back to back: 1) carry .gpu-bundle/a: `bash .gpu-bundle/a/stash.sh`; 2) carry
# .gpu-bundle/b: `bash .gpu-bundle/b/install.sh | tail -1; export PYTHONPATH=/opt/gpu-boot;
# python3 -m pip install -q --no-deps --no-build-isolation -e . ; bash bench/gpu_view.sh`
# (about 6 minutes: 10 diagnose runs of 40 steps, then 8 short overhead runs). Three cases
# without the overhead runs fit one call after piece a was stashed (about 3 minutes): carry
# .gpu-bundle/b: `bash .gpu-bundle/b/install.sh | tail -1; export PYTHONPATH=/opt/gpu-boot;
# python3 -m pip install -q --no-deps --no-build-isolation -e . ; GPU_VIEW_OVERHEAD=off
# bash bench/gpu_view.sh pageable empty_cache item_sync`. $OUT also gets the runs trimmed as
# the test fixture (bench/gpu_view_fixture.py; tests/data/h200-gpu-view-cases.README).
source "$(dirname "$0")/gpu_env.sh"
CASES=${*:-host_batch pageable empty_cache item_sync tiny_kernels}
OVERHEAD=${GPU_VIEW_OVERHEAD:-on}
RUNS=/tmp/gpu_view_runs; rm -rf "$RUNS"; mkdir -p "$RUNS"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for c in $CASES; do
  for arm in bad fixed; do
    flag=""; [ $arm = fixed ] && flag=--fixed
    log "$c $arm"
    timeout -k 5 90 diagnose --quiet --steps 40 --run-dir "$RUNS/$c-$arm" -- \
      $PY bench/jobs/gpu_cases.py --case $c $flag > "$RUNS/$c-$arm.out" 2>&1
    echo "rc $?"; grep -E "^step (5|39) " "$RUNS/$c-$arm.out" | tr '\n' ' '; echo
    $PY -c "import json,sys; [print('  ', f['id'], round((f.get('seconds_lost_per_step') or 0)*1e3, 2), 'ms') for f in json.load(open(sys.argv[1]))[:5]]" "$RUNS/$c-$arm/findings.json" 2>&1 | head -5
  done
done
$PY bench/gpu_view_table.py "$RUNS" | tee "$OUT/gpu_view_table.md"
(cd /tmp && tar czf "$OUT/gpu_view_runs.tgz" gpu_view_runs)
if [ "$(stat -c %s "$OUT/gpu_view_runs.tgz")" -gt 15000000 ]; then  # 16 MiB a file comes back
  (cd /tmp && tar czf "$OUT/gpu_view_runs.tgz" --exclude='*-gil.speedscope.json' gpu_view_runs)
fi
$PY bench/gpu_view_fixture.py "$RUNS" "$OUT/h200-gpu-view-cases.tar.xz" $CASES
if [ "$OVERHEAD" = off ]; then ls -la "$OUT"; exit 0; fi
log "overhead: one mark, one boundary, H2D bandwidth"
$PY bench/gpu_view_overhead.py | tee "$OUT/gpu_view_overhead.json"
log "overhead: end to end (no py-spy, no window), per-step GPU clock on vs off, 2 rounds"
for round in 1 2; do
  for mode in on off; do
    for c in host_batch tiny_kernels; do
      TRAINDX_GPU_TIME=$mode timeout -k 5 90 diagnose --quiet --no-pyspy --torch-profile off \
        --steps 60 --run-dir "$RUNS/ovh-$c-$mode-$round" -- $PY bench/jobs/gpu_cases.py --case $c \
        --fixed --steps 60 > /dev/null 2>&1
      echo "$c $mode $round rc $?"
    done
  done
done
$PY bench/gpu_view_table.py --overhead "$RUNS" | tee -a "$OUT/gpu_view_table.md"
ls -la "$OUT"
