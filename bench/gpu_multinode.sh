#!/usr/bin/env bash
# Issue 15 goal 1 on the 2xH200 machine: two "nodes" on one host, each a torchrun agent
# (--nnodes 2, c10d rendezvous on 127.0.0.1, one GPU each through CUDA_VISIBLE_DEVICES, NCCL)
# under its own `diagnose` writing into one run folder; node 1's wall clock is shifted by
# SHIFT_S (libfaketime when installed, else bench/clockshift's Python-level shift); then
# `diagnose merge`. Prints the recovered offset and its error bound, whether the true shift is
# inside it, ranks and steps per rank, and how far apart the ranks' step ends are after merging.
#   usage (repo root): OUT=/tmp/out bash bench/gpu_multinode.sh
# Look for: "shift inside bound: True", "consistent: True", error bound in ms (not s),
# "steps per rank {'0': 40, '1': 40}", "max step-end gap after merge" in ms (raw gap ~SHIFT_S).
export OMP_NUM_THREADS=8
source "$(dirname "$0")/gpu_env.sh"
SHIFT_S=${SHIFT_S:--6.5}   # under 15 s: c10d rendezvous drops an agent whose heartbeats look older
STEPS=${STEPS:-40}
RUN=runs/gpu-multinode

log setup
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
nvidia-smi --query-gpu=index,name --format=csv,noheader
FAKE=$($PY - <<'P'
import importlib.util, os
s = importlib.util.find_spec("libfaketime")
p = s and os.path.join(list(s.submodule_search_locations)[0], "vendor/libfaketime/src/libfaketime.so.1")
print(p if p and os.path.exists(p) else "")
P
)
if [ -n "$FAKE" ]; then
  SHIFTED=(env LD_PRELOAD="$FAKE" FAKETIME="$SHIFT_S" FAKETIME_DONT_FAKE_MONOTONIC=1)
  echo "clock shift: libfaketime $FAKE ($SHIFT_S s, whole process tree)"
else
  SHIFTED=(env BENCH_CLOCK_SHIFT_S="$SHIFT_S" PYTHONPATH="$PWD/bench/clockshift:$PYTHONPATH")
  echo "clock shift: bench/clockshift Python time.time/time_ns ($SHIFT_S s; libfaketime not installed)"
fi
rm -rf "$RUN"
PORT=29533
node() {  # node() RANK GPU [prefix...]
  local rank=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout 200 "$@" $PY -m traindx --quiet --run-dir "$RUN" -- \
    $PY -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
    --rdzv-endpoint 127.0.0.1:$PORT --rdzv-id gpumn --node-rank "$rank" \
    bench/multinode_job.py --steps "$STEPS" > "$OUT/node$rank.log" 2>&1
  echo "node $rank diagnose exit $?"
}
log "two nodes"
node 0 0 & P0=$!
node 1 1 "${SHIFTED[@]}" & P1=$!
wait $P0 $P1
tail -n 3 "$OUT/node0.log" "$OUT/node1.log"
ls "$RUN/nodes"
log merge
timeout 120 $PY -m traindx merge "$RUN" > "$OUT/merge.log" 2>&1; echo "merge exit $?"
head -n 8 "$OUT/merge.log"
SHIFT_S=$SHIFT_S $PY - <<'P'
import json, os
import traindx
from traindx.profiler import nodes
run_dir, shift = "runs/gpu-multinode", float(os.environ["SHIFT_S"])
clock = json.load(open(f"{run_dir}/clock.json"))
names = sorted(nodes.node_dirs(run_dir))
plain, late = [n for n in names if n.endswith("-n0")][0], [n for n in names if n.endswith("-n1")][0]
est = clock["nodes"][late]["offset_ns"] - clock["nodes"][plain]["offset_ns"]
err = (clock["nodes"][late]["error_ns"] or 0) + (clock["nodes"][plain]["error_ns"] or 0)
print(f"reference {clock['reference']}, consistent: {clock['consistent']}, usable collectives "
      f"{clock['usable_collectives']}, conflicts {clock['conflicts']}")
print(f"node {late}: true shift {-shift:+.6f} s, estimated {est / 1e9:+.6f} s, error bound "
      f"± {err / 1e6:.3f} ms, constraints {clock['nodes'][late]['constraints']}")
print("shift inside bound:", abs(est - (-shift) * 1e9) <= err)
run = traindx.load_run(run_dir)
coll = run.events[(run.events["type"] == "span") & (run.events["cat"] == "collective")]
print("collective spans by op/backend:", coll.groupby(["op", "backend"]).size().to_dict())
print("ranks", run.ranks, "rank nodes", run.manifest["rank_nodes"])
print("steps per rank", run.steps.groupby("rank").size().to_dict())
ends = run.steps.pivot(index="step", columns="rank", values="end_ns")
print(f"max step-end gap after merge: {(ends['0'] - ends['1']).abs().max() / 1e6:.2f} ms")
alone = {n: traindx.load_run(f"{run_dir}/nodes/{n}") for n in (plain, late)}
raw = alone[late].steps["end_ns"].to_numpy() - alone[plain].steps["end_ns"].to_numpy()
print(f"raw step-end gap (node clocks as recorded): {raw.mean() / 1e9:+.3f} s")
print("gpus in merged manifest", [(g.get("node"), g.get("index", g.get("name"))) for g in run.manifest["gpus"]])
print("nvml rows per gpu", run.gpu.groupby("gpu").size().to_dict() if len(run.gpu) else {})
print("py-spy", sorted(run.pyspy), "missing", run.missing)
P
tar czf "$OUT/gpu-multinode-run.tar.gz" "$RUN" 2>/dev/null; ls -la "$OUT"
