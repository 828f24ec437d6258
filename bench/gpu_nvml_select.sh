#!/usr/bin/env bash
# Issue 15 item 4 on a 2 x H200 machine: NVML samples only the job's GPUs.
# Run from the repo root: bash bench/gpu_nvml_select.sh   (results under ${OUT:-/tmp/out})
# Expect: run "gpu1" -> nvml.csv's gpu column holds only 1, manifest nvml.gpus == [1] with the
# reason naming CUDA_VISIBLE_DEVICES='1'; run "uuid" (GPU 0 by its UUID) -> only 0; run "all"
# (unset) -> 0 and 1. Each run is a few seconds of train_tiny on the CPU: NVML reads the GPUs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
EX="examples/train_tiny.py --steps 30"
UUID0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | tr -d ' ')
CUDA_VISIBLE_DEVICES=1 diagnose --quiet --no-pyspy --run-dir "$OUT/gpu1" -- python3 $EX >/dev/null 2>&1
CUDA_VISIBLE_DEVICES="$UUID0" diagnose --quiet --no-pyspy --run-dir "$OUT/uuid" -- python3 $EX >/dev/null 2>&1
env -u CUDA_VISIBLE_DEVICES diagnose --quiet --no-pyspy --run-dir "$OUT/all" -- python3 $EX >/dev/null 2>&1
python3 - "$OUT" <<'P' | tee "$OUT/nvml_select.txt"
import csv, json, os, sys
out = sys.argv[1]
for name, want in (("gpu1", {1}), ("uuid", {0}), ("all", {0, 1})):
    d = os.path.join(out, name)
    m = json.load(open(os.path.join(d, "manifest.json")))
    gpus = {int(r["gpu"]) for r in csv.DictReader(open(os.path.join(d, "nvml.csv")))}
    print(f"{name}: nvml.csv gpus {sorted(gpus)} (want {sorted(want)}) "
          f"{'OK' if gpus == want else 'WRONG'} | manifest nvml: {m.get('nvml')}")
P
