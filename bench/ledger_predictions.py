"""Predicted vs measured: does the time ledger predict what a fix saves?

For each case: run the job under `diagnose` (no py-spy), take the top root finding, ask
traindx.analyzers.core.savings.predicted_step_time(run, finding) for the step time after its fix, then run the
fixed job under `diagnose` the same way and measure its mean steady step from its own ledger.
Prints a table (and --json) of baseline, predicted, measured, and the error of the predicted
saving against the measured saving (the issue's goal: within ±25 %).

usage: python bench/ledger_predictions.py [--cases collate,getitem,checkpoint,gc] [--burners N]
                                         [--json out.json]
       python bench/ledger_predictions.py --cases seed   # on the GPU machine (FA4 seed case)

--burners N starts N pure-Python CPU-burning processes beside the jobs (a shared node; each in
its own session, like another user's process) and stops
them at the end; the table's header line gives the load average before and after. A case whose
fix is a code change (`collate`: examples/pathologies.py's DataLoader) gets the top finding's own
code prescription applied to a scratch copy of the job's folder, as `--fix` does; the others set
the fixed job's flags. For the DataLoader fixes the model also gives a range (low-high: the
fastest and slowest step the CPU evidence allows); `in range` says whether the measured step
fell inside it. --repeat N runs N baseline/fixed pairs per case back to back and reports the
medians (on a machine shared with other work the load drifts between runs; a pair's two runs
see nearly the same load).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
JOBS = os.path.join(ROOT, "tests", "jobs")
EX = os.path.join(ROOT, "examples")

CASES = {
    # name: (baseline command, fixed command, finding id expected); fixed command None: apply
    # the finding's code prescription to a scratch copy of the job's folder
    # the project's own DataLoader pathology: a pure-Python collate, num_workers=0 (batch 256 so
    # a step is ~20 ms, not ~5 ms of timer noise)
    "collate": (
        [
            os.path.join(EX, "pathologies.py"),
            "--pathology",
            "dataloader",
            "--steps",
            "40",
            "--batch-size",
            "256",
        ],
        None,
        "dataloader.starvation",
    ),
    "getitem": (
        [os.path.join(JOBS, "slow_getitem.py"), "--steps", "30", "--item-ms", "4", "--batch", "8"],
        ["--num-workers", "{workers}"],
        "dataloader.starvation",
    ),
    # the same job with fixed CPU work per sample (--item-ms of the loading thread's CPU time):
    # "getitem" ends each sample at a wall-clock deadline, so under CPU contention its worker
    # processes do less work per batch than the training thread did, which no CPU model sees
    "getitem-cpu": (
        [
            os.path.join(JOBS, "slow_getitem.py"),
            "--steps",
            "30",
            "--item-ms",
            "2",
            "--batch",
            "8",
            "--cpu-clock",
        ],
        ["--num-workers", "{workers}"],
        "dataloader.starvation",
    ),
    "checkpoint": (
        [os.path.join(JOBS, "checkpoint_every.py"), "--steps", "30"],
        ["--save-every", "1000000"],
        "steps.periodic_slow",
    ),
    "gc": (
        [os.path.join(EX, "pathologies.py"), "--pathology", "gc", "--steps", "30"],
        ["--gc-freeze"],
        "gc.gen2_in_step",
    ),
    # the seed case on the H200 (FA4 4.0.0b17 from the GPU bundle: FA4_VERSION=b17)
    "seed": (
        [os.path.join(EX, "gpu_qwen_fa4.py"), "--max-seqlen-as", "tensor", "--steps", "8"],
        ["--max-seqlen-as", "int"],
        "jit.fa4_steady_recompile",
    ),
    # the same bug on the CPU (FakeTensorMode FA4; needs 4.0.0b17 first on PYTHONPATH)
    "seed-cpu": (
        [
            os.path.join(EX, "fa4_seed.py"),
            "--max-seqlen-as",
            "tensor",
            "--steps",
            "5",
            "--min-len",
            "136",
            "--max-len",
            "192",
            "--tokens",
            "384",
            "--threads",
            "1",
        ],
        ["--max-seqlen-as", "int"],
        "jit.fa4_steady_recompile",
    ),
}
ENV = {
    "seed": {"FA4_VERSION": "b17"},
    "seed-cpu": {"PYTHONPATH": os.environ.get("TRAINDX_TEST_FA4_B17_DIR", "")},
}


def record(command, out, env=None):
    proc = subprocess.run(
        [PY, "-m", "traindx", "--quiet", "--no-pyspy", "--out", out, "--", PY, *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
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
            del out[j : j + n]
        out += fix[i : i + n]
        i += n
    return out


def code_fixed_command(base, finding, tmp):
    """The baseline command run on a scratch copy of the script's folder with the finding's
    first applicable code change made (the change --fix would make); None when it has none."""
    from traindx.analyzers import codefix

    for p in finding.prescriptions:
        change = (p.change or {}).get("code") or {}
        if not change.get("file") or "before" not in change:
            continue
        script = os.path.abspath(change["file"])
        if script not in [os.path.abspath(a) for a in base]:
            continue
        folder = os.path.join(tmp, "fixed-src")
        shutil.copytree(os.path.dirname(script), folder)
        copy = os.path.join(folder, os.path.basename(script))
        with open(script) as f:
            text = codefix.apply(change, f.read())
        with open(copy, "w") as f:
            f.write(text)
        return [copy if os.path.abspath(a) == script else a for a in base]
    return None


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="collate,getitem-cpu,getitem,checkpoint,gc")
    p.add_argument("--burners", type=int, default=0, help="CPU-burning processes beside the jobs")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="baseline/fixed pairs per case, back to back; the table gives medians",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    # each burner in its own session, as another user's process is (Linux autogroup and
    # cgroups share the cores between sessions/groups before tasks)
    burners = [
        subprocess.Popen([PY, "-c", "while True:\n    sum(range(10**6))"], start_new_session=True)
        for _ in range(args.burners)
    ]
    try:
        load_before = loadavg()
        rows = run_cases(args)
        load_after = loadavg()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"load average (1 min) {load_before} before, {load_after} after; {args.burners} burners")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"burners": args.burners, "load_before": load_before, "load_after": load_after, "rows": rows},
                f,
                indent=2,
            )


def one_pair(name, tmp):
    """One baseline run, its prediction, and the fixed run right after it."""
    import traindx
    from traindx.derive import ledger as L

    base, fix, wanted = CASES[name]
    run = record(base, os.path.join(tmp, "base"), ENV.get(name))
    findings = [f for f in traindx.analyze(run) if f.cause is None and f.severity != "info"]
    finding = next((f for f in findings if f.id == wanted), findings[0] if findings else None)
    if finding is None:
        return {"case": name, "error": "no finding"}
    from traindx.analyzers.core.savings import predicted_step_time

    pred = predicted_step_time(run, finding)
    if pred["predicted_step_s"] is None:
        return {"case": name, "error": f"no prediction for {finding.id}"}
    workers = (finding.removes or {}).get("workers", 2)
    if fix is None:
        command = code_fixed_command(base, finding, tmp)
        if command is None:
            return {"case": name, "error": "no applicable code prescription"}
    else:
        command = fixed_command(base, [a.replace("{workers}", str(workers)) for a in fix])
    fixed = record(command, os.path.join(tmp, "fixed"), ENV.get(name))
    measured = float(L.steady_rows(fixed).groupby("rank")["wall_s"].mean().max())
    return {
        "case": name,
        "finding": finding.id,
        "baseline_step_s": pred["baseline_step_s"],
        "predicted_step_s": pred["predicted_step_s"],
        "measured_step_s": measured,
        "workers": (finding.removes or {}).get("workers"),
        "range_s": pred.get("predicted_range_s"),
        "cpu_evidence": pred.get("cpu_evidence"),
        "load": loadavg(),
        "running_base": running(run),
        "running_fixed": running(fixed),
    }


def running(run):
    """Mean runnable tasks on the machine at the run's steady step ends (the shim's evidence):
    how busy the machine was during that run (a fixed run's own workers count in it)."""
    from traindx.derive import ledger as L

    evd = L.cpu_evidence(run)
    return None if evd is None or evd["running"] is None else round(evd["running"], 2)


def summary(name, pairs):
    """The case's row: medians over its baseline/fixed pairs (each pair run back to back, so a
    change in the machine's other load between pairs moves both of a pair's runs)."""
    import statistics as st

    ok = [p for p in pairs if "error" not in p]
    if not ok:
        return pairs[-1]
    med = {k: st.median(p[k] for p in ok) for k in ("baseline_step_s", "predicted_step_s", "measured_step_s")}
    saved_pred = med["baseline_step_s"] - med["predicted_step_s"]
    saved_meas = med["baseline_step_s"] - med["measured_step_s"]
    ranges = [p["range_s"] for p in ok if p.get("range_s")]
    return {
        "case": name,
        "finding": ok[0]["finding"],
        **med,
        "pairs": pairs,
        "predicted_saving_s": saved_pred,
        "measured_saving_s": saved_meas,
        "saving_error": (saved_pred - saved_meas) / saved_meas if saved_meas else None,
        "step_time_error": (med["predicted_step_s"] - med["measured_step_s"]) / med["measured_step_s"],
        "workers": ok[0].get("workers"),
        "range_s": [st.median(r[0] for r in ranges), st.median(r[1] for r in ranges)] if ranges else None,
        "in_range": [
            r[0] <= p["measured_step_s"] <= r[1] for p, r in zip([p for p in ok if p.get("range_s")], ranges)
        ],
    }


def run_cases(args):
    rows = []
    for name in args.cases.split(","):
        pairs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                pairs.append(one_pair(name, tmp))
            pair = pairs[-1]
            print(
                f"  {name}: "
                + (
                    pair["error"]
                    if "error" in pair
                    else f"baseline {pair['baseline_step_s']:.4f} predicted {pair['predicted_step_s']:.4f}"
                    f" measured {pair['measured_step_s']:.4f} range {pair.get('range_s')} "
                    f"load {pair['load']} runnable {pair['running_base']} -> "
                    f"{pair['running_fixed']}"
                ),
                file=sys.stderr,
                flush=True,
            )
        rows.append(summary(name, pairs))
    print(
        f"{'case':12s} {'finding':26s} {'baseline':>9s} {'predicted':>9s} {'measured':>9s} "
        f"{'saving err':>10s} {'step err':>9s}  range (pairs in range)"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:12s} {r['error']}")
            continue
        se = "-" if r["saving_error"] is None else f"{r['saving_error']:+.0%}"
        print(
            f"{r['case']:12s} {r['finding']:26s} {r['baseline_step_s']:9.4f} {r['predicted_step_s']:9.4f} "
            f"{r['measured_step_s']:9.4f} {se:>10s} {r['step_time_error']:+9.0%}  {span(r)}"
        )
    return rows


def span(r):
    if not r.get("range_s"):
        return ""
    low, high = r["range_s"]
    return f"{low:.4f}-{high:.4f} ({sum(r['in_range'])}/{len(r['in_range'])}; workers={r['workers']})"


if __name__ == "__main__":
    main()
