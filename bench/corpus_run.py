"""Running bench/corpus.py's jobs under `diagnose` (or `diagnose --fix`), judging what --fix kept,
and judging earlier runs again with this checkout's analyzers (--rejudge)."""

import json
import os
import subprocess
import sys
import tempfile
import time

from corpus_inject import prepare
from corpus_judge import _fmt, _healthy_step, _num, judge, table
from corpus_model import TWIN_CAUSES
from corpus_scripts import SCRIPTS


def _job_env(d, env):
    """The environment a job of the corpus runs with: ours, its own settings, its PYTHONPATH
    (relative to its scratch folder) first."""
    full_env = dict(os.environ)
    full_env.update(env)
    if "PYTHONPATH" in env:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(d, env["PYTHONPATH"])]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
    return full_env


def _run(d, script, env, run_dir, options, timeout):
    """`diagnose <options> --run-dir run_dir -- python <script>` in the scratch copy; returns the
    folder and the wall seconds (a run past the timeout keeps what it wrote)."""
    cmd = (
        [
            sys.executable,
            "-m",
            "traindx",
            *options,
            "--run-dir",
            run_dir,
            "--",
            sys.executable,
            script.main,
        ]
        + script.argv
        + json.loads(env.get("TRAINDX_CORPUS_ARGS") or "[]")
    )
    t0 = time.time()
    try:
        subprocess.run(
            cmd,
            cwd=d,
            env=_job_env(d, env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pass
    return run_dir, time.time() - t0


def run_diagnose(d, script, env, steps, out_dir, timeout):
    return _run(
        d,
        script,
        env,
        os.path.join(out_dir, os.path.basename(d)),
        ["--quiet", "--steps", str(steps)],
        timeout,
    )


def run_fix(d, script, env, steps, out_dir, timeout, tries):
    """`diagnose --fix` on the slowed copy, as a user runs it; returns its folder."""
    return _run(
        d,
        script,
        env,
        os.path.join(out_dir, os.path.basename(d) + "-fix"),
        ["--fix", "--quiet", "--steps", str(steps), "--fix-tries", str(tries)],
        timeout,
    )


def judge_fix(corpus, script, cause, fix_dir, busy_s, reproduce=None):
    """What --fix kept, and whether its patch applies to a clean copy of the slowed script.
    `reproduce` = (env, steps, out_dir, timeout): the patched clean copy is also run under plain
    `diagnose` and its median step set beside the kept arm's."""
    try:
        with open(os.path.join(fix_dir, "fix.json")) as f:
            fix = json.load(f)
    except (OSError, ValueError):
        return {"applied": False, "kept": "(no fix.json)", "ok": False}
    arms = fix.get("arms") or []
    kept = fix.get("kept") or {}
    row = {
        "applied": bool(arms),
        "arms": [f"{a.get('mechanism')}:{a.get('finding')}={_num(a.get('judged_speedup'))}x" for a in arms],
        "kept": (f"{kept.get('mechanism')}:{kept.get('finding')}" if kept else "-"),
        "speedup": kept.get("judged_speedup"),
        "significant": kept.get("significant"),
        "parity": kept.get("loss_parity"),
        "predicted_s": kept.get("predicted_step_time_s"),
        "measured_s": kept.get("measured_mean_step_s") or kept.get("measured_step_time_s"),
        "apply": fix.get("apply") or [],
        "patch_applies": None,
        "memory_slopes": kept.get("memory_slopes_bytes_per_step"),
    }
    patch = os.path.join(fix_dir, "fix.patch")
    if kept and os.path.isfile(patch):
        with tempfile.TemporaryDirectory() as tmp:
            clean = prepare(corpus, script, cause, tmp, busy_s or 0.05)[0]
            subprocess.run(["git", "init", "-q"], cwd=clean, check=True)
            proc = subprocess.run(["git", "apply", patch], cwd=clean, capture_output=True, text=True)
            row["patch_applies"] = proc.returncode == 0
            if reproduce and row["patch_applies"]:
                env, steps, out_dir, timeout = reproduce
                run_dir, _ = run_diagnose(clean, script, env, steps, out_dir, timeout)
                row["patched_median_s"] = _healthy_step(run_dir)
                row["kept_median_s"] = kept.get("measured_step_time_s")
    pred, meas = row["predicted_s"], row["measured_s"]
    row["error"] = (pred - meas) / meas if pred and meas else None
    row["ok"] = bool(
        kept
        and kept.get("significant")
        # a fix for a leak is judged by the memory's slope (its step time only must not be slower)
        and ((row["speedup"] or 0) >= 1.5 or row["memory_slopes"] is not None)
        and row["parity"] is not False
        and row["patch_applies"] is not False
    )
    if cause == "healthy" or cause in TWIN_CAUSES:  # the healthy twin: nothing to change, no arm run
        row["ok"] = not arms
    return row


def _restore_sources(corpus, r):
    """The run's scratch copy where the job ran (its manifest's cwd), when it is gone: the
    analyzers read the job's source lines, as they would on the user's machine."""
    try:
        with open(os.path.join(r["run"], "manifest.json")) as f:
            cwd = json.load(f).get("cwd")
    except (OSError, ValueError):
        return
    if cwd and not os.path.isdir(cwd) and r["script"] in SCRIPTS:
        prepare(corpus, SCRIPTS[r["script"]], r["cause"], None, r.get("busy_s") or 0.05, at=cwd)


def _injected_lines(corpus, r):
    """The inserted lines as "file:first-last" (rows of an older corpus.py name the first only)."""
    if not corpus or r["script"] not in SCRIPTS or "-" in str(r.get("injected") or "-"):
        return r.get("injected")
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(corpus, SCRIPTS[r["script"]], r["cause"], tmp, r.get("busy_s") or 0.05)
    return prep[2] if prep else r.get("injected")


def rejudge(rows_json, out_json=None, corpus=None, reanalyze=True):
    """The same runs judged by the analyzers of this checkout (before/after a change)."""
    with open(rows_json) as f:
        rows = json.load(f)
    out = []
    for r in rows:
        if r.get("run") and os.path.isdir(r["run"]):
            r = dict(r)
            r["injected"] = _injected_lines(corpus, r)
            if corpus:
                _restore_sources(corpus, r)
            if reanalyze:
                subprocess.run(
                    [sys.executable, "-m", "traindx", "report", r["run"], "--reanalyze", "--quiet"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            r.update(judge(r["cause"], r["run"], r.get("injected")))
            print(_fmt(r), flush=True)
        out.append(r)
    print()
    print(table(out))
    if out_json:
        with open(out_json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
