#!/usr/bin/env bash
# Issue 24 on one H200 (after the bundle is installed: bench/gpu_session.sh a, b):
#   ttf       time to finding under `diagnose --until-diagnosed`: FA4 4.0.0b17's backward
#             recompiling (examples/gpu_qwen_fa4.py, tensor max_seqlen, 20 steps asked), a Triton
#             kernel re-autotuning every step (tests/jobs/fix_triton), a host-bound loop
#             (examples/gpu_pathologies.py --pathology sync: .item() after every layer)
#   capture   deep capture on an anomaly: a job whose step 12 is 4x slower gets a one-step
#             torch.profiler window of it (trace/<rank>.anomaly-slow_step.json.gz)
#   ttf2      the same, each case twice, and a host-bound loop with an onset at step 30
#             (gpu_pathologies.py --slow-from 30: 50 ms of host work a step); onsets are
#             measured after, from the run folders (bench/time_to_finding.py --onset-of)
#   overhead  --always-on vs the bare job, interleaved, the job's own step times
#   aon       time to finding under --always-on (no py-spy recorder: periodic dumps): the
#             host-bound onset at step 30 twice, the FA4 recompile, the Triton re-autotune
# usage (repo root, device machine): OUT=/tmp/out bash bench/gpu_live.sh [PHASE...]
source bench/gpu_env.sh
WORK=${WORK:-/tmp/live}
mkdir -p "$WORK"
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$WORK/fa4-cache
PHASES=${*:-ttf capture overhead}
for phase in $PHASES; do
case $phase in
ttf)
  log "ttf: fa4 recompile"
  FA4_VERSION=b17 timeout 300 diagnose --until-diagnosed --run-dir "$WORK/fa4" -- \
    $PY examples/gpu_qwen_fa4.py --max-seqlen-as tensor --steps 20 2>&1 | grep -v iteration | tail -25
  log "ttf: triton re-autotune"
  timeout 300 diagnose --until-diagnosed --run-dir "$WORK/triton" -- \
    $PY tests/jobs/fix_triton/train.py --steps 40 2>&1 | grep -v iteration | tail -20
  log "ttf: host-bound loop (syncs)"
  timeout 300 diagnose --until-diagnosed --run-dir "$WORK/sync" -- \
    $PY examples/gpu_pathologies.py --pathology sync --steps 400 2>&1 | grep -v iteration | tail -20
  $PY bench/time_to_finding.py --out "$OUT/gpu-ttf.json" --summarize "fa4-recompile=$WORK/fa4:jit." \
    "triton-reautotune=$WORK/triton:jit." "host-sync=$WORK/sync:host_sync."
  ;;
ttf2)  # each case twice; a host-bound loop with an onset (50 ms of host work a step from step 30)
  for rep in 1 2; do
    log "ttf2 $rep: fa4 recompile"
    FA4_VERSION=b17 timeout 240 diagnose --until-diagnosed --run-dir "$WORK/fa4-$rep" -- \
      $PY examples/gpu_qwen_fa4.py --max-seqlen-as tensor --steps 20 2>&1 | grep -v iteration | tail -8
    log "ttf2 $rep: triton re-autotune"
    timeout 240 diagnose --until-diagnosed --run-dir "$WORK/triton-$rep" -- \
      $PY tests/jobs/fix_triton/train.py --steps 40 2>&1 | grep -v iteration | tail -8
    log "ttf2 $rep: host-bound loop from step 30"
    timeout 240 diagnose --until-diagnosed --run-dir "$WORK/hostbound-$rep" -- \
      $PY examples/gpu_pathologies.py --pathology none --slow-from 30 --steps 1500 2>&1 | \
      grep -v iteration | tail -8
  done
  $PY bench/time_to_finding.py --out "$OUT/gpu-ttf2.json" --summarize \
    "fa4-recompile=$WORK/fa4-1:jit." "fa4-recompile=$WORK/fa4-2:jit." \
    "triton-reautotune=$WORK/triton-1:jit." "triton-reautotune=$WORK/triton-2:jit." \
    "host-bound=$WORK/hostbound-1:" "host-bound=$WORK/hostbound-2:"
  ;;
ttf3)  # after a change of the live judge: the host-bound onset twice, the JIT cases once
  for rep in 1 2; do
    log "ttf3 $rep: host-bound loop from step 30"
    timeout 200 diagnose --until-diagnosed --run-dir "$WORK/hostbound-$rep" -- \
      $PY examples/gpu_pathologies.py --pathology none --slow-from 30 --steps 1500 2>&1 | \
      grep -v iteration | tail -3
  done
  FA4_VERSION=b17 timeout 200 diagnose --until-diagnosed --run-dir "$WORK/fa4-1" -- \
    $PY examples/gpu_qwen_fa4.py --max-seqlen-as tensor --steps 20 2>&1 | tail -2
  timeout 200 diagnose --until-diagnosed --run-dir "$WORK/triton-1" -- \
    $PY tests/jobs/fix_triton/train.py --steps 40 2>&1 | tail -2
  $PY bench/time_to_finding.py --out "$OUT/gpu-ttf3.json" --summarize \
    "host-bound=$WORK/hostbound-1:" "host-bound=$WORK/hostbound-2:" \
    "fa4-recompile=$WORK/fa4-1:jit." "triton-reautotune=$WORK/triton-1:jit."
  ;;
ttf4)  # the seed's recompile after the same-key compile trigger, twice
  for rep in 1 2; do
    FA4_VERSION=b17 timeout 200 diagnose --until-diagnosed --run-dir "$WORK/fa4-$rep" -- \
      $PY examples/gpu_qwen_fa4.py --max-seqlen-as tensor --steps 20 2>&1 | tail -2
  done
  $PY bench/time_to_finding.py --out "$OUT/gpu-ttf4.json" --summarize \
    "fa4-recompile=$WORK/fa4-1:jit." "fa4-recompile=$WORK/fa4-2:jit."
  ;;
aon)
  for rep in 1 2; do
    log "aon $rep: host-bound loop from step 30"
    timeout 150 diagnose --always-on --until-diagnosed --run-dir "$WORK/aon-hostbound-$rep" -- \
      $PY examples/gpu_pathologies.py --pathology none --slow-from 30 --steps 1500 2>&1 | \
      grep -v iteration | tail -3
  done
  FA4_VERSION=b17 timeout 150 diagnose --always-on --until-diagnosed --run-dir "$WORK/aon-fa4" -- \
    $PY examples/gpu_qwen_fa4.py --max-seqlen-as tensor --steps 20 2>&1 | tail -2
  timeout 150 diagnose --always-on --until-diagnosed --run-dir "$WORK/aon-triton" -- \
    $PY tests/jobs/fix_triton/train.py --steps 40 2>&1 | tail -2
  $PY bench/time_to_finding.py --out "$OUT/gpu-aon-ttf.json" --onset --summarize \
    "host-bound=$WORK/aon-hostbound-1:" "host-bound=$WORK/aon-hostbound-2:" \
    "fa4-recompile=$WORK/aon-fa4:jit." "triton-reautotune=$WORK/aon-triton:jit."
  ;;
capture)
  log "capture: a slow step in a steady GPU job"
  timeout 300 diagnose --run-dir "$WORK/capture" -- $PY examples/gpu_pathologies.py --pathology none \
    --steps 40 --slow-from 20 2>&1 | grep -v iteration | tail -12
  ls -la "$WORK/capture/trace" || true
  grep -h '"torch_profile' "$WORK"/capture/events/*.jsonl | cut -c1-400
  ;;
overhead)
  log "overhead: bare vs --always-on"
  timeout 540 $PY bench/overhead.py --reps 3 --skip 20 --no-default --variant "always-on=--always-on" \
    --json "$OUT/gpu-always-on-overhead.json" -- $PY examples/gpu_qwen_fa4.py --steps 150
  ;;
esac
done
(cd "$WORK" && tar czf "$OUT/gpu-live-runs.tgz" --exclude='*.json.gz' --exclude='fa4-cache' \
   --exclude='*.speedscope.json' . 2>/dev/null); ls -la "$OUT"
