#!/usr/bin/env bash
# Issue 14's GPU proof: `diagnose --fix` on jobs the tool was not written for, one H200.
#   1. fa4:    a packed-sequence job (collator module makes `max_seqlen = seqlens.max()`, a 0-dim
#              CUDA tensor; the attention module passes it to FA4 4.0.0b17's
#              flash_attn_varlen_func). Expect >= 20x, loss parity, a fix.patch at the collator;
#              the patch applied (git apply) to a clean copy gives the candidate's speed.
#   2. triton: a Triton RMSNorm autotuned with key=["n_rows", "D"] while the token count changes
#              every step. Expect the patch key=["D"], a speedup, loss parity; same check.
#   3. cold:   the patched FA4 job on FA4 4.0.0b36 (int max_seqlen): only the cold start is left;
#              --fix warms FA4's cache from the baseline -> 0 compiles in the candidate.
# usage (repo root, on the device machine): OUT=/tmp/out bash bench/gpu_fix_heldout.sh [PHASE...]
# Phases: setup fa4 triton cold summary (default: all). Run folders are tarred under $OUT.
# --torch-profile off: all 6 steady steps (2-7) of both arms count, so the interval is allowed.
set -uo pipefail
OUT=${OUT:-/tmp/out}
REPO=$(pwd)
WORK=${WORK:-/tmp/fixproof}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=/opt/gpu-boot${PYTHONPATH:+:$PYTHONPATH}
export PATH=/opt/gpu-site/bin:$PATH
export PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$WORK/fa4-cache
PY=python3
# the FA4 job's shape: 4 layers, GQA 16/4, head dim 128, ~8k packed tokens (tens of ms a step)
FA4_ARGS="--layers 4 --d-model 2048 --heads 16 --kv-heads 4 --head-dim 128 --tokens 8192 --min-len 512 --max-len 2048 --vocab 8192"
log() { echo "== $(date +%T) $*"; }

fresh_copy() {  # a clean copy of a job, outside the repository (the user's tree)
  rm -rf "$2"; cp -r "$REPO/tests/jobs/$1" "$2"; find "$2" -name __pycache__ -prune -exec rm -rf {} +
}

median_of() {  # median step time of a plain `diagnose` run folder
  $PY - "$1" <<'P'
import sys, traindx
from traindx.recipes.ab import measure_arm
arm, _ = measure_arm(traindx.load_run(sys.argv[1]))
print(f"{arm['median_step_s']:.4f}" if arm["median_step_s"] else "-")
P
}

tar_run() { (cd "$WORK" && tar czf "$OUT/$1.tar.gz" --exclude='scratch' --exclude='overlay' \
             --exclude='*.json.gz' "$1" 2>/dev/null); ls -la "$OUT/$1.tar.gz"; }

PHASES=${*:-setup fa4 triton cold summary}
for phase in $PHASES; do
case $phase in
setup)
  log setup
  $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
  rm -rf "$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
  $PY -c "import torch, importlib.metadata as m; print(torch.__version__, torch.cuda.get_device_name(0), 'fa4', m.version('flash-attn-4'))" ;;
fa4)
  log "fa4: --fix on the held-out packed job, FA4 4.0.0b17, tensor max_seqlen"
  fresh_copy fix_packed "$WORK/fa4-user"
  (cd "$WORK/fa4-user" && FA4_VERSION=b17 timeout 420 diagnose --quiet --fix --steps 8 --torch-profile off \
     --run-dir "$WORK/fa4-fix" -- $PY train.py --steps 8 $FA4_ARGS 2>&1 | tail -45)
  echo "--- fix.patch"; cat "$WORK/fa4-fix/fix.patch"
  log "fa4: the patch on a clean copy (git apply), under diagnose"
  fresh_copy fix_packed "$WORK/fa4-patched"
  (cd "$WORK/fa4-patched" && git apply "$WORK/fa4-fix/fix.patch" && \
   FA4_VERSION=b17 timeout 200 diagnose --quiet --steps 8 --torch-profile off --run-dir "$WORK/fa4-patched-run" -- \
     $PY train.py --steps 8 $FA4_ARGS 2>&1 | tail -8)
  echo "patched clean copy median step (s): $(median_of "$WORK/fa4-patched-run")"
  tar_run fa4-fix; tar_run fa4-patched-run ;;
triton)
  log "triton: --fix on a Triton kernel whose autotune key changes every step"
  fresh_copy fix_triton "$WORK/triton-user"
  (cd "$WORK/triton-user" && timeout 300 diagnose --quiet --fix --steps 8 --torch-profile off \
     --run-dir "$WORK/triton-fix" -- $PY train.py --steps 8 2>&1 | tail -40)
  echo "--- fix.patch"; cat "$WORK/triton-fix/fix.patch" 2>/dev/null || echo "(no fix.patch)"
  fresh_copy fix_triton "$WORK/triton-patched"
  (cd "$WORK/triton-patched" && git apply "$WORK/triton-fix/fix.patch" && \
   timeout 150 diagnose --quiet --steps 8 --torch-profile off --run-dir "$WORK/triton-patched-run" -- \
     $PY train.py --steps 8 2>&1 | tail -8)
  echo "patched clean copy median step (s): $(median_of "$WORK/triton-patched-run")"
  tar_run triton-fix; tar_run triton-patched-run ;;
cold)
  log "cold: the patched FA4 job on FA4 4.0.0b36 (int max_seqlen): warm cache -> 0 compiles"
  fresh_copy fix_packed "$WORK/cold-user"
  (cd "$WORK/cold-user" && git apply "$WORK/fa4-fix/fix.patch" 2>/dev/null || \
     sed -i 's/max_seqlen = seqlens.max()/max_seqlen = int(seqlens.max())/' packlib/collate.py)
  rm -rf "$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
  (cd "$WORK/cold-user" && timeout 300 diagnose --quiet --fix --steps 8 --torch-profile off \
     --run-dir "$WORK/cold-fix" -- $PY train.py --steps 8 $FA4_ARGS 2>&1 | tail -30)
  tar_run cold-fix ;;
summary)
  log summary
  $PY - "$WORK" <<'P'
import json, os, sys
work = sys.argv[1]
rows = []
for name in ("fa4-fix", "triton-fix", "cold-fix"):
    path = os.path.join(work, name, "candidate", "comparison.json")
    if not os.path.exists(path):
        rows.append((name, "-", "-", "-", "-", "-", "-", "no comparison")); continue
    c = json.load(open(path))
    b, k = c["baseline"], c["candidate"]
    ci = c.get("speedup_ci95")
    parity = c.get("loss_parity") or {}
    mech = ",".join(x["mechanism"] for x in c.get("changes", [])) or "-"
    rows.append((name, mech, f"{b['median_step_s']:.4f}" if b["median_step_s"] else "-",
                 f"{k['median_step_s']:.4f}" if k["median_step_s"] else "-",
                 f"{c['speedup']:.1f}x" + (f" [{ci[0]:.1f}-{ci[1]:.1f}]" if ci else "") if c.get("speedup") else "-",
                 f"{b['compiles']}/{k['compiles']}", "pass" if parity.get("passed") else "FAIL" if parity else "-",
                 c["verdict"]))
for name in ("fa4-patched-run", "triton-patched-run"):
    try:
        import traindx
        from traindx.recipes.ab import measure_arm
        arm, _ = measure_arm(traindx.load_run(os.path.join(work, name)))
        rows.append((name, "git apply", "", f"{arm['median_step_s']:.4f}", "", f"{arm['compiles']}", "", "clean copy + fix.patch"))
    except Exception as exc:
        rows.append((name, "-", "-", "-", "-", "-", "-", f"missing ({type(exc).__name__})"))
head = ("run", "mechanism", "base s/step", "cand s/step", "speedup [95% CI]", "compiles b/c", "parity", "verdict")
w = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
for r in [head] + rows:
    print("  ".join(str(x).ljust(w[i]) for i, x in enumerate(r)))
P
  ls -la "$OUT" ;;
esac
done
