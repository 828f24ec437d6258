"""Predicted vs measured for each case of bench/jobs/gpu_math_cases.py (issue 37): the verdict and
top finding of the case's run, its predicted saving per step, the fixed twin's measured
difference (median steady step, bad minus fixed), whether the prediction is within ±25 %, MFU,
and the twin's findings above low (a healthy twin has none).

    python bench/gpu_device_table.py RUNS_DIR   (RUNS_DIR/<case>-bad, RUNS_DIR/<case>-fixed)
"""

import os
import sys
import warnings

import traindx
from traindx.analyzers.core.findings import is_problem

CASES = (
    "fp32",
    "tf32_off",
    "cudnn_shapes",
    "dtoh_metric",
    "odd_matmul",
    "sdpa_math",
    "foreach_off",
    "grow_memory",
)
EXPECTED = {
    "fp32": "gpu.fp32_math",
    "tf32_off": "gpu.fp32_math",
    "cudnn_shapes": "gpu.cudnn_retune",
    "dtoh_metric": "gpu.dtoh_copy",
    "odd_matmul": "gpu.matmul_below_peak",
    "sdpa_math": "gpu.attention_math_path",
    "foreach_off": "gpu.launch_bound",
    "grow_memory": "memory.growth",
}
GOAL = 0.25


def _load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return traindx.load_run(path)


def _median(run):
    st = run.steps
    d = st["duration_s"].to_numpy()[1:] if len(st) > 1 else st["duration_s"].to_numpy()
    return float(sorted(d)[len(d) // 2]) if len(d) else None


def _row(root, case):
    bad, fixed = (os.path.join(root, f"{case}-{arm}") for arm in ("bad", "fixed"))
    if not (os.path.isdir(bad) and os.path.isdir(fixed)):
        return f"| {case} | (runs missing) |"
    rb, rf = _load(bad), _load(fixed)
    fb, ff = traindx.analyze(rb), traindx.analyze(rf)
    verdict = next(f for f in fb if f.id.startswith("verdict."))
    top = next((f for f in fb if f.id == verdict.evidence.get("top")), None)
    gain = verdict.evidence.get("gain_s")
    mb, mf = _median(rb), _median(rf)
    measured = (mb - mf) if mb is not None and mf is not None else None
    within = gain is not None and measured and abs(gain - measured) <= GOAL * abs(measured)
    eff = next((f for f in fb if f.id == "gpu.efficiency"), None)
    mfu = eff.evidence.get("mfu") if eff else None
    twin_loud = [f.id for f in ff if is_problem(f) and f.severity != "low"]
    right = bool(top and top.id.startswith(EXPECTED[case]))
    return (
        f"| {case} | {top.id if top else verdict.id} | {'yes' if right else 'NO'} | "
        f"{gain * 1e3 if gain else 0:.1f} | {measured * 1e3 if measured else 0:.1f} | "
        f"{'yes' if within else 'no'} | {'' if mfu is None else f'{mfu:.1%}'} | {', '.join(twin_loud) or 'quiet'} |"
    )


def main(argv):
    root = argv[1]
    print(
        "| case | headline finding | right cause | predicted ms/step | twin measured ms/step | ±25 % | MFU | twin above low |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in argv[2:] or CASES:
        print(_row(root, case))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
