#!/usr/bin/env bash
# Issue 15 goal 4 on the 2xH200 machine: an injected slow rank in a 2-rank NCCL job is named,
# with what the other rank waits for it per step and why (its own ledger), and a healthy control
# gives no rank finding.  usage (repo root): OUT=/tmp/out bash bench/gpu_straggler.sh  (~3.5 min)
# Job: tests/jobs/straggler_train.py --device cuda (an fp32 MLP 4096 wide, 8192 rows a
# step, DDP + a blocking loss all_reduce per step, or per-parameter blocking all_reduces).
# Expect, per arm (lines "ARM ..." then the ranks findings):
#   ddp-gc     ranks.straggler rank 1, cause gc, cost ~ the gc pause per step, cause_of gc.gen2_in_step
#   ddp-sleep  ranks.straggler rank 1, cause forward_backward (host work before forward), py-spy
#              hottest frame in the job's slow_work / time.sleep, cost ~0.1 s per step
#   ar-data    ranks.straggler rank 1, cause data, cost ~0.1 s per step, cause_of dataloader.starvation
#   ddp-gpu    rank 1 queues ~0.1 s of extra matmuls on its GPU each step: every host waits for its
#              own GPU alike, so the steps show nothing; the torch.profiler window's NCCL kernels
#              (steps 3-4) should name rank 1 (source torch.profiler) - the weakest case
#   healthy    no ranks.* finding
# The method line says "steps as meeting points" (CUDA: NCCL returns to the host at once, the
# host waits in its next sync); "matched collectives" would mean the host spans blocked.
export OMP_NUM_THREADS=4
source "$(dirname "$0")/gpu_env.sh"

log setup
[ -n "${SKIP_PIP:-}" ] || $PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
nvidia-smi --query-gpu=index,name --format=csv,noheader || true
# JOB_ARGS="--device cpu" SKIP_PIP=1 PY=.venv/bin/python: the same arms on gloo, as a dry run
JOB=(tests/jobs/straggler_train.py ${JOB_ARGS:---device cuda --width 4096 --layers 4 --batch 64 --rows 8192} --steps 30)
port=29611
arm() {  # name, job args...
  local name=$1; shift
  port=$((port + 1))
  log "arm $name"
  rm -rf "runs/straggler-$name"
  timeout 150 $PY -m traindx --quiet --run-dir "runs/straggler-$name" -- \
    $PY -m torch.distributed.run --nproc-per-node 2 --master-port $port "${JOB[@]}" "$@" \
    > "$OUT/straggler-$name.log" 2>&1
  echo "diagnose exit $?"
}
arm ddp-gc    --sync ddp --slow-rank 1 --cause gc --heap 2000000
arm ddp-sleep --sync ddp --slow-rank 1 --cause sleep --slow-seconds 0.1
arm ar-data   --sync allreduce --slow-rank 1 --cause data --slow-seconds 0.1
arm ddp-gpu   --sync ddp --slow-rank 1 --cause gpu --slow-seconds 0.1
arm healthy   --sync ddp

$PY - <<'P' | tee "$OUT/straggler-findings.txt"
import json
import traindx
for name in ("ddp-gc", "ddp-sleep", "ar-data", "ddp-gpu", "healthy"):
    try:
        run = traindx.load_run(f"runs/straggler-{name}")
    except Exception as exc:
        print(f"ARM {name}: no run ({exc})")
        continue
    findings = traindx.analyze(run)
    led = run.ledger
    steps = run.steps.groupby("rank").size().to_dict()
    print(f"ARM {name}: steps per rank {steps}; median step "
          f"{run.steps['duration_s'].median() * 1000:.1f} ms; ddp events "
          f"{int((run.events['type'] == 'ddp').sum())}; sync spans "
          f"{int((run.spans['cat'] == 'sync').sum())}; collective spans "
          f"{int((run.spans['cat'] == 'collective').sum())}")
    print("  ledger mean per rank (s):", {r: {k[:-2]: round(float(v), 4) for k, v in g.drop(
        columns=['rank', 'step', 'start_ns', 'end_ns']).mean().items() if v > 0.0005}
        for r, g in led[led['step'] >= 5].groupby('rank')})
    # the raw reading behind the finding (or its absence): who was last, at what cost
    from traindx.analyzers import ranks as R, sync_points as SP
    pts = SP.meeting_points(run)
    host = SP.last_arrivals(pts).groupby("last")["cost_s"].agg(["sum", "count"]).round(4)
    print(f"  host meeting points {pts['key'].nunique()}: cost caused (s, all steps) "
          f"{host.to_dict('index')}; every rank syncs each step: {R._syncs_every_step(run)}")
    st = R._step_points(run)
    if len(st):
        by = SP.last_arrivals(st).groupby("last")["cost_s"].agg(["sum", "count"]).round(4)
        print(f"  step meeting points {st['key'].nunique()}: cost caused (s, steady) {by.to_dict('index')}")
    ranks = [f for f in findings if f.analyzer == "ranks"]
    if not ranks:
        print("  no ranks finding")
    for f in ranks:
        e = f.evidence
        print(f"  {f.id} [{f.severity}] {f.title}")
        print(f"    straggler={e.get('straggler')} cost_per_step_s={e.get('cost_per_step_s')} "
              f"cause={e.get('cause')} ({e.get('cause_label')}) cause_of={f.cause}")
        print(f"    late_because_per_step_s={e.get('late_because_per_step_s')} "
              f"others_wait={e.get('others_wait_per_step_s')} source={e.get('source')}")
        print(f"    method={e.get('method')}")
        print(f"    straggler_does={json.dumps(e.get('straggler_does'))[:300]} "
              f"gpu_sm_clock_mhz={e.get('gpu_sm_clock_mhz')}")
    others = [(f.id, f.severity, f.cause) for f in findings
              if f.analyzer != "ranks" and f.severity != "info"]
    print("  other findings above info:", others)
P
tar czf "$OUT/straggler-runs.tar.gz" runs/straggler-* 2>/dev/null; ls -la "$OUT"
