"""Predicted vs measured for each GPU case of bench/jobs/gpu_cases.py: the top finding of the
case's run (its predicted saving per step) against the fixed twin's measured difference
(median steady step, bad minus fixed), and each run's GPU busy share from the per-step clock.

    python bench/gpu_view_table.py RUNS_DIR   (RUNS_DIR/<case>-bad, RUNS_DIR/<case>-fixed)
    python bench/gpu_view_table.py --overhead RUNS_DIR   (RUNS_DIR/ovh-<case>-<on|off>-<round>)
"""

import os
import sys
import warnings

import traindx
from traindx.analyzers.core import evidence as ev
from traindx.profiler import gputime

CASES = ("host_batch", "pageable", "empty_cache", "item_sync", "tiny_kernels")
EXPECTED = {
    "host_batch": "gpu_idle.host_starved",
    "pageable": "gpu_idle.pageable_copy",
    "empty_cache": "alloc.",
    "item_sync": "sync.host_device",
    "tiny_kernels": "gpu.launch_bound",
}
GOAL = 0.25


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return traindx.load_run(path)


def _busy(run):
    _, steps = gputime.for_run(run)
    if not len(steps):
        return "–"
    return f"{steps['busy_min_share'].median() * 100:.0f}-{steps['busy_max_share'].median() * 100:.0f} %"


def _gain(f):
    gains = [p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None]
    return max(gains) if gains else f.seconds_lost_per_step


def overhead(root):
    """Median steady step of the overhead runs (ovh-<case>-<on|off>-<round>), per case and mode."""
    import glob
    import statistics

    by = {}
    for path in sorted(glob.glob(os.path.join(root, "ovh-*"))):
        parts = os.path.basename(path).split("-")
        if len(parts) != 4:
            continue
        _, case, mode, _ = parts
        step = ev.median_step_s(_load(path))
        if step:
            by.setdefault((case, mode), []).append(step)
    print("| job (fixed twin, no py-spy, no window) | GPU clock off | GPU clock on | overhead |")
    print("|---|---|---|---|")
    for case in sorted({c for c, _ in by}):
        off, on = by.get((case, "off")), by.get((case, "on"))
        if not off or not on:
            continue
        a, b = statistics.median(off), statistics.median(on)
        print(f"| {case} | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | {(b / a - 1) * 100:+.2f} % |")


def main(argv):
    if len(argv) > 2 and argv[1] == "--overhead":
        overhead(argv[2])
        return 0
    root = argv[1] if len(argv) > 1 else "/tmp/gpu_view_runs"
    print(
        "| case | bad step | fixed step | measured saving | finding (expected) | predicted | "
        "predicted/measured | top root cause | GPU busy bad / fixed (per-step clock) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        bad_dir, fixed_dir = (os.path.join(root, f"{case}-{arm}") for arm in ("bad", "fixed"))
        if not (os.path.isdir(bad_dir) and os.path.isdir(fixed_dir)):
            print(f"| {case} | not run | | | | | | | |")
            continue
        bad, fixed = _load(bad_dir), _load(fixed_dir)
        b, x = ev.median_step_s(bad), ev.median_step_s(fixed)
        measured = (b - x) if b is not None and x is not None else None
        findings = [
            f
            for f in traindx.analyze(bad)
            if f.severity != "info" and f.cause is None and not f.id.startswith("verdict.")
        ]
        expected = EXPECTED[case]
        match = [f for f in findings if f.id.startswith(expected)]
        top = match[0] if match else (findings[0] if findings else None)
        predicted = _gain(top) if top else None
        ratio = predicted / measured if predicted is not None and measured else None
        ok = "" if ratio is None else (" ✓" if abs(ratio - 1) <= GOAL else " ✗")
        print(
            f"| {case} | {b * 1e3:.2f} ms | {x * 1e3:.2f} ms | "
            f"{measured * 1e3:.2f} ms | {top.id if top else '–'} ({expected}) | "
            f"{'–' if predicted is None else f'{predicted * 1e3:.2f} ms'} | "
            f"{'–' if ratio is None else f'{ratio:.2f}'}{ok} | "
            f"{findings[0].id if findings else '–'} | {_busy(bad)} / {_busy(fixed)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
