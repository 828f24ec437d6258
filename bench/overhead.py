"""Overhead of `diagnose` (defaults) on a job's steady-state step time: bare vs diagnosed,
interleaved A B A B in one run so both arms see the same machine noise.

Step times come from the job's own Megatron-format log line ("elapsed time per iteration (ms)"),
the same measurement in both arms.

usage: python bench/overhead.py [--reps 3] [--skip 5] [--json out.json] [--stated]
                                [--variant 'NAME=DIAGNOSE ARGS' ...] -- <job command>
Arms: "bare", "diagnose" (defaults) and each --variant (diagnose with extra arguments).
Per arm: the median step of each repetition, the ratio to the bare one of the same repetition
(medians of ratios: the machine's load drifts between repetitions, rarely within one pair), and
the spread of step times (interquartile range / median, per run). --stated: also the cost each
diagnose run states of itself (findings.json's `traindx.cost`: per step, the %).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from traindx.profiler.logparse import parse_line  # noqa: E402


def step_times(output, skip):
    times = [
        r["step_time_s"]
        for r in map(parse_line, output.splitlines())
        if r and r.get("step_time_s") is not None
    ]
    return times[skip:]


def spread(times):
    """Interquartile range over the median: how widely one run's steps scatter."""
    q = statistics.quantiles(times, n=4)
    return (q[2] - q[0]) / statistics.median(times)


def stated_cost(run_dir):
    """The cost the run states of itself (its `traindx.cost` finding's evidence), or None."""
    try:
        with open(os.path.join(run_dir, "findings.json")) as f:
            found = [x for x in json.load(f) if x.get("id") == "traindx.cost"]
    except (OSError, ValueError):
        return None
    return found[0].get("evidence") if found else None


def run_arm(command, diagnose_args, run_dir):
    if diagnose_args is not None:
        command = [
            sys.executable,
            "-m",
            "traindx",
            "--quiet",
            "--run-dir",
            run_dir,
            *diagnose_args,
            "--",
            *command,
        ]
    t0 = time.time()
    # a session of its own for every arm, as diagnose starts its job: where the kernel's autogroup
    # is on, a session is a scheduling group, and a bare job sharing the caller's would get a
    # different share of a loaded machine than the diagnosed one
    proc = subprocess.run(command, capture_output=True, text=True, start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"arm failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout, time.time() - t0


def summarize(command, a, arms, results, spreads, stated):
    """The JSON summary (medians, pair ratios, spreads, stated costs), its table printed."""
    med = {arm: statistics.median(v) for arm, v in results.items()}
    summary = {
        "command": command,
        "reps": a.reps,
        "skip": a.skip,
        "arms": dict(arms),
        "median_step_s": med,
        "per_rep_step_s": results,
        "spread_iqr_over_median": spreads,
        "stated": stated if a.stated else None,
        "ratios": {},
    }
    for arm in arms:
        if arm == "bare":
            continue
        pair = [d / b for b, d in zip(results["bare"], results[arm])]
        summary["ratios"][arm] = {
            "ratio_of_medians": med[arm] / med["bare"],
            "pairwise_ratios": pair,
            "median_pairwise_ratio": statistics.median(pair),
        }
        pcts = [c["pct"] for c in stated.get(arm, []) if c and c.get("pct") is not None]
        if pcts:
            summary["ratios"][arm]["median_stated_pct"] = statistics.median(pcts)
    print(json.dumps(summary, indent=2))
    for arm, r in summary["ratios"].items():
        print(
            f"{arm:12s} median of pair ratios {r['median_pairwise_ratio']:.4f}  ratio of medians "
            f"{r['ratio_of_medians']:.4f}  spread {statistics.median(spreads[arm]):.3f} (bare "
            f"{statistics.median(spreads['bare']):.3f})"
            + (f"  stated {r['median_stated_pct']:.2f} %" if "median_stated_pct" in r else "")
        )
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each run")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=ARGS: another diagnose arm, e.g. 'nopyspy=--no-pyspy'",
    )
    p.add_argument(
        "--no-default",
        action="store_true",
        help="leave out the arm of diagnose with its defaults (only bare + variants)",
    )
    p.add_argument("--stated", action="store_true", help="read the cost each diagnose run states")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    arms = {"bare": None} if a.no_default else {"bare": None, "diagnose": []}
    for v in a.variant:
        name, _, args = v.partition("=")
        arms[name] = args.split()
    results = {arm: [] for arm in arms}
    spreads = {arm: [] for arm in arms}
    stated = {arm: [] for arm in arms if arm != "bare"}
    with tempfile.TemporaryDirectory() as out_dir:
        for rep in range(a.reps):
            for arm, diagnose_args in arms.items():
                run_dir = os.path.join(out_dir, f"{arm}-{rep}")
                out, wall = run_arm(command, diagnose_args, run_dir)
                times = step_times(out, a.skip)
                results[arm].append(statistics.median(times))
                spreads[arm].append(spread(times))
                said = ""
                if a.stated and diagnose_args is not None:
                    cost = stated_cost(run_dir)
                    stated[arm].append(cost)
                    said = (
                        f", states {cost['pct']:.2f} %"
                        if cost and cost.get("pct") is not None
                        else ", states -"
                    )
                print(
                    f"rep {rep} {arm:10s}: median step {results[arm][-1] * 1000:.2f} ms over "
                    f"{len(times)} steps, IQR/median {spreads[arm][-1]:.3f} (wall {wall:.1f} s){said}",
                    flush=True,
                )
    summary = summarize(command, a, arms, results, spreads, stated)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
