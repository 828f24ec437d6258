#!/usr/bin/env bash
# The GPU runs of BENCHMARKS.md, on the H200 device machine (see ../shared/gpu/make-bundle for
# the packages it lacks). Stages: setup, seed, healthy, overhead, fix, cache. Results under $OUT.
#   usage: bash bench/gpu_suite.sh STAGE [STAGE ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" runs
export PYTHONPATH=/opt/gpu-boot${PYTHONPATH:+:$PYTHONPATH}
export PATH=/opt/gpu-site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=python3
EX=examples/gpu_qwen_fa4.py
log() { echo "== $(date +%T) $*"; }

for stage in "$@"; do
case $stage in
setup)
  log setup
  $PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
  $PY - <<'P'
import importlib.metadata as m, torch
for p in ("torch", "flash-attn-4", "nvidia-cutlass-dsl", "triton", "py-spy", "traindx"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
P
  which py-spy diagnose kernel-cache ;;
seed)  # (a) the seed case: FA4 4.0.0b17 with tensor max_seqlen
  log seed
  FA4_VERSION=b17 timeout 300 diagnose --quiet --steps 6 --run-dir runs/seed-b17-tensor -- \
    $PY $EX --steps 6 --max-seqlen-as tensor 2>&1 | tail -30 ;;
healthy)
  log healthy
  timeout 200 diagnose --quiet --steps 12 --run-dir runs/healthy-b36-int -- \
    $PY $EX --steps 12 --max-seqlen-as int 2>&1 | tail -20 ;;
overhead)  # (d) bare vs diagnose, interleaved; FA4's disk cache keeps start-ups short for all arms
  log overhead
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
  timeout 420 $PY bench/overhead.py --reps 3 --skip 10 --json "$OUT/overhead-gpu.json" \
    --variant "nopyspy=--no-pyspy" --variant "pyspy5hz=--pyspy-rate 5" -- $PY $EX --steps 40 \
    2>&1 | grep -E "^rep|ratio|median" ;;
fix)  # (b) --fix on the seed case
  log fix
  # 8 steps, no profiler window: both arms compare the same 6 steady steps (2-7)
  FA4_VERSION=b17 timeout 400 diagnose --quiet --fix --steps 8 --torch-profile off --out runs/fix -- \
    $PY $EX --steps 8 --max-seqlen-as tensor 2>&1 | tail -40 ;;
pathologies)  # issue 7's GPU analyzers on real GPU evidence
  log pathologies
  for p in ${PATHOLOGIES:-none launch_bound alloc_retries power sync}; do
    steps=25; [ $p = power ] && steps=150  # NVML samples at 2 Hz: the power run must last
    timeout 120 diagnose --quiet --run-dir runs/gpu-$p -- $PY examples/gpu_pathologies.py \
      --pathology $p --steps $steps 2>&1 | sed -n '/traindx/,$p' | head -14
  done ;;
cache)  # (c) cold vs warm first step, GPU-warmed and CPU-warmed (sm_90) caches
  log cache
  bash bench/gpu_cache.sh 2>&1 | tail -40 ;;
esac
done
log packing
tar czf "$OUT/runs.tar.gz" --exclude="*.speedscope.json" --exclude="*.json.gz" --exclude=scratch runs 2>/dev/null; ls -la "$OUT"
