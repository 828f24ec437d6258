#!/usr/bin/env bash
# Issue 11 on the 2xH200 machine: the cost of 2 ranks x 2 py-spy recorders (+ the shim) on a
# 2-rank NCCL DDP job with 20-50 ms steps, bare vs diagnose interleaved (3 reps each), and a
# check that both ranks have their events file and py-spy recordings.
#   usage (repo root): OUT=/tmp/out bash bench/gpu_ranks.sh
# Prints "ratio of medians" (diagnose / bare median step time, steps 10-60) and "ranks OK".
export OMP_NUM_THREADS=8
source "$(dirname "$0")/gpu_env.sh"

log setup
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
ls -l "$TRAINDX_PYSPY" || echo "py-spy missing at $TRAINDX_PYSPY"
JOB=($PY -m torch.distributed.run --nproc-per-node 2 --master-port 29511 bench/ddp_nccl_job.py --steps 60)

log "overhead: bare vs diagnose, interleaved, 3 reps"
timeout 420 $PY bench/overhead.py --reps 3 --skip 10 --json "$OUT/gpu-ranks-overhead.json" \
  -- "${JOB[@]}" 2>&1 | grep -E "^rep|ratio|median"

log "evidence of both ranks"
rm -rf runs/gpu-ranks
timeout 200 diagnose --quiet --run-dir runs/gpu-ranks -- "${JOB[@]}" > "$OUT/gpu-ranks-diagnose.log" 2>&1
echo "diagnose exit $?"
$PY - <<'P'
import json, os, traindx
run = traindx.load_run("runs/gpu-ranks")
steps = run.steps.groupby("rank").size().to_dict()
print("ranks", run.ranks, "steps per rank", steps, "manifest ranks", run.manifest["ranks"])
print("processes", run.processes[["pid", "ppid", "label", "evidence"]].to_dict("records"))
print("py-spy recordings", sorted(run.pyspy), "missing", run.missing)
print("files", sorted(os.listdir("runs/gpu-ranks/events")), sorted(os.listdir("runs/gpu-ranks/pyspy")))
ok = (run.ranks == ["0", "1"] and steps == {"0": 60, "1": 60}
      and all((r, s) in run.pyspy for r in ("0", "1") for s in ("all", "gil")))
print("ranks OK" if ok else "ranks NOT OK")
s = json.load(open(os.environ.get("OUT", "/tmp/out") + "/gpu-ranks-overhead.json"))
r = s["ratios"]["diagnose"]
print(f"median step bare {s['median_step_s']['bare']*1000:.2f} ms, diagnose "
      f"{s['median_step_s']['diagnose']*1000:.2f} ms, ratio of medians {r['ratio_of_medians']:.4f}, "
      f"pairwise {[round(x, 4) for x in r['pairwise_ratios']]}")
P
tar czf "$OUT/gpu-ranks-run.tar.gz" runs/gpu-ranks 2>/dev/null; ls -la "$OUT"
