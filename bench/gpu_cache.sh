#!/usr/bin/env bash
# Issue 8c on the H200: first-step time with a cold FA4 cache, with a cache warmed on this GPU by
# `kernel-cache warm --from-run`, and with one warmed without a GPU (FakeTensorMode, sm_90;
# CUDA hidden, same Python/FA4/cutlass, which the cache's fingerprint requires).
set -uo pipefail
PY=python3
EX="examples/gpu_qwen_fa4.py --steps 3 --max-seqlen-as int"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
rm -rf /tmp/c-cold /tmp/c-gpu /tmp/c-cpu
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/c-cold diagnose --quiet --run-dir runs/cache-cold -- $PY $EX 2>&1 | tail -3
/usr/bin/time -f "warm on GPU: %e s" kernel-cache warm --from-run runs/cache-cold --cache-dir /tmp/c-gpu 2>&1 | tail -8
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/c-gpu diagnose --quiet --run-dir runs/cache-warm-gpu -- $PY $EX 2>&1 | tail -3
CUDA_VISIBLE_DEVICES= /usr/bin/time -f "warm without GPU: %e s" kernel-cache warm --from-run runs/cache-cold --cache-dir /tmp/c-cpu --arch sm_90 --device cpu 2>&1 | tail -8
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/c-cpu diagnose --quiet --run-dir runs/cache-warm-cpu -- $PY $EX 2>&1 | tail -3
kernel-cache ls --cache-dir /tmp/c-cpu 2>&1 | tail -5
$PY - <<'P'
import traindx
rows = {}
for name in ("cache-cold", "cache-warm-gpu", "cache-warm-cpu"):
    r = traindx.load_run(f"runs/{name}")
    s = r.steps
    c = r.compiles
    rows[name] = (float(s.duration_s.iloc[0]), float(s.duration_s.iloc[1:].median()), len(c),
                  float(c.duration_s.sum()) if len(c) else 0.0)
    print(f"{name:15s} first step {rows[name][0]:.3f} s | later median {rows[name][1]*1000:.1f} ms | "
          f"compiles {rows[name][2]} ({rows[name][3]:.2f} s)")
cold = rows["cache-cold"][0]
for name in ("cache-warm-gpu", "cache-warm-cpu"):
    print(f"{name}: first step / cold first step = {rows[name][0] / cold:.3f}")
P
