"""Time to finding: seconds from the job's start to each cause on the screen, and steps.

Live runs: each pathology of examples/pathologies.py (and, with --seed DIR, the FA4 seed example
with flash-attn-4 4.0.0b17 from DIR; a Triton kernel re-autotuning from a chosen step, run by
Triton's CPU interpreter) under `diagnose --until-diagnosed`, then the run folder is read:
manifest start, the live judgement's record of when each finding was first shown (live.json),
the step it was shown at, the step count the analysis read, what triggered it, the live CPU
share, and the step the job was stopped at. `--load N` runs N CPU burners beside each job.

Onset: the first step count at which the end-of-run analysis of the record cut there already
names the finding (`--onset`: one batch analysis per cut, after the job): "steps after onset"
is then the step shown minus that count, a measure of the live judgement alone.

Replay (`--replay RUN_DIR ...`): a finished run folder's events are written again, in time
order, into a scratch folder while a LiveJudge follows it on a clock that is the events' own
time: CPU per pass and the step each finding is shown at, deterministic for one recorded job;
`--judge old` replays with analyzers/live/live.py of git HEAD~N (`--old-rev`) to compare.

    python bench/time_to_finding.py --onset --out bench/results/time_to_finding.json [--load 2]
    python bench/time_to_finding.py --replay RUN_DIR [--judge old --old-rev main]
    python bench/time_to_finding.py --pass-cost RUN_DIR
    python bench/time_to_finding.py --pass-growth RUN_DIR   # a live pass after 2 more steps
"""

import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_JOB = os.path.join(ROOT, "tests", "jobs", "triton_retune.py")
CASES = {  # name: (job args, steps asked, the finding id prefix expected first, env)
    "dataloader": (["examples/pathologies.py", "--pathology", "dataloader"], 4000, "dataloader.", {}),
    "gc": (["examples/pathologies.py", "--pathology", "gc"], 2000, "gc.", {}),
    "sync": (["examples/pathologies.py", "--pathology", "sync"], 2000, "host_sync.", {}),
    "gil": (["examples/pathologies.py", "--pathology", "gil"], 2000, "gil.", {}),
    "periodic": (["examples/pathologies.py", "--pathology", "periodic"], 400, "steps.periodic", {}),
    "triton-retune": ([TRITON_JOB, "--retune-from", "12"], 200, "jit.autotune", {"TRITON_INTERPRET": "1"}),
}


def run_case(name, job, steps, expect, env_extra, onset=False):
    work = tempfile.mkdtemp(prefix=f"ttf-{name}-")
    run_dir = os.path.join(work, "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    cmd = [
        sys.executable,
        "-m",
        "traindx",
        "--until-diagnosed",
        "--run-dir",
        run_dir,
        "--",
        sys.executable,
        *[os.path.join(ROOT, a) if a.endswith(".py") else a for a in job],
        "--steps",
        str(steps),
    ]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    row = summarize(name, run_dir, expect, steps, proc.returncode)
    return with_onset(row, run_dir) if onset else row


def with_onset(row, run_dir):
    """The row with its finding's onset and the steps from it to the screen. Two counts: from
    the onset (the batch analysis of the record cut there names it), and from the first step
    count at which a finding of that onset can be *stable* by the live rule (seen in two
    steady steps: STABLE_AFTER_STEPS; a recompile or re-autotune at once)."""
    from traindx.analyzers.live.live import PROVEN_AT_ONCE, STABLE_AFTER_STEPS

    if not row.get("first_finding"):
        return row
    row["onset_step"] = onset_step(run_dir, row["first_finding"], row["step_shown"])
    if row["onset_step"] is not None:
        row["steps_after_onset"] = row["step_shown"] - row["onset_step"]
        proven = any(k in row["first_finding"] for k in PROVEN_AT_ONCE)
        row["stable_from_step"] = row["onset_step"] if proven else max(row["onset_step"], STABLE_AFTER_STEPS)
        row["steps_after_stable_onset"] = row["step_shown"] - row["stable_from_step"]
        # seconds from the end of the step that made the record show it (the onset's last
        # step) to the screen: what "steps after" means on steps of a few ms
        ends = [t for t, _, line in _event_lines(run_dir) if '"step_end"' in line]
        live = json.load(open(os.path.join(run_dir, "live.json")))
        shown_ns = live["findings"][row["first_finding"]]["t_ns"]
        for key, n in (
            ("seconds_after_onset", row["onset_step"]),
            ("seconds_after_stable_onset", row["stable_from_step"]),
        ):
            if 0 < n <= len(ends):
                row[key] = round((shown_ns - ends[n - 1]) / 1e9, 3)
        row["median_step_s"] = _median_step(run_dir)
    return row


def _median_step(run_dir):
    durations = sorted(
        json.loads(line)["duration_s"]
        for _, _, line in _event_lines(run_dir)
        if '"step_end"' in line and '"duration_s"' in line
    )
    return round(durations[len(durations) // 2], 4) if durations else None


def summarize(name, run_dir, expect="", steps=None, returncode=None):
    """The time-to-finding row of one run folder written with the live judgement on."""
    manifest = json.load(open(os.path.join(run_dir, "manifest.json")))
    live = {}
    if os.path.isfile(os.path.join(run_dir, "live.json")):
        live = json.load(open(os.path.join(run_dir, "live.json")))
    shown = live.get("findings", {})
    first = min(shown.items(), key=lambda kv: kv[1]["t_ns"]) if shown else None
    steps_done = 0
    for name_ in os.listdir(os.path.join(run_dir, "events")):
        with open(os.path.join(run_dir, "events", name_), encoding="utf-8") as f:
            steps_done = max(steps_done, sum('"step_end"' in line for line in f))
    wall = (manifest["end_ns"] - manifest["start_ns"]) / 1e9
    passes = live.get("passes", [])
    return {
        "case": name,
        "exit": manifest.get("exit_code") if returncode is None else returncode,
        "steps_asked": steps,
        "steps_run": steps_done,
        "first_finding": first[0] if first else None,
        "expected": expect,
        "right": bool(first and first[0].startswith(expect)),
        "seconds_to_finding": None if not first else (first[1]["t_ns"] - manifest["start_ns"]) / 1e9,
        "step_shown": None if not first else first[1]["step"],
        "step_analysed": None if not first else first[1].get("analysed_step"),
        "trigger": None if not first else first[1].get("trigger"),
        "job_wall_s": wall,
        "analyses": live.get("analyses"),
        "cpu_per_pass_s": [p["cpu_s"] for p in passes],
        "live_cpu_share": None if not live else live.get("analysis_cpu_s", 0) / wall,
        "cheap_stage_cpu_s": live.get("cheap_stage_cpu_s"),
        "polls": live.get("polls"),
    }


def _event_lines(run_dir):
    """[(t, file name, line)] of every events file, in time order (a file's own order kept)."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "events", "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                try:
                    t = int(json.loads(line).get("t") or 0)
                except (ValueError, TypeError, AttributeError):
                    continue
                out.append((t, n, os.path.basename(path), line))
    out.sort(key=lambda x: (x[0], x[2], x[1]))
    return [(t, name, line) for t, _, name, line in out]


def _cut(run_dir, lines, upto, dst):
    """`dst`: the run folder as it was once `upto` step ends had been written."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(os.path.join(dst, "events"))
    manifest = json.load(open(os.path.join(run_dir, "manifest.json")))
    manifest.update(status="running", end_ns=None, exit_code=None)
    json.dump(manifest, open(os.path.join(dst, "manifest.json"), "w"))
    ends, files = 0, {}
    for _, name, line in lines:
        if ends >= upto:
            break
        files.setdefault(name, []).append(line)
        ends += '"step_end"' in line
    for name, rows in files.items():
        open(os.path.join(dst, "events", name), "w").writelines(rows)


def onset_step(run_dir, finding_id, up_to):
    """The first step count at which the batch analysis of the record cut there names
    `finding_id` as a root cause of severity high or critical, what the live view prints
    (None: not before `up_to`)."""
    from traindx.analyzers import analyze
    from traindx.derive.run import load_run

    lines = _event_lines(run_dir)
    dst = tempfile.mkdtemp(prefix="ttf-cut-")
    warnings.simplefilter("ignore")
    for n in range(1, (up_to or 0) + 1):
        _cut(run_dir, lines, n, dst)
        if any(
            f.id == finding_id and f.cause is None and f.severity in ("high", "critical")
            for f in analyze(load_run(dst, cache=False))
        ):
            return n
    return None


def _judge_module(which, rev):
    if which == "new":
        import traindx.analyzers.live.live as module

        return module
    src = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:analyzers/live/live.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "live_old.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location("live_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["live_old"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def replay(run_dir, which="new", rev="HEAD"):
    """Follow a finished run folder written again event by event; the budget's clock is the
    events' time (the analyses' CPU is real). Returns its row."""
    module = _judge_module(which, rev)
    manifest = json.load(open(os.path.join(run_dir, "manifest.json")))
    start = manifest["start_ns"] / 1e9
    lines = _event_lines(run_dir)
    dst = tempfile.mkdtemp(prefix="ttf-replay-")
    _cut(run_dir, lines, 0, dst)
    clock = _Clock(start)
    shown = []
    import inspect

    takes_clock = "clock" in inspect.signature(module.LiveJudge).parameters
    kw = {"clock": clock} if takes_clock else {}
    if not takes_clock:  # an old judge that reads time.monotonic(): give it the events' clock
        module.time = type(
            "T",
            (),
            {
                "monotonic": staticmethod(clock),
                "process_time": staticmethod(__import__("time").process_time),
                "thread_time": staticmethod(__import__("time").thread_time),
                "time_ns": staticmethod(__import__("time").time_ns),
            },
        )
    judge = module.LiveJudge(
        dst, module.LiveOptions(), on_finding=lambda f, s: shown.append((f.id, s.step)), **kw
    )
    judge._start = start
    judge._warm_imports()
    if hasattr(judge, "_warm_sources"):  # the job's scripts parsed once, as the live loop does
        judge._warm_sources()
    handles = {}
    poll_s = judge.options.poll_s
    next_poll = start
    for t, name, line in lines:
        f = handles.get(name) or handles.setdefault(name, open(os.path.join(dst, "events", name), "a"))
        f.write(line)
        if '"step_end"' in line or t / 1e9 >= next_poll:
            f.flush()
            clock.t = max(clock.t, t / 1e9)
            next_poll = clock.t + poll_s
            judge.step_once()
    for f in handles.values():
        f.close()
    s = judge.state
    passes = getattr(s, "passes", None)
    return {
        "run": run_dir,
        "judge": which,
        "shown": shown,
        "analyses": s.analyses,
        "passes": passes,
        "full_stage_cpu_s": round(s.analysis_cpu_s, 4),
        "cheap_stage_cpu_s": round(getattr(s, "cheap_cpu_s", 0.0), 4),
        "polls": getattr(s, "polls", None),
        "wall_s": round(clock.t - start, 2),
        "errors": judge.errors,
    }


def pass_cost(run_dir, points=4):
    """CPU of one full pass (load + every analyzer) at `points` step counts of a recorded run,
    the batch load against the incremental one (EventsSoFar carried from the point before)."""
    import time

    from traindx.analyzers import analyze
    from traindx.derive.run import EventsSoFar, load_run

    warnings.simplefilter("ignore")
    lines = _event_lines(run_dir)
    steps = sum('"step_end"' in line for _, _, line in lines)
    dst = tempfile.mkdtemp(prefix="ttf-cost-")
    so_far, rows = EventsSoFar(), []
    analyze(load_run(run_dir, cache=False))  # one-time costs out of the way
    for k in range(1, points + 1):
        n = steps * k // points
        _cut(run_dir, lines, n, dst)
        row = {"run": run_dir, "steps": n}
        for name, kw in (("batch", {}), ("incremental", {"so_far": so_far})):
            t0 = time.process_time()
            run = load_run(dst, cache=False, **kw)
            row[f"{name}_load_s"] = round(time.process_time() - t0, 4)
            analyze(run)
            row[f"{name}_pass_s"] = round(time.process_time() - t0, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def pass_growth(run_dir, counts=(3, 50, 150), grown=2, reps=5):
    """CPU of one live pass (load + every analyzer) right after the record grew by `grown`
    steps, at each step count: the EventsSoFar (parse offsets and kept frames) of a pass at
    count - grown carried, as in a live run; the minimum and median of `reps` (a loaded machine
    only ever adds time)."""
    import time

    from traindx.analyzers import analyze
    from traindx.derive.run import EventsSoFar, load_run

    warnings.simplefilter("ignore")
    lines = _event_lines(run_dir)
    dst = tempfile.mkdtemp(prefix="ttf-grow-")
    analyze(load_run(run_dir, cache=False))  # one-time costs out of the way
    rows = []
    for n in counts:
        took = []
        for _ in range(reps):
            so_far = EventsSoFar()
            _cut(run_dir, lines, max(1, n - grown), dst)
            analyze(load_run(dst, cache=False, so_far=so_far))
            _cut(run_dir, lines, n, dst)
            t0 = time.process_time()
            analyze(load_run(dst, cache=False, so_far=so_far))
            took.append(time.process_time() - t0)
        took.sort()
        rows.append(
            {
                "run": run_dir,
                "steps": n,
                "grown_by": grown,
                "pass_min_s": round(took[0], 4),
                "pass_median_s": round(took[len(took) // 2], 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--seed",
        default=None,
        metavar="DIR",
        help="a folder with flash-attn-4 4.0.0b17 (pip install --target DIR)",
    )
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--onset", action="store_true", help="measure each finding's onset step")
    ap.add_argument("--load", type=int, default=0, help="CPU burners beside each job")
    ap.add_argument("--reps", type=int, default=1, help="runs of each case (interleaved)")
    ap.add_argument(
        "--job-args",
        default="",
        metavar="ARGS",
        help="more arguments for the examples/pathologies.py cases (e.g. a wider "
        "model: '--width 1024 --batch-size 256', steps of ~0.1 s)",
    )
    ap.add_argument(
        "--summarize",
        nargs="*",
        default=None,
        metavar="NAME=RUN_DIR[:EXPECT]",
        help="only read run folders already written (e.g. on the GPU machine)",
    )
    ap.add_argument("--replay", nargs="*", default=None, metavar="RUN_DIR")
    ap.add_argument(
        "--pass-cost",
        nargs="*",
        default=None,
        metavar="RUN_DIR",
        help="CPU of a full pass at 4 step counts: batch vs incremental load",
    )
    ap.add_argument(
        "--pass-growth",
        nargs="*",
        default=None,
        metavar="RUN_DIR",
        help="CPU of a live pass after 2 more steps, at 3, 50 and 150 steps",
    )
    ap.add_argument("--judge", choices=["new", "old"], default="new")
    ap.add_argument("--old-rev", default="HEAD")
    return ap


def main():
    a = _parser().parse_args()
    rows = []
    if a.pass_growth:
        for run_dir in a.pass_growth:
            rows += pass_growth(run_dir)
    elif a.pass_cost:
        for run_dir in a.pass_cost:
            rows += pass_cost(run_dir)
    elif a.replay:
        for run_dir in a.replay:
            rows.append(replay(run_dir, a.judge, a.old_rev))
            print(json.dumps(rows[-1]), flush=True)
    elif a.summarize:
        for spec in a.summarize:
            name, _, rest = spec.partition("=")
            run_dir, _, expect = rest.partition(":")
            rows.append(summarize(name, run_dir, expect))
            if a.onset:
                with_onset(rows[-1], run_dir)
            print(json.dumps(rows[-1]), flush=True)
    else:
        rows += _run_cases(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


def _run_cases(a):
    """Every case (or --only's) run --reps times, interleaved, beside --load CPU burners."""
    rows = []
    cases = dict(CASES)
    if a.seed:
        cases["fa4-seed"] = (
            ["examples/fa4_seed.py", "--max-seqlen-as", "tensor"],
            20,
            "jit.",
            {"PYTHONPATH": os.path.abspath(a.seed)},
        )
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.load)]
    try:
        for rep in range(1, a.reps + 1):
            for name, (job, steps, expect, env) in cases.items():
                if a.only and name not in a.only:
                    continue
                if a.job_args and "examples/pathologies.py" in job:
                    job = job + a.job_args.split()
                row = run_case(name, job, steps, expect, env, onset=a.onset)
                row.update(burners=a.load, rep=rep)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    return rows


if __name__ == "__main__":
    main()
