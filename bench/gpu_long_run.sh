#!/usr/bin/env bash
# Issue 15 item 5 on a GPU: a long run stays in its disk budget with NVML, CUDA threads and
# py-spy windows (~4 min of GPU time). A real CUDA training loop runs 180 s under `diagnose`
# with 15 s py-spy windows, 2 kept, and a 24 MB budget per training process; every 10 s the
# script records the run folder's evidence bytes, the launcher's RSS and py-spy's RSS.
# Expect in $OUT/gpu_long_run/summary.txt:
#   - evidence_bytes_final <= budget_bytes (24 MB) and evidence_bytes_max <= ~1.1 x budget
#   - launcher_rss_kb flat after the first 30 s (growth < 15 MB) and pyspy_rss_kb per recorder
#     bounded by one window (it does not grow across windows)
#   - steps_loaded + steps_dropped == the job's "done: N steps"; rolled speedscope files present
#   - nvml_csv_bytes: ~53-65 B per row per GPU at 2 Hz (not rolled; stated in docs/long-runs.md)
# Run from the repo root: bash bench/gpu_long_run.sh   (PY=python3, py-spy via TRAINDX_PYSPY)
set -uo pipefail
PY=${PY:-python3}
export TRAINDX_PYSPY=${TRAINDX_PYSPY:-/opt/gpu-site/bin/py-spy}
OUT_DIR=${OUT:-/tmp}/gpu_long_run
rm -rf "$OUT_DIR"; mkdir -p "$OUT_DIR"
RUN="$OUT_DIR/run"
BUDGET_MB=${BUDGET_MB:-24}
SECONDS_RUN=${SECONDS_RUN:-180}
$PY -m traindx --run-dir "$RUN" --quiet --disk-budget "$BUDGET_MB" --window 15 --keep-windows 2 \
    -- $PY tests/jobs/long_train.py --seconds "$SECONDS_RUN" --device "${DEV:-cuda}" \
    > "$OUT_DIR/diagnose.out" 2> "$OUT_DIR/diagnose.err" &
D=$!
echo "t evidence_bytes launcher_rss_kb pyspy_rss_kb" > "$OUT_DIR/samples.txt"
start=$(date +%s)
while kill -0 $D 2>/dev/null; do
  status=$($PY -c "import json;print(json.load(open('$RUN/manifest.json'))['status'])" 2>/dev/null)
  if [ "$status" = "running" ]; then
    ev=$(du -sb --exclude=report.html --exclude=findings.json --exclude=ledger.csv --exclude=tables "$RUN" | cut -f1)
    echo "$(( $(date +%s) - start )) $ev $(awk '/VmRSS/{print $2}' /proc/$D/status) $(ps -C py-spy -o rss= | tr '\n' ',')" >> "$OUT_DIR/samples.txt"
  fi
  sleep 10
done
wait $D; rc=$?
cp -r "$RUN" "$OUT_DIR/run-copy-for-inspection" 2>/dev/null
$PY - "$RUN" "$BUDGET_MB" "$OUT_DIR" "$rc" > "$OUT_DIR/summary.txt" <<'P'
import json, os, sys
run, budget_mb, out, rc = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
from traindx.derive.run import load_run
rows = [l.split() for l in open(os.path.join(out, "samples.txt")).read().splitlines()[1:]]
ev = [int(r[1]) for r in rows]; rss = [int(r[2]) for r in rows if len(r) > 2]
text = open(os.path.join(out, "diagnose.out")).read()
done = int(text.rsplit("done: ", 1)[1].split()[0]) if "done: " in text else None
r = load_run(run)
dropped = sum(v.get("dropped", {}).get("steps", 0) for k, v in r.manifest.get("rolled", {}).items()
              if k.startswith("events"))
print("diagnose_rc", rc)
print("budget_bytes", int(budget_mb * (1 << 20)))
print("evidence_bytes_final", sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run)
      for f in fs if f not in ("report.html", "findings.json", "ledger.csv") and "/tables" not in d))
print("evidence_bytes_max", max(ev) if ev else None)
print("launcher_rss_kb first/last/max", rss[:1], rss[-1:], max(rss) if rss else None)
print("pyspy_rss_kb samples", [r[3] for r in rows][-6:])
print("job_steps", done, "steps_loaded", len(r.steps), "steps_dropped", dropped)
print("rolled_speedscope", sorted(f for f in os.listdir(os.path.join(run, "pyspy")) if "rolled" in f))
print("nvml_csv_bytes", os.path.getsize(os.path.join(run, "nvml.csv")) if os.path.exists(os.path.join(run, "nvml.csv")) else None)
print("rolled", json.dumps(r.manifest.get("rolled", {}))[:1500])
print("missing", r.manifest.get("missing"))
P
cat "$OUT_DIR/summary.txt"
