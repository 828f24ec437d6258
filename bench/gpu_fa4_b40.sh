#!/usr/bin/env bash
# kernel-cache with the FA4 release pip installs today (4.0.0b40: its compile functions take the
# resolved FwdConfig/BwdConfig dataclasses and a PackGQA enum; its backward looks the key up with
# JITPersistentCache.get) on the H200. First-step time and compiles: a cold cache, a cache warmed
# on this GPU by `kernel-cache warm --from-run`, and one warmed with CUDA hidden (FakeTensorMode).
# Needs the bundle installed (bench/gpu_session.sh a, b) and flash-attn-4 4.0.0b40 unpacked in
# .gpu-bundle/fa4-b40 (pure Python: `pip download --no-deps --pre flash-attn-4==4.0.0b40` and unzip).
#   OUT=/tmp/out bash bench/gpu_fa4_b40.sh
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD/.gpu-bundle/fa4-b40:$PYTHONPATH
$PY -c "import flash_attn, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'), flash_attn.__file__)"
EX="examples/gpu_qwen_fa4.py --steps 4 --max-seqlen-as int"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
rm -rf /tmp/b40-cold /tmp/b40-gpu /tmp/b40-cpu runs/b40-*
log "cold"
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/b40-cold diagnose --quiet --run-dir runs/b40-cold -- $PY $EX 2>&1 | tail -3
log "warm on the GPU from the cold run"
/usr/bin/time -f "warm on GPU: %e s" kernel-cache warm --from-run runs/b40-cold --cache-dir /tmp/b40-gpu 2>&1 | tail -12
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/b40-gpu diagnose --quiet --run-dir runs/b40-warm-gpu -- $PY $EX 2>&1 | tail -3
if [ -z "${SKIP_CPU_WARM:-}" ]; then
  log "warm without a GPU"
  CUDA_VISIBLE_DEVICES= /usr/bin/time -f "warm without GPU: %e s" kernel-cache warm --from-run runs/b40-cold --cache-dir /tmp/b40-cpu --arch sm_90 --device cpu 2>&1 | tail -12
  FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/b40-cpu diagnose --quiet --run-dir runs/b40-warm-cpu -- $PY $EX 2>&1 | tail -3
fi
$PY - <<'P' | tee "$OUT/b40-summary.txt"
import traindx
for name in ("b40-cold", "b40-warm-gpu", "b40-warm-cpu"):
    try:
        r = traindx.load_run(f"runs/{name}")
    except Exception as exc:
        print(name, "no run:", exc)
        continue
    s, c = r.steps, r.compiles
    print(f"{name:13s} first step {float(s.duration_s.iloc[0]):.3f} s | later median "
          f"{float(s.duration_s.iloc[1:].median()) * 1000:.1f} ms | compiles {len(c)} "
          f"({float(c.duration_s.sum()) if len(c) else 0.0:.2f} s)")
P
tar czf "$OUT/b40-runs.tgz" runs/b40-* 2>/dev/null
