#!/usr/bin/env bash
# Issue 11.4 on the H200: what the default torch.profiler window costs a job whose steps launch
# many small kernels and autotune a Triton kernel every step (FACTS.md §8: unbounded, the step
# after the window took 91.7 s instead of 1.35 s and the run folder reached 72 MB).
# Arms: bare; diagnose --torch-profile off; diagnose with the default (bounded) window; the same
# window with the bounds lifted (the old behaviour). Prints, per arm: median step, the step after
# the window, the window's own record (cost, budget, bytes, why it stood down) and the run folder's
# size. Run from the repo root; results in $OUT/profiler_window.json. About 3-5 minutes.
set -uo pipefail
PY=${PY:-python3}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
JOB="bench/profiler_window_job.py --steps ${STEPS:-12} --ops ${OPS:-2000} --configs ${CONFIGS:-8}"
# on a CPU-only machine the default window stands down ("no CUDA"): WINDOW=3-8 asks for one, and
# BOUNDED_BUDGET_S=<s> gives it the default window's budget (one median step) instead of the
# explicit window's max(30 s, 5 steps)
WIN=${WINDOW:+--torch-profile $WINDOW}
rm -rf runs/pw-off runs/pw-bounded runs/pw-unbounded
$PY $JOB > "$OUT/pw-bare.txt" 2>&1; echo "bare: rc $?"
$PY -m traindx --quiet --no-pyspy --torch-profile off --run-dir runs/pw-off -- $PY $JOB > /dev/null 2>&1
echo "off: rc $?"
${BOUNDED_BUDGET_S:+env TRAINDX_TORCH_PROFILE_BUDGET_S=$BOUNDED_BUDGET_S} \
  $PY -m traindx --quiet --no-pyspy $WIN --run-dir runs/pw-bounded -- $PY $JOB > /dev/null 2>&1
echo "bounded default window: rc $?"
TRAINDX_TORCH_PROFILE_BUDGET_S=100000 TRAINDX_TORCH_PROFILE_MAX_MB=100000 \
  timeout 300 $PY -m traindx --quiet --no-pyspy $WIN --run-dir runs/pw-unbounded -- $PY $JOB > /dev/null 2>&1
echo "unbounded window (old behaviour, bounds lifted): rc $?"
OUT="$OUT" $PY - <<'P'
import json, os, re, statistics
import traindx

def folder_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e6

out = {}
bare = [float(m[1]) for m in re.finditer(r"step \d+ time_s ([\d.]+)", open(os.environ["OUT"] + "/pw-bare.txt").read())]
out["bare"] = {"median_step_s": statistics.median(bare[1:]), "steps_s": bare}
for arm in ("off", "bounded", "unbounded"):
    path = f"runs/pw-{arm}"
    if not os.path.exists(os.path.join(path, "manifest.json")):
        out[arm] = {"error": "no run"}; continue
    r = traindx.load_run(path)
    steps = r.steps.sort_values("step")
    d = list(steps["duration_s"].astype(float))
    ev = r.events
    win = ev[ev["type"] == "torch_profile"].to_dict("records")
    skipped = ev[ev["type"] == "torch_profile_skipped"].to_dict("records")
    after = ev[ev["type"] == "torch_profile_after"].to_dict("records")
    row = {"median_step_s": statistics.median(d[1:]) if len(d) > 1 else None, "steps_s": d,
           "run_folder_mb": round(folder_mb(path), 2)}
    if win:
        w = win[0]
        keep = ("first_step", "last_step", "ended_by", "stood_down", "start_s", "excess_s", "stop_s",
                "export_s", "cost_s", "budget_s", "median_step_s", "bytes", "raw_bytes")
        row["window"] = {k: w.get(k) for k in keep}
        last = int(w["last_step"])
        row["step_after_window_s"] = d[last + 1] if last + 1 < len(d) else None
        # wall time between the last window step's end and the next step's start: stop + export
        s = steps.set_index("step")
        if last + 1 in s.index:
            row["gap_after_window_s"] = (int(s.loc[last + 1, "start_ns"]) - int(s.loc[last, "end_ns"])) / 1e9
    if skipped:
        row["skipped"] = skipped[0].get("reason")
    if after:
        row["after"] = {k: after[0].get(k) for k in ("step", "duration_s", "excess_s", "window_cost_s")}
    out[arm] = row
print(json.dumps(out, indent=1, default=str))
json.dump(out, open(os.environ["OUT"] + "/profiler_window.json", "w"), indent=1, default=str)
for arm in ("bare", "off", "bounded", "unbounded"):
    r = out.get(arm, {})
    print(f"{arm:10s} median step {r.get('median_step_s')} | step after window {r.get('step_after_window_s')} "
          f"| gap after window {r.get('gap_after_window_s')} | folder {r.get('run_folder_mb')} MB "
          f"| window cost {(r.get('window') or {}).get('cost_s')} budget {(r.get('window') or {}).get('budget_s')} "
          f"| stood down: {(r.get('window') or {}).get('stood_down') or r.get('skipped')}")
P
