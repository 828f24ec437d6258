#!/usr/bin/env bash
# Issue 16 (i) on 2xH200: the megatron-core GPTModel (local spec, DDP over 2 ranks, its optimizer
# and schedule) under `diagnose --steps 10 -- torchrun --nproc-per-node 2`: steps from
# MegatronOptimizer on both ranks, losses from rank 0's log line, no finding above info. ~2 min.
#   usage: OUT=/tmp/out bash bench/gpu_megatron_2gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" runs
export PYTHONPATH=/opt/gpu-boot${PYTHONPATH:+:$PYTHONPATH}
export PATH=/opt/gpu-site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=python3
SUMMARY="$OUT/summary-megatron-2gpu.txt"
: > "$SUMMARY"
echo "== $(date +%T) setup"
timeout 120 $PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$SUMMARY"
# the same checker as the 1-GPU script
eval "$(sed -n '/^check() {/,/^}/p' bench/gpu_megatron_fla.sh)"
TORCHRUN=$(command -v torchrun || echo "$PY -m torch.distributed.run")
echo "== $(date +%T) megatron GPTModel, $TORCHRUN, 2 ranks"
rm -rf runs/mg-2gpu
timeout 300 diagnose --quiet --steps 10 --run-dir runs/mg-2gpu -- \
  $TORCHRUN --nproc-per-node 2 bench/jobs/megatron_gpt.py --steps 12 2>&1 | tail -25
check "healthy megatron (2 GPUs, torchrun)" runs/mg-2gpu 2 | tee -a "$SUMMARY"
tar czf "$OUT/megatron-2gpu-run.tar.gz" --exclude='*.speedscope.json' --exclude='trace' runs/mg-2gpu 2>/dev/null
echo "== summary"; cat "$SUMMARY"
