"""What-if predictions vs a healthy twin's measured speed-up, on CPU data-parallel jobs under
torchrun (gloo): one slow rank, and unequal work per rank (bench/jobs/whatif_ddp.py).

Each case runs its faulty arm and its healthy twin side by side (the same load on the shared
machine), both under `diagnose`; then `diagnose analyze RUN --what-if --json` on the faulty arm.
Predicted speed-up: `fix_top_speedup` (slow rank) or `balance_dp_speedup` (unequal work);
measured: the faulty arm's median step over the twin's (steps every rank ran, from the spans).

    .venv/bin/python bench/whatif_ddp.py [--nproc 2] [--steps 30] [--repeat 1] [--out /tmp/whatif-ddp]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
JOB = os.path.join(ROOT, "bench", "jobs", "whatif_ddp.py")
CASES = {
    "allreduce-slow-rank": (
        ["--sync", "allreduce", "--slow-rank", "1", "--slow-ms", "10"],
        "fix_top_speedup",
    ),
    "allreduce-unequal-work": (["--sync", "allreduce", "--skew", "0.6"], "balance_dp_speedup"),
    "ddp-slow-rank": (["--sync", "ddp", "--slow-rank", "1", "--slow-ms", "10"], "fix_top_speedup"),
    "ddp-unequal-work": (["--sync", "ddp", "--skew", "0.6"], "balance_dp_speedup"),
}


def launch(run_dir, nproc, steps, rows, args):
    cmd = [
        os.path.join(BIN, "diagnose"),
        "--run-dir",
        run_dir,
        "--quiet",
        "--no-pyspy",
        "--",
        os.path.join(BIN, "torchrun"),
        "--nproc-per-node",
        str(nproc),
        JOB,
        "--steps",
        str(steps),
        "--rows",
        str(rows),
        *args,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def whatif(run_dir):
    out = subprocess.run(
        [os.path.join(BIN, "diagnose"), "analyze", run_dir, "--what-if", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    findings = json.loads(out)
    return findings[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--layer-ms", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default="/tmp/whatif-ddp")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print(
        "| case | run | faulty step s | twin step s | measured speed-up | predicted | error | finding | runq |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.cases:
        args, metric = CASES[name]
        sync = args[:2]
        for k in range(a.repeat):
            faulty, twin = (os.path.join(a.out, f"{name}-{k}-{arm}") for arm in ("faulty", "twin"))
            procs = [
                launch(faulty, a.nproc, a.steps, a.rows, [*args, "--layer-ms", str(a.layer_ms)]),
                launch(twin, a.nproc, a.steps, a.rows, [*sync, "--layer-ms", str(a.layer_ms)]),
            ]
            if any(p.wait() != 0 for p in procs):
                print(f"| {name} | {k} | failed | | | | | | |")
                continue
            f, t = whatif(faulty), whatif(twin)
            t_f = f["evidence"]["step_time_recorded_median_s"]
            t_t = t["evidence"]["step_time_recorded_median_s"]
            measured, predicted = t_f / t_t, f["evidence"][metric]
            print(
                f"| {name} | {k} | {t_f:.4f} | {t_t:.4f} | {measured:.2f} | {predicted:.2f} ({metric}) | "
                f"{(predicted - measured) / measured * 100:+.0f} % | {f['id']} / twin {t['id']} {t['severity']} | "
                f"{f['evidence'].get('runq_share') or 0:.0%} |",
                flush=True,
            )

    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
