#!/usr/bin/env bash
# Issue 16 on one H200: megatron-core and flash-linear-attention for real, one call (~7 min).
#   (i)   a megatron-core GPTModel (local, Transformer-Engine-free spec), its DDP, optimizer and
#         schedule, under `diagnose --steps 10`: steps from MegatronOptimizer, losses from its log
#         line, no finding above info
#   (ii)  the same model on packed sequences (PackedSeqParams, max_seqlen a 0-dim tensor) with
#         FA4 4.0.0b17 as core attention, under `diagnose --fix --steps 6`: the recompile found,
#         its origin named, the fix proven
#   (iii) FLA 0.6.0 chunk_gated_delta_rule forward on packed batches whose length changes every
#         step: first step cold vs after `kernel-cache warm --from-run` (goal: warm <= 10 % of cold)
# Every phase has a timeout and prints its own PASS/FAIL line; run folders are tarred into $OUT.
#   usage: OUT=/tmp/out bash bench/gpu_megatron_fla.sh [setup] [fla] [healthy] [packed]  (default: all,
#          in that order, within TOTAL_S=560 s: a phase that would not fit prints SKIP)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" runs
export PYTHONPATH=/opt/gpu-boot${PYTHONPATH:+:$PYTHONPATH}
export PATH=/opt/gpu-site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=python3
MG=bench/jobs/megatron_gpt.py
FLA=bench/jobs/fla_packed.py
SUMMARY="$OUT/summary-megatron-fla.txt"
: > "$SUMMARY"
log() { echo "== $(date +%T) $*"; }
verdict() { echo "$*" | tee -a "$SUMMARY"; }
STAGES=${*:-setup fla healthy packed}
# one device call is at most 600 s: every phase gets min(its budget, what is left of TOTAL_S)
TOTAL_S=${TOTAL_S:-560}
DEADLINE=$(( $(date +%s) + TOTAL_S ))
budget() {  # budget SECONDS -> prints the timeout to use, or 0 when too little time is left
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  if [ "$left" -lt 30 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
skip_if_late() {  # skip_if_late PHASE SECONDS: sets T, or prints SKIP and returns 1
  T=$(budget "$2")
  if [ "$T" -eq 0 ]; then verdict "SKIP $1: out of time (TOTAL_S=$TOTAL_S)"; return 1; fi
}

check() {  # check.py-style assertions on a run folder; prints PASS/FAIL itself
  $PY - "$@" <<'P'
import json, os, sys
import traindx
what, path = sys.argv[1], sys.argv[2]
def out(ok, text):
    print(("PASS " if ok else "FAIL ") + what + ": " + text)
try:
    run = traindx.load_run(path)
except Exception as exc:
    out(False, f"no run folder {path}: {exc}"); sys.exit(0)
findings = json.load(open(os.path.join(path, "findings.json"))) if os.path.exists(os.path.join(path, "findings.json")) else []
steps = run.steps
ev = run.events
sources = sorted(set(ev[ev["type"] == "step_end"]["source"].dropna())) if "source" in ev else []
losses = [r for r in run.log.itertuples() if "lm loss:" in r.text]
above = [f"{f['severity']}: {f['title']}" for f in findings if f["severity"] not in ("info",)]
print(f"  {what}: {len(steps)} steps (sources {sources}), median {steps.duration_s.iloc[1:].median()*1000:.1f} ms, "
      f"{len(losses)} loss lines, findings: " + "; ".join(f"{f['severity']} {f['title']}" for f in findings[:6]))
if what.startswith("healthy"):
    ranks = sorted(set(steps["rank"])) if len(steps) else []
    need = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    ok = len(steps) >= 10 * need and "megatron" in sources and len(losses) >= 10 and not above \
        and len(ranks) >= need
    out(ok, f"ranks {ranks}, steps {len(steps)}, step source {sources}, {len(losses)} losses, "
            f"above info: {above or 'none'}")
P
}

for stage in $STAGES; do
case $stage in
setup)
  log setup
  timeout 120 $PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$SUMMARY"
  timeout 120 $PY - <<'P' 2>&1 | tee -a "$SUMMARY"
import importlib.metadata as m
for p in ("torch", "triton", "megatron-core", "fla-core", "flash-linear-attention", "flash-attn-4",
          "nvidia-cutlass-dsl", "traindx"):
    try: print(" ", p, m.version(p))
    except Exception as e: print(" ", p, "missing")
P
  ;;
healthy)  # (i)
  log "healthy megatron-core GPTModel"
  rm -rf runs/mg-healthy
  skip_if_late "healthy megatron" 200 || continue
  timeout $T diagnose --quiet --steps 10 --run-dir runs/mg-healthy -- \
    $PY $MG --steps 12 2>&1 | tail -25
  check "healthy megatron (1 GPU)" runs/mg-healthy 1 | tee -a "$SUMMARY"
  ;;
packed)  # (ii)
  log "packed megatron + FA4 b17 + tensor max_seqlen, --fix"
  rm -rf runs/mg-fix
  skip_if_late "packed megatron + FA4 b17 --fix" 330 || continue
  # 8 steps, no profiler window: 6 steady steps an arm, enough for an interval
  FA4_VERSION=b17 timeout $T diagnose --quiet --fix --steps 8 --torch-profile off --out runs/mg-fix -- \
    $PY $MG --packed --max-seqlen-as tensor --steps 8 --layers 2 --micro-batches 1 2>&1 | tail -45
  timeout 60 $PY - <<'P' 2>&1 | tee -a "$SUMMARY"
import glob, json, os
fixes = sorted(glob.glob("runs/mg-fix/*/fix.json") + glob.glob("runs/mg-fix/fix.json"), key=os.path.getmtime)
if not fixes:
    print("FAIL packed megatron + FA4 b17 --fix: no fix.json under runs/mg-fix"); raise SystemExit
root = os.path.dirname(fixes[-1])
fix = json.load(open(fixes[-1]))
try:
    base = json.load(open(os.path.join(root, "baseline", "findings.json")))
except OSError:
    base = []
leak = [f for f in base if "recompile" in f["id"] and f["id"] != "jit.cold_start"]
top = leak[0] if leak else {}
ev = top.get("evidence", {})
print("  baseline findings: " + "; ".join(f"{f['severity']} {f['title']}" for f in base[:3]))
print(f"  origin: {json.dumps(ev.get('caller'))} {ev.get('caller_source') or ''}")
plan = fix.get("plan") or {}
print(f"  applied: {plan.get('applied')}  instructions: {(plan.get('instructions') or [])[:2]}")
cmp_ = fix.get("comparison") or {}
low, high = (cmp_.get("speedup_ci95") or [None, None])[:2]
parity = cmp_.get("loss_parity") or {}
print(f"  speedup {cmp_.get('speedup')} (95 % CI {low}-{high}), loss parity passed={parity.get('passed')}")
named = "megatron_gpt.py" in json.dumps(ev.get("caller") or {})
print(("PASS" if leak and named else "FAIL") + f" packed megatron + FA4 b17: recompile found={bool(leak)}, "
      f"origin in the job's file={named}")
ok_fix = bool(plan.get("applied")) and (low or 0) > 1 and parity.get("passed") is not False
print(("PASS" if ok_fix else "FAIL") + f" packed megatron --fix: applied={bool(plan.get('applied'))}, "
      f"speedup CI low={low}, parity={parity.get('passed')}")
P
  ;;
fla)  # (iii)
  log "FLA cold vs kernel-cache warm"
  rm -rf runs/fla-cold runs/fla-warm /tmp/tc-cold /tmp/tc-warm /tmp/fla-configs
  skip_if_late "FLA cold" 180 || continue
  TRITON_CACHE_DIR=/tmp/tc-cold timeout $T diagnose --quiet --torch-profile off --steps 4 --run-dir runs/fla-cold -- \
    $PY $FLA --steps 4 2>&1 | tail -25
  skip_if_late "FLA kernel-cache warm" 180 || continue
  /usr/bin/time -f "  kernel-cache warm: %e s" timeout $T kernel-cache warm --from-run runs/fla-cold \
    --triton-cache-dir /tmp/tc-warm --fla-config-dir /tmp/fla-configs 2>&1 | tail -20
  # the warm run uses exactly what `warm` printed a job needs
  skip_if_late "FLA warm run" 90 || continue
  TRITON_CACHE_DIR=/tmp/tc-warm TRITON_CACHE_AUTOTUNING=1 FLA_CACHE_RESULTS=1 timeout $T \
    diagnose --quiet --torch-profile off --steps 4 --run-dir runs/fla-warm -- $PY $FLA --steps 4 2>&1 | tail -15
  timeout 60 $PY - <<'P' 2>&1 | tee -a "$SUMMARY"
import traindx
rows = {}
for name in ("fla-cold", "fla-warm"):
    try:
        r = traindx.load_run(f"runs/{name}")
    except Exception as exc:
        print(f"FAIL FLA {name}: {exc}"); raise SystemExit
    s, c = r.steps, r.compiles
    tunes = c[c["kind"] == "triton_autotune"] if len(c) else c
    bench = float(tunes["bench_s"].sum()) if "bench_s" in tunes and len(tunes) else float(tunes["duration_s"].sum()) if len(tunes) else 0.0
    hits = int(tunes["disk_cache_hit"].fillna(False).astype(bool).sum()) if "disk_cache_hit" in tunes else None
    rows[name] = float(s.duration_s.iloc[0]) if len(s) else float("nan")
    print(f"  {name}: first step {rows[name]:.2f} s | later median {s.duration_s.iloc[1:].median()*1000:.1f} ms | "
          f"autotunes {len(tunes)} ({bench:.1f} s benchmarking, {hits} from disk) | triton compiles "
          f"{int((c['kind'] == 'triton').sum()) if len(c) else 0}")
ratio = rows["fla-warm"] / rows["fla-cold"]
print(("PASS" if ratio <= 0.10 else "FAIL") + f" FLA first step warm/cold = {ratio:.3f} "
      f"({rows['fla-warm']:.2f} s vs {rows['fla-cold']:.2f} s; goal <= 0.10)")
P
  diagnose report runs/fla-cold --quiet > /dev/null 2>&1
  $PY -c "import json; [print('  fla-cold finding:', f['severity'], f['title']) for f in json.load(open('runs/fla-cold/findings.json'))[:4]]" 2>&1 | tee -a "$SUMMARY"
  ls /tmp/fla-configs 2>/dev/null | head -8 | sed 's/^/  fla config: /'
  ;;
esac
done
log "tar run folders"
tar czf "$OUT/megatron-fla-runs.tar.gz" --exclude='*.speedscope.json' --exclude='trace' \
  runs/mg-healthy runs/mg-fix runs/fla-cold runs/fla-warm 2>/dev/null
ls -la "$OUT" | tail -5
echo "== summary"; cat "$SUMMARY"
