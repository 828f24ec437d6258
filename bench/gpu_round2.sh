#!/usr/bin/env bash
# One device call after bench/gpu_device_cases.sh's first pass (2026-12-05): the pipeline job of
# issue 38 (bench/gpu_pipeline.sh), the cases whose twins were redesigned (one cause per case:
# bf16 in both arms), the GPU memory of grow_memory's two arms read bare, and --fix on fp32 and
# cudnn_shapes (FIX_CASES; fp32 alone by default). On a fresh machine without the bundle: carry .gpu-bundle/pyspy (this machine's
# py-spy binary). Everything comes back in $OUT/round2.tgz (the device returns 8 files at most).
#   bash bench/gpu_round2.sh        (repo root, on the device; about 8 minutes)
[ -x .gpu-bundle/pyspy/py-spy ] && export TRAINDX_PYSPY=$PWD/.gpu-bundle/pyspy/py-spy
source "$(dirname "$0")/gpu_env.sh"
[ -x "$TRAINDX_PYSPY" ] && export PATH=$(dirname "$TRAINDX_PYSPY"):$PATH
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -3 "$OUT/pip.log"
log memory probe
for arm in "" --fixed; do
  $PY - $arm <<'PY'
import sys, torch, importlib.util
spec = importlib.util.spec_from_file_location("g", "bench/jobs/gpu_math_cases.py")
g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
said = []
g.print = lambda *a, **k: said.append(round(torch.cuda.memory_allocated() / 2**20))
g.main(["--case", "grow_memory", "--steps", "6"] + sys.argv[1:])
print("grow_memory", sys.argv[1:], "allocated MB after each step:", said)
PY
done
for c in ${FIX_CASES:-fp32}; do
  log "--fix $c"
  timeout -k 5 130 diagnose --fix --quiet --steps 20 --run-dir /tmp/fx-$c -- \
    $PY bench/jobs/gpu_math_cases.py --case $c --steps 25 > /tmp/fx-$c.out 2>&1
  echo "rc $?"; tail -8 /tmp/fx-$c.out
  cp /tmp/fx-$c/fix.json "$OUT/fix-$c.json" 2>/dev/null; cp /tmp/fx-$c.out "$OUT/fix-$c.out"
done
mkdir -p "$OUT/pipe"
log pipeline; SKIP_PIP=1 OUT="$OUT/pipe" timeout -k 5 150 bash bench/gpu_pipeline.sh --device cuda 2>&1 | tail -25
log cases
STEPS=20 GPU_DEVICE_FIX=off timeout -k 5 200 bash bench/gpu_device_cases.sh dtoh_metric odd_matmul sdpa_math grow_memory foreach_off 2>&1 | grep -E "^==|^\||rc " | tail -20
(cd /tmp && tar czf "$OUT/fixruns.tgz" --exclude='*-gil.speedscope.json' --exclude='captured' fx-*)
cd "$OUT" && tar czf /tmp/round2.tgz . && rm -rf ./* && mv /tmp/round2.tgz . && ls -la
