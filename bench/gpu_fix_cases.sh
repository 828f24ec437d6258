#!/usr/bin/env bash
# Issue 21's GPU proof: `diagnose --fix` applies what it prescribes on one H200, each case a job
# with one cause; fix.json gives every arm (mechanism, predicted vs measured step, speedup,
# parity) and the kept one. Cases:
#   empty_cache   torch.cuda.empty_cache() every step       -> the line deleted (source), not
#                                                              expandable_segments first
#   item          `total += loss.item()` every step          -> `.detach()` (source)
#   gc            gc.collect() every step, big object graph  -> the line deleted (source)
#   loader        train + test DataLoader, --workers flag    -> `--workers N` (config)
#   seed          examples/gpu_qwen_fa4.py on FA4 4.0.0b17 with a tensor max_seqlen (the seed bug:
#                 the backward recompiles every step) -> the first candidate that wins, then the
#                 kernel-cache warm-up arm (examples/fa4_seed.py is the CPU twin: FakeTensorMode)
#   gpuview       every bench/jobs/gpu_*.py (helper gpuview's GPU cases: host-built batches,
#                 pageable copies, host syncs, launch-bound), run as they are
# usage (repo root, on the device machine): OUT=/tmp/out bash bench/gpu_fix_cases.sh [CASE...]
# Results: $OUT/fix-cases.tsv (case, kept arm, mechanism, speedup, predicted s, measured s,
# verdict) and each fix folder's fix.json under $OUT/<case>/ (KEEP_RUNS=1: its run folders too).
source "$(dirname "$0")/gpu_env.sh"
REPO=$(pwd)
WORK=${WORK:-/tmp/fixcases}
STEPS=${STEPS:-20}
mkdir -p "$WORK"
CASES=${*:-empty_cache item gc loader gpu-host_batch gpu-pageable gpu-empty_cache gpu-item_sync gpu-tiny_kernels}

write_job() {  # our own small GPU jobs, one cause each
  case $1 in
  empty_cache|item) cat > "$WORK/$1.py" <<PY
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
total = 0.0
for step in range(200):
    x = torch.randn(256, 4096, device="cuda")
    loss = model(x).float().pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
$( [ "$1" = empty_cache ] && echo "    torch.cuda.empty_cache()" || echo "    total += loss.item()" )
    if step % 10 == 0:
        print(f"step {step} loss {float(loss):.4f}", flush=True)
PY
  ;;
  gc) cp "$REPO/tests/jobs/fix_gc_every_step.py" "$WORK/gc.py" ;;
  loader) cp "$REPO/tests/jobs/fix_two_loaders.py" "$WORK/loader.py" ;;
  esac
}

summary() {  # one TSV line from a fix folder
  $PY - "$1" "$2" <<'P' >> "$OUT/fix-cases.tsv"
import json, sys
case, folder = sys.argv[1], sys.argv[2]
try:
    fix = json.load(open(f"{folder}/fix.json"))
except (OSError, ValueError) as exc:
    print(f"{case}\t-\t-\t-\t-\t-\tno fix.json ({exc})"); raise SystemExit
k = fix.get("kept") or {}
arms = "; ".join(f"{a['arm']}:{a['mechanism']}:{a['speedup'] and round(a['speedup'], 2)}" for a in fix["arms"])
print("\t".join(str(x) for x in (case, k.get("arm"), k.get("mechanism"), k.get("speedup"),
      k.get("predicted_step_time_s"), k.get("measured_step_time_s"), k.get("verdict"), arms)))
P
}

run_case() {  # case, command...
  local case=$1; shift
  log "--fix $case"
  rm -rf "$WORK/runs-$case"
  (cd "$WORK" && $PY -m traindx --fix --quiet --steps "$STEPS" --run-dir "$WORK/runs-$case" \
      -- "$@") > "$OUT/$case.log" 2>&1
  echo "exit $?" >> "$OUT/$case.log"
  mkdir -p "$OUT/$case" && cp "$WORK/runs-$case/fix.json" "$OUT/$case/" 2>/dev/null
  cp "$WORK/runs-$case/fix.patch" "$OUT/$case/" 2>/dev/null
  # KEEP_RUNS=1: every arm's run folder too (its events, trace and log), to re-analyse here
  if [ -n "${KEEP_RUNS:-}" ]; then
    cp -r "$WORK/runs-$case" "$OUT/$case/runs" 2>/dev/null
    find "$OUT/$case/runs" -name '*.raw.json' -delete 2>/dev/null
  fi
  summary "$case" "$WORK/runs-$case"
}

printf "case\tkept\tmechanism\tspeedup\tpredicted_s\tmeasured_s\tverdict\tarms\n" > "$OUT/fix-cases.tsv"
for case in $CASES; do
  case $case in
  gpu-*)  # bench/jobs/gpu_cases.py --case NAME (the GPU view's cases, as they are)
    run_case "$case" $PY "$REPO/bench/jobs/gpu_cases.py" --case "${case#gpu-}" ;;
  loader) write_job loader; run_case loader $PY "$WORK/loader.py" ;;
  seed)  # each baseline step compiles FA4's backward (~10 s): few steps
    (export FA4_VERSION=b17 STEPS=${SEED_STEPS:-6}
     run_case seed $PY "$REPO/examples/gpu_qwen_fa4.py" --steps 40 --max-seqlen-as tensor) ;;
  *) write_job "$case"; run_case "$case" $PY "$WORK/$case.py" ;;
  esac
done
column -t -s $'\t' "$OUT/fix-cases.tsv"
# the device returns at most 8 files: the per-case folders and logs in one archive
(cd "$OUT" && tar czf fix-cases.tgz --exclude=fix-cases.tgz --exclude=fix-cases.tsv $CASES *.log 2>/dev/null \
   && rm -rf $CASES ./*.log)
