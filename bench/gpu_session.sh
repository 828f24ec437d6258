#!/usr/bin/env bash
# One device session on the 2xH200 machine, in four calls made back to back (the machine goes
# back after 30 s idle). Each call: `bash bench/gpu_session.sh CALL` from the repo root.
#   a       piece a of the bundle (../shared/gpu/make-bundle; carry .gpu-bundle/a), traindx installed
#   b       piece b + install; then, alone on both GPUs: 2 ranks x 2 py-spy recorders overhead
#           (gpu_ranks.sh), megatron-core under torchrun on 2 GPUs, NVML sampling only the job's GPUs
#   fix     GPU 0: --fix on held-out jobs (gpu_fix_heldout.sh); GPU 1: megatron-core + FLA (gpu_megatron_fla.sh)
#   window  GPU 0: the bounded torch.profiler window (gpu_profiler_window.sh); GPU 1: the seed
#           case re-measured with --fix (gpu_suite.sh fix: predicted vs measured from the ledger),
#           then steps on CUDA (gpu_steps.sh)
# Each script's output is kept in $OUT/<name>.log and its files tarred into $OUT/<name>.tgz
# (the device returns at most 8 files).
#   scale   2 GPUs, no bundle (carry .gpu-pyspy: py-spy binary + libfaketime): multi-node merge
#           with a shifted clock (gpu_multinode.sh), injected slow rank (gpu_straggler.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "== $(date +%T) $*"; }

part() {  # part NAME GPUS SECONDS SCRIPT [ARGS...]: one script with its own OUT, log and files
  local name=$1 gpus=$2 limit=$3; shift 3
  local dir=/tmp/parts/$name
  rm -rf "$dir"; mkdir -p "$dir"
  log "start $name (GPUs $gpus)"
  CUDA_VISIBLE_DEVICES=$gpus OUT=$dir timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  log "end $name: rc $?"
  (cd /tmp/parts && tar czf "$OUT/$name.tgz" "$name" 2>/dev/null)
  if [ "$(stat -c %s "$OUT/$name.tgz")" -gt 15000000 ]; then  # 16 MiB a file comes back
    (cd /tmp/parts && tar czf "$OUT/$name.tgz" --exclude='*.speedscope.json' --exclude='*.json.gz' \
       --exclude='runs.tar.gz' "$name" 2>/dev/null)
  fi
}

case ${1:-} in
a)
  bash .gpu-bundle/a/stash.sh
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  python3 -c "import torch, traindx; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
  ;;
b)
  bash .gpu-bundle/b/install.sh | tail -2
  export PYTHONPATH=/opt/gpu-boot
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  part ranks 0,1 240 bash bench/gpu_ranks.sh
  grep -E "ratio|median|ranks OK|FAIL|rank" "$OUT/ranks.log" | head -20
  part megatron2 0,1 170 bash bench/gpu_megatron_2gpu.sh
  tail -4 "$OUT/megatron2.log"
  part nvmlselect 0,1 80 bash bench/gpu_nvml_select.sh
  tail -6 "$OUT/nvmlselect.log"
  ;;
fix)
  export PYTHONPATH=/opt/gpu-boot
  part fixheldout 0 560 bash bench/gpu_fix_heldout.sh setup fa4 triton cold summary &
  sleep 20  # the first one's pip install first
  part megatronfla 1 560 env TOTAL_S=${TOTAL_S:-520} bash bench/gpu_megatron_fla.sh fla healthy packed &
  wait
  tail -30 "$OUT/fixheldout.log"; echo; grep -E "PASS|FAIL|SKIP" "$OUT/megatronfla.log"
  ;;
window)
  export PYTHONPATH=/opt/gpu-boot
  part window 0 500 bash bench/gpu_profiler_window.sh &
  (part seedfix 1 330 bash bench/gpu_suite.sh fix; part steps 1 100 bash bench/gpu_steps.sh) &
  wait
  tail -25 "$OUT/window.log"; echo; tail -30 "$OUT/seedfix.log"; echo; tail -12 "$OUT/steps.log"
  ;;
redo)  # after piece b on a fresh machine: what the first session's calls left to prove
  bash .gpu-bundle/b/install.sh | tail -1
  export PYTHONPATH=/opt/gpu-boot
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  (part window 0 250 bash bench/gpu_profiler_window.sh; part seedfix 0 230 bash bench/gpu_suite.sh fix;
   part steps 0 60 bash bench/gpu_steps.sh) &
  (part fixtriton 1 170 bash bench/gpu_fix_heldout.sh triton summary;
   part megatronfla 1 380 env TOTAL_S=360 bash bench/gpu_megatron_fla.sh fla packed) &
  wait
  for f in window seedfix steps fixtriton megatronfla; do echo "=== $f"; tail -14 "$OUT/$f.log"; done
  ;;
window2)  # the default window waits for a steady step (no bundle needed: torch and Triton only)
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  part window 0 300 bash bench/gpu_profiler_window.sh &
  (part steady 1 240 bash -c 'for p in none launch_bound; do
     diagnose --quiet --no-pyspy --steps 14 --run-dir $OUT/$p -- \
       python3 examples/gpu_pathologies.py --pathology $p --steps 14 > /dev/null 2>&1
     python3 bench/window_events.py $OUT/$p; done') &
  wait
  tail -8 "$OUT/window.log"; cat "$OUT/steady.log"
  ;;
sync)  # the shim adds no host-device synchronisation: the job runs with set_sync_debug_mode("error")
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  python3 bench/jobs/sync_free.py --steps 12 2>&1 | tail -2
  for opt in "--torch-profile off" ""; do
    echo "== diagnose --no-pyspy $opt"
    diagnose --quiet --no-pyspy $opt --steps 12 --run-dir /tmp/sync$RANDOM -- python3 bench/jobs/sync_free.py --steps 14 2>&1 \
      | grep -E "sync-free|Error|error|steps recorded|Verdict|No slowdown" | head -6
  done
  ;;
scale)  # issue 15 without the bundle: py-spy (and libfaketime's package) carried in .gpu-pyspy
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  export TRAINDX_PYSPY=$PWD/.gpu-pyspy/py-spy PYTHONPATH=$PWD/.gpu-pyspy/site
  part multinode 0,1 240 bash bench/gpu_multinode.sh
  part straggler 0,1 300 bash bench/gpu_straggler.sh
  for f in multinode straggler; do echo "=== $f"; tail -40 "$OUT/$f.log"; done
  ;;
*) echo "usage: bash bench/gpu_session.sh a|b|fix|window|redo|window2|sync|scale" >&2; exit 2 ;;
esac
ls -la "$OUT"
