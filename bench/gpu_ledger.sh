#!/usr/bin/env bash
# The time ledger on the H200: predicted vs measured step time after each fix (the seed case
# and the CPU held-out jobs on the GPU host), and the seed run's ledger.csv. ~5 min.
#   usage: OUT=/tmp/out bash bench/gpu_ledger.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" runs
export PYTHONPATH=/opt/gpu-boot${PYTHONPATH:+:$PYTHONPATH}
export PATH=/opt/gpu-site/bin:$PATH
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
echo "== seed run with the ledger"
FA4_VERSION=b17 timeout 240 diagnose --quiet --steps 8 --run-dir runs/ledger-seed -- \
  python3 examples/gpu_qwen_fa4.py --steps 8 --max-seqlen-as tensor 2>&1 | sed -n '/traindx/,$p' | head -20
cp runs/ledger-seed/ledger.csv "$OUT/ledger-seed-h200.csv" 2>/dev/null
echo "== predicted vs measured"
timeout 420 python3 bench/ledger_predictions.py --cases seed,getitem,checkpoint \
  --json "$OUT/ledger-predictions-h200.json"
