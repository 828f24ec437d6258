#!/usr/bin/env bash
# docs/fix.md's fix-class table on a CPU: `diagnose --fix` on our own small jobs, one cause
# each, and per kept arm the ledger's predicted mean step against the candidate's measured mean
# step (and the savings). usage (repo root): OUT=/tmp/fixclasses bash bench/fix_classes.sh [CASE...]
# Cases: loaders gc checkpoint hf compile compile-aot compile-example host-reads fa4
# (host-reads runs as it is: on a CPU nothing waits on a host read, the planner's arm needs a
# GPU finding: tests/test_fix_classes.py gives it one). Results: $OUT/fix-classes.tsv.
set -uo pipefail
OUT=${OUT:-/tmp/fixclasses}
PY=${PY:-python3}
REPO=$(pwd)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT"
CASES=${*:-loaders gc checkpoint hf compile compile-aot compile-example}

run_case() {  # case, --steps, command...
  local case=$1 steps=$2; shift 2
  echo "== $(date +%T) --fix $case"
  rm -rf "$OUT/$case"
  $PY -m traindx --fix --no-pyspy --quiet --steps "$steps" --fix-tries 2 --run-dir "$OUT/$case" \
      -- "$@" > "$OUT/$case.log" 2>&1
  $PY - "$case" "$OUT/$case/fix.json" <<'P' >> "$OUT/fix-classes.tsv"
import json, sys
case, path = sys.argv[1], sys.argv[2]
try:
    k = json.load(open(path)).get("kept") or {}
except (OSError, ValueError) as exc:
    print(f"{case}\tno fix.json ({exc})"); raise SystemExit
pred, meas = k.get("predicted_step_time_s"), k.get("measured_mean_step_s")
saving = k.get("predicted_saving_s_per_step")
base_mean = pred + saving if pred is not None and saving is not None else None
measured_saving = base_mean - meas if base_mean is not None and meas is not None else None
ratio = lambda a, b: f"{a / b - 1:+.0%}" if a is not None and b else "-"
print("\t".join(str(x) for x in (case, k.get("mechanism"), k.get("summary", "")[:70],
      k.get("judged_speedup"), pred, meas, ratio(pred, meas), saving, measured_saving,
      ratio(saving, measured_saving), k.get("loss_parity"))))
P
}

printf "case\tmechanism\tkept\tspeedup\tpredicted_step_s\tmeasured_mean_step_s\tstep_error\tpredicted_saving_s\tmeasured_saving_s\tsaving_error\tparity\n" > "$OUT/fix-classes.tsv"
for case in $CASES; do
  case $case in
  loaders) run_case loaders 16 $PY "$REPO/tests/jobs/fix_two_loaders.py" ;;
  gc) run_case gc 16 $PY "$REPO/tests/jobs/fix_gc_every_step.py" --index-size 150000 ;;
  checkpoint) run_case checkpoint 32 $PY "$REPO/tests/jobs/checkpoint_every.py" --save-every 2 --steps 60 ;;
  hf) run_case hf 16 $PY "$REPO/tests/jobs/fix_hf_workers.py" ;;
  compile) run_case compile 8 $PY "$REPO/tests/jobs/fix_compile_shapes.py" ;;
  compile-aot) run_case compile-aot 8 $PY "$REPO/tests/jobs/fix_compile_shapes.py" --backend aot_eager ;;
  compile-example) run_case compile-example 8 $PY "$REPO/examples/compile_dynamic.py" --steps 8 --threads 1 ;;
  host-reads) run_case host-reads 24 $PY "$REPO/tests/jobs/fix_host_reads.py" ;;
  # the seed case in fake mode (README's set-up: flash-attn-4 4.0.0b17 under .fa4-b17)
  fa4) (export PYTHONPATH="$REPO/.fa4-b17${PYTHONPATH:+:$PYTHONPATH}"
        run_case fa4 4 $PY "$REPO/examples/fa4_seed.py" --max-seqlen-as tensor) ;;
  *) echo "unknown case $case" >&2 ;;
  esac
done
column -t -s $'\t' "$OUT/fix-classes.tsv"
