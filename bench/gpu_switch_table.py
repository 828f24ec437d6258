"""Predicted vs measured for each switch of bench/jobs/gpu_switch_cases.py (issue 36 item 1 on a
GPU): the switch finding of the case's run (its id, severity and predicted ms a step), the measured
difference against the healthy job (median steady step, case minus healthy), whether the prediction
is within ±25 %, and the fraction of the slowed ledger lines the switch really added (what the
analyzer's prior should be on this model), plus the healthy job's findings above low.

    python bench/gpu_switch_table.py RUNS_DIR [CASE ...]   (RUNS_DIR/<case>, RUNS_DIR/healthy)
"""

import os
import statistics
import sys
import warnings

import traindx
from traindx.analyzers.core.findings import is_problem

CASES = ("anomaly", "deterministic", "memory_history", "launch_blocking", "no_caching", "float64")
GOAL = 0.25


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return traindx.load_run(path)


def _median(run):
    d = run.steps["duration_s"].to_numpy()
    return float(statistics.median(d[2:] if len(d) > 4 else d)) if len(d) else None


def _row(root, case, healthy_median):
    path = os.path.join(root, case)
    if not os.path.isdir(path):
        return f"| {case} | (run missing) |"
    run = _load(path)
    findings = traindx.analyze(run)
    sw = next((f for f in findings if f.id.startswith("switches.")), None)
    med = _median(run)
    measured = med - healthy_median if med is not None and healthy_median is not None else None
    gain = sw.seconds_lost_per_step if sw else None
    within = bool(gain and measured and abs(gain - measured) <= GOAL * abs(measured))
    frac = sw.evidence.get("cost_fraction_predicted") if sw else None
    real = None
    if sw and gain and frac and measured is not None:
        # gain = seconds of the slowed lines (switch on) x fraction: the fraction it really added
        real = measured / (gain / frac)
    return (
        f"| {case} | {sw.id if sw else 'none'} | {sw.severity if sw else ''} | "
        f"{gain * 1e3 if gain else 0:.1f} | {measured * 1e3 if measured is not None else 0:.1f} | "
        f"{'yes' if within else 'no'} | {frac if frac is not None else ''} | "
        f"{'' if real is None else f'{real:.2f}'} | {med * 1e3 if med else 0:.1f} |"
    )


def main(argv):
    root = argv[1]
    healthy = os.path.join(root, "healthy")
    hm = _median(_load(healthy)) if os.path.isdir(healthy) else None
    loud = (
        [f.id for f in traindx.analyze(_load(healthy)) if is_problem(f) and f.severity != "low"] if hm else []
    )
    print(
        f"healthy median step {hm * 1e3 if hm else 0:.1f} ms; its findings above low: {', '.join(loud) or 'none'}"
    )
    print()
    print(
        "| case | switch finding | severity | predicted ms/step | measured ms/step | ±25 % | "
        "prior fraction | measured fraction | median step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in argv[2:] or CASES:
        print(_row(root, case, hm))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
