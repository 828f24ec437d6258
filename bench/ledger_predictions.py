"""Predicted vs measured: does the time ledger predict what a fix saves?

For each case: run the job under `diagnose` (no py-spy), take the top root finding, ask
traindx.ledger.predicted_step_time(run, finding) for the step time after its fix, then run the
fixed job under `diagnose` the same way and measure its mean steady step from its own ledger.
Prints a table (and --json) of baseline, predicted, measured, and the error of the predicted
saving against the measured saving (the issue's goal: within ±25 %).

usage: python bench/ledger_predictions.py [--cases getitem,checkpoint,gc] [--json out.json]
       python bench/ledger_predictions.py --cases seed   # on the GPU machine (FA4 seed case)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
JOBS = os.path.join(ROOT, "tests", "jobs")
EX = os.path.join(ROOT, "examples")

CASES = {
    # name: (baseline command, fixed command, finding id expected)
    "getitem": ([os.path.join(JOBS, "slow_getitem.py"), "--steps", "30", "--item-ms", "4", "--batch", "8"],
                ["--num-workers", "{workers}"], "dataloader.starvation"),
    "checkpoint": ([os.path.join(JOBS, "checkpoint_every.py"), "--steps", "30"],
                   ["--save-every", "1000000"], "steps.periodic_slow"),
    "gc": ([os.path.join(EX, "pathologies.py"), "--pathology", "gc", "--steps", "30"],
           ["--gc-freeze"], "gc.gen2_in_step"),
    # the seed case on the H200 (FA4 4.0.0b17 from the GPU bundle: FA4_VERSION=b17)
    "seed": ([os.path.join(EX, "gpu_qwen_fa4.py"), "--max-seqlen-as", "tensor", "--steps", "8"],
             ["--max-seqlen-as", "int"], "jit.fa4_steady_recompile"),
    # the same bug on the CPU (FakeTensorMode FA4; needs 4.0.0b17 first on PYTHONPATH)
    "seed-cpu": ([os.path.join(EX, "fa4_seed.py"), "--max-seqlen-as", "tensor", "--steps", "5",
                  "--min-len", "136", "--max-len", "192", "--tokens", "384", "--threads", "1"],
                 ["--max-seqlen-as", "int"], "jit.fa4_steady_recompile"),
}
ENV = {"seed": {"FA4_VERSION": "b17"},
       "seed-cpu": {"PYTHONPATH": os.environ.get("TRAINDX_TEST_FA4_B17_DIR", "")}}


def record(command, out, env=None):
    proc = subprocess.run([PY, "-m", "traindx", "--quiet", "--no-pyspy", "--out", out, "--",
                           PY, *command], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    import traindx

    runs = sorted(os.listdir(out))
    return traindx.load_run(os.path.join(out, runs[-1]))


def fixed_command(base, fix):
    """The baseline command with the fix's flags set (a flag already there gets the new value)."""
    out, i = list(base), 0
    while i < len(fix):
        n = 2 if i + 1 < len(fix) and not fix[i + 1].startswith("--") else 1
        if fix[i] in out:
            j = out.index(fix[i])
            del out[j:j + n]
        out += fix[i:i + n]
        i += n
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="getitem,checkpoint,gc")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import traindx
    from traindx import ledger as L

    rows = []
    for name in args.cases.split(","):
        base, fix, wanted = CASES[name]
        with tempfile.TemporaryDirectory() as tmp:
            run = record(base, os.path.join(tmp, "base"), ENV.get(name))
            findings = [f for f in traindx.analyze(run) if f.cause is None and f.severity != "info"]
            finding = next((f for f in findings if f.id == wanted), findings[0] if findings else None)
            if finding is None:
                rows.append({"case": name, "error": "no finding"})
                continue
            pred = L.predicted_step_time(run, finding)
            workers = (finding.removes or {}).get("workers", 2)
            fix = [a.replace("{workers}", str(workers)) for a in fix]
            fixed = record(fixed_command(base, fix), os.path.join(tmp, "fixed"), ENV.get(name))
            measured = float(L.steady_rows(fixed).groupby("rank")["wall_s"].mean().max())
        saved_pred = pred["baseline_step_s"] - pred["predicted_step_s"]
        saved_meas = pred["baseline_step_s"] - measured
        rows.append({"case": name, "finding": finding.id, "baseline_step_s": pred["baseline_step_s"],
                     "predicted_step_s": pred["predicted_step_s"], "measured_step_s": measured,
                     "predicted_saving_s": saved_pred, "measured_saving_s": saved_meas,
                     "saving_error": (saved_pred - saved_meas) / saved_meas if saved_meas else None,
                     "step_time_error": (pred["predicted_step_s"] - measured) / measured})
    print(f"{'case':12s} {'finding':26s} {'baseline':>9s} {'predicted':>9s} {'measured':>9s} "
          f"{'saving err':>10s} {'step err':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:12s} {r['error']}")
            continue
        se = "-" if r["saving_error"] is None else f"{r['saving_error']:+.0%}"
        print(f"{r['case']:12s} {r['finding']:26s} {r['baseline_step_s']:9.4f} {r['predicted_step_s']:9.4f} "
              f"{r['measured_step_s']:9.4f} {se:>10s} {r['step_time_error']:+9.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
