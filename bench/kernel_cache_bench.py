"""Benchmark of `kernel-cache warm` on this machine (CPU, real FA4 under FakeTensorMode).

1. Warm N distinct attention shapes (forward, backward, backward pre/post kernels each) into an
   empty cache with 1 and with 2 compiler processes: wall time of the whole command, ratio.
2. The FA4 example (examples/fa4_seed.py, packed varlen, sm_90) with a cold cache (FA4 compiles
   during step 1) and after `kernel-cache warm` (FA4 loads the entries): step 1's time, ratio.
   Goal: warm first step <= 5 % of the cold one.

    .venv/bin/python bench/kernel_cache_bench.py --shapes 4 --repeat 1

Prints a Markdown section for BENCHMARKS.md. Needs a quiet machine: compiles are CPU-bound.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fa4_seed.py"
EXAMPLE_ARGS = ["--arch", "sm_90", "--steps", "3", "--min-len", "16", "--max-len", "64"]
EXAMPLE_SPEC = "hd=64,hq=2,hkv=1,dtype=bf16,causal,varlen"
SHAPES = [
    "hd=64,hq=8,hkv=2,causal,varlen",
    "hd=128,hq=16,hkv=4,causal,varlen",
    "hd=128,hq=8,hkv=8",
    "hd=64,hq=4,hkv=4",
    "hd=96,hq=8,hkv=2,causal",
    "hd=128,hq=16,hkv=2,causal,deterministic",
    "hd=256,hq=8,hkv=1,causal,varlen",
    "hd=64,hq=8,hkv=1,window=128:0",
]
STEP_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")


def clean_env(**extra):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("FLASH_ATTENTION_", "CUTE_DSL_", "FA_LOG"))
    }
    env.update(extra)
    return env


def warm(specs, cache_dir, jobs, seqlens="4096"):
    cmd = [
        sys.executable,
        "-m",
        "traindx.kernel_cache.cli.main",
        "warm",
        "--arch",
        "sm_90",
        "--cache-dir",
        str(cache_dir),
        "--jobs",
        str(jobs),
    ]
    if seqlens:
        cmd += ["--seqlens", seqlens]
    for s in specs:
        cmd += ["--spec", s]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"warm failed:\n{proc.stdout}\n{proc.stderr}")
    return seconds, len(list(Path(cache_dir).glob("*/*/*.o")))


def first_step_ms(cache_dir):
    env = clean_env(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1" if cache_dir else "0")
    if cache_dir:
        env["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = str(cache_dir)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *EXAMPLE_ARGS], capture_output=True, text=True, env=env, cwd=ROOT
    )
    wall = time.perf_counter() - start
    steps = {int(m.group(1)): float(m.group(2)) for m in STEP_MS.finditer(proc.stdout)}
    if proc.returncode != 0 or 1 not in steps:
        raise SystemExit(f"example failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return steps[1], steps.get(2), wall


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=int, default=4, help=f"distinct shapes to warm (max {len(SHAPES)})")
    p.add_argument("--repeat", type=int, default=1, help="repetitions of each measurement")
    args = p.parse_args()
    specs = SHAPES[: args.shapes]
    tmp = Path(tempfile.mkdtemp(prefix="kc-bench-"))
    try:
        rows = {1: [], 2: []}
        for r in range(args.repeat):
            for jobs in (1, 2):  # interleaved, so a load change hits both alike
                seconds, n = warm(specs, tmp / f"warm-j{jobs}-{r}", jobs)
                rows[jobs].append((seconds, n))
        j1 = statistics.median(s for s, _ in rows[1])
        j2 = statistics.median(s for s, _ in rows[2])
        entries = rows[1][0][1]

        cold, warm_steps, warm_times = [], [], []
        for r in range(args.repeat):
            cold.append(first_step_ms(None))
            cache = tmp / f"example-{r}"
            # varlen: the default length sweep (8-4096), as a user would run it
            warm_s, _ = warm([EXAMPLE_SPEC], cache, 2, seqlens=None)
            warm_times.append(warm_s)
            warm_steps.append(first_step_ms(cache))
        cold1 = statistics.median(c[0] for c in cold)
        warm1 = statistics.median(w[0] for w in warm_steps)
        steady = statistics.median(c[1] for c in cold if c[1] is not None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()
    print(f"""## kernel-cache (issue 4)

Command: `.venv/bin/python bench/kernel_cache_bench.py --shapes {args.shapes} --repeat {args.repeat}`
Machine: {os.cpu_count()} CPUs, no GPU; real FA4 (flash-attn-4 under FakeTensorMode, sm_90);
load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (shared machine: other work ran).

| measurement | value |
|---|---|
| warm {len(specs)} shapes ({entries} kernels: fwd, bwd, bwd pre/post), 1 process | {j1:.1f} s |
| same, 2 processes | {j2:.1f} s |
| speed-up 1 → 2 processes | {j1 / j2:.2f}× |
| example step 1, cold cache (FA4 compiles) | {cold1:.0f} ms |
| `kernel-cache warm --spec {EXAMPLE_SPEC} --arch sm_90 -j 2` (default varlen sweep 8-4096: 36 lengths) | {statistics.median(warm_times):.1f} s |
| example step 1, after that warm-up (FA4 loads from disk) | {warm1:.0f} ms |
| warm / cold first step | {100 * warm1 / cold1:.1f} % (goal ≤ 5 %) |
| example step 2 (nothing compiles; the step's own work) | {steady:.0f} ms |

Shapes: {"; ".join(specs)}. Median of {args.repeat} run(s). The example's step also runs its
PyTorch reference attention on the CPU (step 2's time), which is part of the warm first step.
""")


if __name__ == "__main__":
    main()
