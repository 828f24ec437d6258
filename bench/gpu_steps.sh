#!/usr/bin/env bash
# Issue 11 item 3 on a GPU: a step is an iteration with CUDA in the loop (< 2 min of GPU time).
#  1. fp16 autocast + the legacy torch.cuda.amp.GradScaler alias, an overflow injected at
#     iteration 2: expect 6 steps, skipped_optimizer_steps == 1 on step 2, one alloc event a step.
#  2. torchtitan's real OptimizersContainer (3 model parts), when torchtitan is importable:
#     expect 6 steps (torch's hooks fire 4 times an iteration).
#  3. --steps 3 on the same loop: expect 3 steps and the job's lines "iter 0..2" (not "iter 3").
# Run from the repo root: bash bench/gpu_steps.sh   (results under ${OUT:-/tmp}/gpu_steps)
set -uo pipefail
PY=${PY:-python3}
OUT_DIR=${OUT:-/tmp}/gpu_steps
rm -rf "$OUT_DIR"; mkdir -p "$OUT_DIR"
cat > "$OUT_DIR/loop.py" <<'P'
import sys, time, warnings
import torch, torch.nn as nn, torch.nn.functional as F
warnings.filterwarnings("ignore")
mode, n = sys.argv[1], int(sys.argv[2])
import os
dev = os.environ.get("DEV", "cuda")  # DEV=cpu checks this script without a GPU
d = 1024 if dev == "cuda" else 64
parts = [nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)).to(dev) for _ in range(3)]
params = [p for m in parts for p in m.parameters()]
if mode == "titan":
    from torchtitan.components.optimizer import OptimizersContainer
    opt = OptimizersContainer(parts, torch.optim.AdamW, {"lr": 1e-4})
else:
    opt = torch.optim.AdamW(params, lr=1e-4)
scaler = torch.cuda.amp.GradScaler() if dev == "cuda" else torch.amp.GradScaler("cpu")  # legacy alias
for i in range(n):
    t0 = time.perf_counter()
    x = torch.randn(64, d, device=dev)
    with torch.autocast(dev, dtype=torch.float16 if dev == "cuda" else torch.bfloat16):
        out = x
        for m in parts:
            out = m(out)
        loss = F.mse_loss(out.float(), x)
    if i == 2:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    print(f"iter {i}: loss {loss.item():.4f}, time {(time.perf_counter() - t0) * 1000:.2f}ms", flush=True)
P
diagnose --quiet --no-pyspy --run-dir "$OUT_DIR/scaler" -- $PY "$OUT_DIR/loop.py" scaler 6 2>&1 | tail -2
if $PY -c "import torchtitan.components.optimizer" 2>/dev/null; then
  diagnose --quiet --no-pyspy --run-dir "$OUT_DIR/titan" -- $PY "$OUT_DIR/loop.py" titan 6 2>&1 | tail -2
else
  echo "torchtitan not importable here: case 2 skipped"
fi
diagnose --quiet --no-pyspy --steps 3 --run-dir "$OUT_DIR/stop" -- $PY "$OUT_DIR/loop.py" scaler 20 > "$OUT_DIR/stop.out" 2>&1
$PY - "$OUT_DIR" <<'P'
import json, os, re, sys
import traindx
out = sys.argv[1]
for name, want in (("scaler", 6), ("titan", 6), ("stop", 3)):
    path = os.path.join(out, name)
    if not os.path.isdir(path):
        continue
    run = traindx.load_run(path)
    pid = json.load(open(os.path.join(path, "manifest.json")))["ranks"]["0"]
    ev = [json.loads(l) for l in open(os.path.join(path, "events", f"p{pid}.jsonl"))]
    ends = [e for e in ev if e["type"] == "step_end"]
    skipped = [e.get("skipped_optimizer_steps", 0) for e in ends]
    alloc = sum(1 for e in ev if e["type"] == "alloc")
    print(f"{name}: steps {len(run.steps)} (want {want}) | sources {sorted({e['source'] for e in ends})} "
          f"| skipped per step {skipped} | alloc events {alloc} | shim errors "
          f"{[e['error'] for e in ev if e['type'] == 'shim_error']}")
printed = re.findall(r"^iter (\d+):", open(os.path.join(out, "stop.out")).read(), re.M)
print(f"stop: job printed iters {printed} (want ['0', '1', '2'])")
P
