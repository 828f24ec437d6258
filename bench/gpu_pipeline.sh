#!/usr/bin/env bash
# Issue 38 item 5, "what we could run" on ONE H200: a 2-stage GPipe pipeline (bench/jobs/
# whatif_pipeline.py) with both stages on cuda:0 in separate processes (NCCL refuses two ranks on
# one GPU, so gloo moves the activations and their gradients through the host), one stage
# carrying 3x the layers of the other (slow stage) and its balanced twin (the same layers, split
# evenly), each under `diagnose` (torchrun --nproc-per-node 2), then `diagnose analyze RUN
# --what-if` on each; a table in $OUT/pipeline.md: measured speed-up (faulty / twin median step),
# the what-if's prediction (balance_stages_speedup), the findings, and what `diagnose -- cmd`
# itself wrote (the automatic what-if of a run of several ranks).
#
#   usage (repo root, on the device): OUT=/tmp/out bash bench/gpu_pipeline.sh --device cuda   (~2 min)
#   CPU dry run here:  SKIP_PIP=1 PY=.venv/bin/python OUT=/tmp/gpu-pipe bash bench/gpu_pipeline.sh
#
# Expect: the faulty arm's what-if names whatif.stage (the first stage), the twin's at most low
# (whatif.healthy or spread), prediction within +-25 % of the measured speed-up. py-spy: only
# $TRAINDX_PYSPY when it names an executable (else --no-pyspy).
DEVICE=cpu
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    *) echo "usage: bash bench/gpu_pipeline.sh [--device cpu|cuda]" >&2; exit 2 ;;
  esac
done
source "$(dirname "$0")/gpu_env.sh"
[ "$DEVICE" = cpu ] && export OMP_NUM_THREADS=1

log setup
[ -n "${SKIP_PIP:-}" ] || $PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
PYSPY=(--no-pyspy)
[ -x "${TRAINDX_PYSPY:-}" ] && PYSPY=()
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=index,name --format=csv,noheader || true
  SIZE=(--width 8192 --rows 512 --micro-batches 8 --steps 30 --layer-ms 0)
  SLOW=12,4 EVEN=8,8
else
  SIZE=(--width 256 --rows 64 --micro-batches 4 --steps 20 --layer-ms 2)
  SLOW=6,2 EVEN=4,4
fi
RUNS=${RUNS:-runs}
port=29711
arm() {  # name, split
  port=$((port + 1))
  log "arm $1 (split $2, $DEVICE)"
  rm -rf "$RUNS/pipe-$1"
  timeout 300 $PY -m traindx --quiet "${PYSPY[@]}" --run-dir "$RUNS/pipe-$1" -- \
    $PY -m torch.distributed.run --nproc-per-node 2 --master-port $port \
    bench/jobs/whatif_pipeline.py --device "$DEVICE" --split "$2" "${SIZE[@]}" > "$OUT/pipe-$1.log" 2>&1
  echo "diagnose exit $?"
  $PY -m traindx analyze "$RUNS/pipe-$1" --what-if > "$OUT/pipe-$1-whatif.txt" 2>&1
  $PY -m traindx analyze "$RUNS/pipe-$1" --what-if --json > "$RUNS/pipe-$1-whatif.json" 2>/dev/null
  tail -4 "$OUT/pipe-$1-whatif.txt"
}
arm slow "$SLOW"
arm even "$EVEN"

log table
$PY - "$RUNS" "$DEVICE" "$SLOW" "$EVEN" > "$OUT/pipeline.md" <<'P'
import json, os, sys
runs, device, slow, even = sys.argv[1:]
def read(name):
    try:
        with open(os.path.join(runs, f"pipe-{name}-whatif.json")) as fh:
            what = json.load(fh)[0]
        with open(os.path.join(runs, f"pipe-{name}", "findings.json")) as fh:
            auto = [f for f in json.load(fh) if f["id"].startswith("whatif.")]
    except (OSError, ValueError, IndexError) as exc:
        return None, f"unreadable ({exc})"
    return what, (f"{auto[0]['id']} {auto[0]['severity']}" if auto else "-")
(f, fa), (t, ta) = read("slow"), read("even")
print(f"| device | faulty split | twin split | faulty step s | twin step s | measured speed-up | predicted | error | what-if faulty / twin | automatic faulty / twin |")
print("|---|---|---|---|---|---|---|---|---|---|")
if f is None or t is None:
    print(f"| {device} | {slow} | {even} | failed: {fa} / {ta} | | | | | | |")
    sys.exit(1)
tf, tt = f["evidence"]["step_time_recorded_median_s"], t["evidence"]["step_time_recorded_median_s"]
m, p = tf / tt, f["evidence"]["balance_stages_speedup"]
print(f"| {device} | {slow} | {even} | {tf:.4f} | {tt:.4f} | {m:.2f} | {p:.2f} | {(p - m) / m * 100:+.0f} % | "
      f"{f['id']} {f['severity']} / {t['id']} {t['severity']} | {fa} / {ta} |")
print(f"\nfaulty: S = {f['evidence']['S']:.2f}, stage shares {f['evidence']['stage_share']}, "
      f"replay error {f['evidence']['replay_error']:+.1%}; twin: S = {t['evidence']['S']:.2f}, "
      f"replay error {t['evidence']['replay_error']:+.1%}")
P
cat "$OUT/pipeline.md"
