"""`diagnose --fix`: prescribe, apply, re-measure, prove — as a Python engine.

    result = traindx.fix(command, traindx.FixOptions(record=Options(steps=20)))

1. Baseline arm: the command as given, recorded and analyzed like `diagnose -- <cmd>`.
2. The candidates (traindx.analyzers.fixplan.candidate_plans): every concrete change a finding prescribes,
   one per arm, best predicted saving first. Mechanisms: config (env vars, the job's or its
   framework's flags), source (a patch on a scratch copy, `fix.patch` for the user), runtime (a
   shim patch), overlay (a fixed release on the candidate's PYTHONPATH), precompile
   (`kernel-cache warm --from-run <baseline>`).
3. Candidate arms: the same traindx options and the same --steps, one change each, tried in order
   until one is significantly faster with loss parity, at most `tries` arms. An arm whose
   numerics differ beyond the parity thresholds is reported as such, never kept.
4. The comparison (traindx.recipes.ab) of every arm with the baseline: written to
   <arm>/comparison.json and drawn into that arm's report.html; predicted vs measured per arm.

Folders: `runs/<id>/baseline/`, `runs/<id>/candidate/` (the first arm), `candidate-2/`, ... (each a
complete run folder), `runs/<id>/<arm>.patch` per source arm and `fix.patch` (the kept arm's),
and `runs/<id>/fix.json` (every arm, the kept one, the plan), written once when the loop ends,
whatever ends it. Progress goes to `FixOptions.reporter` as FixEvent(kind, text, data); nothing
is printed here.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from traindx.analyzers.fixplan import (  # noqa: F401  (the plan API, re-exported)
    CACHE_DIR_VAR,
    CACHE_ENABLE_VAR,
    KNOWN_FRAMEWORKS,
    PREFER_VAR,
    RUNTIME_PATCH_VAR,
    Candidate,
    Plan,
    candidate_plans,
    mechanism,
    plan_fixes,
    program_args_start,
    set_flags,
    warm_up_after,
)
from traindx.common.errors import UserError

DEFAULT_TRIES = 3


# -- precompile -----------------------------------------------------------------------------------
def warm_cache(from_run, env, say):
    """`kernel-cache warm --from-run RUN` in a process with the candidate's environment: the
    cache only serves the exact FA4 it was written by, so it must import the FA4 the job
    imports (the job's PYTHONPATH), not traindx's own."""
    code = "import sys; from traindx.kernel_cache.cli.main import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "warm", "--from-run", from_run]
    say("step", f"precompiling: kernel-cache warm --from-run {from_run}")
    try:
        proc = subprocess.run(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800
        )
        code, output = proc.returncode, proc.stdout or ""
    except subprocess.TimeoutExpired as exc:
        code, output = 124, (exc.stdout or "") + "\nkernel-cache warm: timed out after 1800 s"
    lines = output.rstrip().splitlines()
    for line in lines[-15:]:
        say("output", f"  {line}")
    if code != 0 and not lines:
        output = f"kernel-cache warm exited with {code} and printed nothing"
    return code, output[-4000:]


def last_lines(text, n=4):
    lines = [l.strip() for l in str(text or "").strip().splitlines() if l.strip()]
    return " | ".join(lines[-n:])[:800] or "(no output)"


# -- the candidate's mechanisms ----------------------------------------------------------------------
def prepare_candidate(plan, root, say, cwd, out="runs", wheels=None, arm="candidate"):
    """Make what the candidate needs: the overlay, the scratch copy with fix.patch. Returns
    (command, env, cwd, records); a step that fails says why and what runs instead."""
    from traindx.analyzers import fix_source
    from traindx.cli import fix_overlay

    env = dict(plan.env)
    here = cwd or os.getcwd()
    command, cwd, records = list(plan.command), here, {"steps": []}
    if plan.overlays:
        target = os.path.join(root, "overlay")
        say(
            "step",
            f"overlay: pip install --no-deps --target {target} "
            f"{' '.join(plan.overlays)}" + (f" --find-links {wheels}" if wheels else ""),
        )
        try:
            result = fix_overlay.install(target, plan.overlays, wheels=wheels)
            env["PYTHONPATH"] = fix_overlay.candidate_pythonpath(target)
            records["overlay"] = {
                "path": target,
                "requirements": plan.overlays,
                "installed": result["installed"],
                "wheels": wheels,
            }
            records["steps"].append({"step": "overlay", "ok": True, "installed": result["installed"]})
            say("step", f"overlay: installed {result['installed']}")
        except fix_overlay.OverlayError as exc:
            instead = _fall_back(plan, env, "overlay")
            msg = (
                f"overlay install failed: {exc.line}; last lines: {last_lines(exc.tail)}; "
                f"the candidate runs with {instead}"
            )
            plan.warnings.append(msg)
            records["steps"].append(
                {
                    "step": "overlay",
                    "ok": False,
                    "error": exc.line,
                    "output_tail": exc.tail,
                    "instead": instead,
                }
            )
            say("warning", msg)
    if plan.source_edits:
        files = [e["file"] for e in plan.source_edits]
        tree = fix_source.tree_root(files, plan.command, cwd) or ""
        scratch = os.path.join(root, "scratch", arm, os.path.basename(tree.rstrip(os.sep)) or "tree")
        try:
            if not tree:
                raise fix_source.PatchError("the patched files do not share one tree with the job")
            diff = fix_source.make_scratch(
                tree, scratch, plan.source_edits, exclude=[root, os.path.abspath(os.path.join(here, out))]
            )
            patch_path = os.path.join(root, f"{arm}.patch")
            with open(patch_path, "w", encoding="utf-8") as f:
                f.write(diff)
            # a script runs from the copy but in the job's own folder, so its relative paths
            # (../data, ./checkpoints) mean what they meant; a module (-m) runs from the copy
            script = fix_source.runs_a_script(command)
            command = fix_source.rebase_command(command, tree, scratch, cwd=here)
            base_pp = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
            if base_pp:
                env["PYTHONPATH"] = fix_source.rebase_pythonpath(base_pp, tree, scratch)
            cwd = (
                here
                if script or not fix_source._inside(here, tree)
                else os.path.join(scratch, os.path.relpath(here, tree))
            )
            records["source_patch"] = {
                "tree": tree,
                "scratch": scratch,
                "patch": patch_path,
                "apply": f"cd {tree} && git apply {patch_path}",
                "edits": plan.source_edits,
            }
            records["steps"].append({"step": "source patch", "ok": True, "patch": patch_path})
            say(
                "step",
                f"source patch: {patch_path} (the candidate runs from {scratch}; {tree} is not touched)",
            )
        except (OSError, fix_source.PatchError) as exc:
            instead = _fall_back(plan, env, "source")
            msg = f"source patch failed: {exc}; the candidate runs with {instead}"
            plan.warnings.append(msg)
            records["steps"].append(
                {"step": "source patch", "ok": False, "error": str(exc), "instead": instead}
            )
            say("warning", msg)
    return command, env, cwd, records


def _fall_back(plan, env, failed):
    """After a failed overlay/source step: the next runtime/config prescription of the same
    findings, if any. Returns a phrase saying what the candidate runs with instead."""
    used = []
    for change in plan.changes:
        if change["mechanism"] != failed:
            continue
        change["failed"] = True
        p = plan.fallbacks.get(change["finding"])
        if p is None:
            continue
        if mechanism(p) == "runtime":
            name = p.change["runtime"]["patch"]
            plan.runtime_patches.append(name)
            env[RUNTIME_PATCH_VAR] = ",".join(dict.fromkeys(plan.runtime_patches))
            used.append(f"the runtime patch {name}")
        else:
            for k, v in ((p.change or {}).get("env") or {}).items():
                env[k] = str(v)
                used.append(f"{k}={v}")
        plan.changes.append(
            {
                "finding": change["finding"],
                "mechanism": mechanism(p),
                "summary": p.summary,
                "instead_of": failed,
                "predicted_saving_s_per_step": p.expected_gain_s_per_step,
            }
        )
    return ", ".join(used) if used else f"no {failed} change (the rest of the plan only)"


def apply_commands(plan, records, command):
    """The exact commands a user runs to keep each change (fix.json's "apply")."""
    out = []
    if records.get("source_patch"):
        out.append(records["source_patch"]["apply"])
    if records.get("overlay"):
        out.append("pip install -U " + " ".join(f"'{r}'" for r in plan.overlays))
    if plan.runtime_patches and not records.get("source_patch"):
        out.append(
            f"# a runtime patch proves the diagnosis; keep the fix with the source patch "
            f"or upgrade listed above ({RUNTIME_PATCH_VAR}={','.join(plan.runtime_patches)})"
        )
    for source in plan.precompile:
        out.append(f"kernel-cache warm --from-run {shlex.quote(source)}")
    for name, value in plan.env.items():
        if name != RUNTIME_PATCH_VAR:
            out.append(f"export {name}={shlex.quote(str(value))}")
    if plan.command_changed:
        out.append(shlex.join(plan.command))
    return out


# -- the loop -------------------------------------------------------------------------------------
def _analyze(run_dir, say, comparison=None):
    """Load, analyze, write findings.json and report.html (with the comparison, if any)."""
    from traindx.cli.outputs import analyze_and_write
    from traindx.derive.run import load_run

    record = load_run(run_dir)
    try:
        findings, report_path = analyze_and_write(record)
    except UserError:
        raise
    except Exception as exc:  # a broken report must not stop the loop: the findings decide
        from traindx.analyzers import analyze
        from traindx.cli.outputs import write_findings

        say("warning", f"internal error writing the report of {run_dir}: {type(exc).__name__}: {exc}")
        findings, report_path = analyze(record), None
        write_findings(record, findings)
        return record, findings, report_path
    if comparison is not None:
        try:
            from traindx.report.html import write_report
        except ImportError:
            write_report = None
        if write_report is not None:
            from traindx.recipes.ab import report_view

            try:
                report_path = write_report(record, findings, comparison=report_view(comparison))
            except Exception as exc:  # the comparison is already in comparison.json
                say(
                    "warning",
                    f"internal error drawing the comparison into the report: {type(exc).__name__}: {exc}",
                )
    return record, findings, report_path


def _write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def _stderr_tail(run_dir, n=3):
    """The last lines the job wrote to stderr (log.txt keeps both streams, tagged)."""
    try:
        with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
            lines = [
                l.split(" ", 2)[2].rstrip()
                for l in f
                if l.split(" ", 2)[1:2] == ["e"] and len(l.split(" ", 2)) == 3
            ]
    except OSError:
        return ""
    return " | ".join(l.strip() for l in lines[-n:] if l.strip())[:600]


def _finished_baseline(base_dir, command):
    """The raw exit code of a finished baseline of this command in base_dir, else None; a
    folder holding anything else is refused."""
    path = os.path.join(base_dir, "manifest.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("status") != "finished" or list(manifest.get("command") or []) != list(command):
        raise UserError(
            f"{base_dir} already holds a run of another command (or an unfinished "
            "one): give --fix a new --run-dir"
        )
    return int(manifest.get("exit_code") or 0)


def _mean_steady_step(run):
    from traindx.derive.ledger import steady_rows

    led = steady_rows(run)
    return float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None


def attribute_changes(changes, comparison, baseline=None, findings=(), candidate=None):
    """Per applied change: the predicted step time (from the baseline's time ledger: the mean
    steady step minus the ledger lines the fix removes; the prescription's expected gain where
    the finding names no ledger line) and the measured one. With several changes in one
    candidate the measured figure is their joint effect: said so, not split by guess."""
    from traindx.analyzers.savings import predicted_step_time

    base = (comparison.get("baseline") or {}).get("median_step_s")
    cand = (comparison.get("candidate") or {}).get("median_step_s")
    by_id = {f.id: f for f in findings}
    live = [c for c in changes if not c.get("failed")]
    out = []
    for c in changes:
        gain = c.get("predicted_saving_s_per_step")
        row = dict(c)
        row["predicted_step_time_s"] = max(base - gain, 0.0) if base is not None and gain else None
        finding = by_id.get(c.get("finding"))
        if baseline is not None and finding is not None:
            try:
                pred = predicted_step_time(baseline, finding, gain=gain)
            except Exception as exc:  # a prediction must never cost the comparison
                pred = {"method": f"no ledger prediction: {type(exc).__name__}: {exc}"}
            row["ledger_prediction"] = pred
            if pred.get("predicted_step_s") is not None:
                row["predicted_saving_s_per_step"] = removed = pred.get("removed_s")
                row["predicted_step_time_s"] = pred["predicted_step_s"]
                # a mean step less what the fix removes, measured the same way on the candidate:
                # the time ledger's steady steps (the lines it removes are priced over them);
                # for a CUDA job both arms' means over the comparison's window on the GPU's
                # clock (recipes.ab.step_times: the host's steps end before the GPU's), the
                # same steps left out
                base_arm = comparison.get("baseline") or {}
                on_gpu = base_arm.get("step_source") == "shim:gpu"
                if on_gpu and base_arm.get("mean_step_s") is not None and removed is not None:
                    row["predicted_step_time_s"] = max(
                        base_arm["mean_step_s"] - removed, pred.get("gpu_busy_floor_s") or 0.0
                    )
                if not c.get("failed"):
                    row["measured_mean_step_s"] = (
                        (comparison.get("candidate") or {}).get("mean_step_s")
                        if on_gpu
                        else _mean_steady_step(candidate)
                        if candidate is not None
                        else None
                    )
        row["measured_step_time_s"] = cand if not c.get("failed") else None
        row["measured_saving_s_per_step"] = (
            base - cand if base is not None and cand is not None and not c.get("failed") else None
        )
        row["measured_jointly_with"] = (
            [o["finding"] for o in live if o is not c] if not c.get("failed") else []
        )
        out.append(row)
    return out


# -- the engine -----------------------------------------------------------------------------------
@dataclass
class FixEvent:
    """One thing the loop has to say. kind: stage | plan | step | output | warning | info |
    summary (data: record, findings, report) | comparison (data: comparison, arm)."""

    kind: str
    text: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class FixOptions:
    """What `fix` needs. `record`: the launcher's Options of every arm (steps, samplers, window);
    `run_dir`: the fix folder (default: a new one under `out`); `tries`: arms at most;
    `reporter`: receives FixEvents; `run_job(command, run_dir, options) -> raw return code`
    records one arm (default: the launcher's Job, the job's output echoed)."""

    record: Any = None
    run_dir: str | None = None
    out: str = "runs"
    wheels: str | None = None
    tries: int = DEFAULT_TRIES
    cwd: str | None = None
    reporter: Callable[[FixEvent], None] | None = None
    run_job: Callable[[list, str, Any], int] | None = None
    # the baseline arm stops once its top finding is stable (run_job is then called with
    # until_diagnosed=True: the CLI's records it under the live judgement); every candidate arm
    # runs as many steps as the baseline did
    until_diagnosed: bool = False
    # a kept change whose own run still compiles kernels cold (FA4's, after the change made
    # their keys new) gets one more arm: the same change with those kernels warmed beforehand
    warm_up_after_fix: bool = True
    # an arm not proven faster (the interval spans no gain and a real one, or it missed a
    # predicted saving) is measured once more, candidate then baseline (A B B A), and each side
    # judged by its quicker run: a neighbour's load only adds time, so one disturbed run cannot
    # decide the search
    repeat_inconclusive: bool = True


@dataclass
class FixResult:
    """What `fix` did: fix.json's content, typed. `arms`: one dict per candidate arm tried
    (dir, finding, mechanism, summary, predicted and measured step time, speedup, verdict,
    parity, significant, patch); `best`: the kept arm's folder or None."""

    root: str
    status: str
    exit_code: int
    baseline: str
    arms: list = field(default_factory=list)
    best: str | None = None
    comparison: dict | None = None
    plan: dict | None = None
    apply: list = field(default_factory=list)
    # the warm-up arm run after the kept one (FixOptions.warm_up_after_fix), when it won
    warm_up: str | None = None

    @property
    def fix_json(self) -> str:
        return os.path.join(self.root, "fix.json")

    def to_dict(self) -> dict:
        return asdict(self)


def _default_job(command, run_dir, options, until_diagnosed=False):
    """(until_diagnosed: no live judgement here, the arm runs its steps.)"""
    from traindx.profiler.launcher import CommandNotFound, Job

    def echo(stream, text):
        out = sys.stdout if stream == "o" else sys.stderr
        out.write(text + "\n")
        out.flush()

    try:
        return Job(command, run_dir, options, on_line=echo).run()
    except CommandNotFound as exc:
        raise UserError(str(exc)) from None


def _with(options, **changes):
    """A copy of the launcher Options with some fields changed."""
    import copy

    out = copy.copy(options)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


PARITY_OK = ("faster and numerically equivalent", "faster, numerics not checked")


def _is_win(comparison):
    verdict = str(comparison.get("verdict") or "")
    return (
        verdict.startswith(PARITY_OK) or verdict.startswith("faster start")
    ) and "numerics differ" not in verdict


def _parity_failed(comparison):
    parity = comparison.get("loss_parity") or {}
    return parity.get("passed") is False


def mean_speedup(comparison, n_resamples=5000, seed=0):
    """(mean(baseline) / mean(candidate), 95 % bootstrap interval) over the comparison's window
    values, or (None, None) under 5 steps an arm. For a periodic cost (a checkpoint every k
    steps) the median of the step series sits in one of its modes, so the median ratio misses
    the saving (or flips between modes, k = 2); the mean is what the cost adds per step."""
    import numpy as np

    from traindx.derive.stats import bootstrap_speedup

    values = comparison.get("window_values_s") or {}
    base = np.asarray(values.get("baseline") or [], dtype=float)
    cand = np.asarray(values.get("candidate") or [], dtype=float)
    if len(base) < 5 or len(cand) < 5 or cand.mean() <= 0:
        return None, None
    point, low, high = bootstrap_speedup(base, cand, n_resamples=n_resamples, seed=seed, statistic="mean")
    return point, [low, high]


def _periodic(finding, comparison=None):
    """A cost the median cannot see: periodic (a checkpoint every k steps), or in fewer than
    half of the window's steps (a full GC every 7 steps: the median step is a step without
    it). Judged by the mean and its bootstrap interval instead."""
    if finding is None:
        return False
    if (finding.evidence or {}).get("period") or (finding.removes or {}).get("steps"):
        return True
    window = len(((comparison or {}).get("window_values_s") or {}).get("baseline") or ())
    affected = len(finding.steps_affected or ())
    return bool(window and 0 < affected < window / 2)


def _arm_row(name, arm_dir, cand, comparison, code, patch, finding=None):
    from traindx.derive.stats import MIN_SPEEDUP

    change = (comparison.get("changes") or [{}])[0]
    significant = code == 0 and _is_win(comparison)
    # the comparison itself judges by the means where the step times have a period
    judged = {
        "judged_by": comparison.get("speedup_statistic") or "median",
        "judged_speedup": comparison.get("speedup"),
    }
    if _periodic(finding, comparison) and code == 0:
        mean, ci = mean_speedup(comparison)
        if mean is not None:
            judged = {
                "judged_by": "mean (a periodic or occasional cost: the median step is one without it)",
                "judged_speedup": mean,
                "mean_speedup_ci95": ci,
            }
            significant = mean >= MIN_SPEEDUP and ci[0] > 1.0 and not _parity_failed(comparison)
    firsts = [
        ((comparison.get(arm) or {}).get("step_times_s") or [None])[0] for arm in ("baseline", "candidate")
    ]
    if getattr(cand.plan, "precompile", None) and code == 0 and all(firsts) and firsts[1] > 0:
        # a warm-up removes the cold start: its gain is the first step, the steady steps are
        # the same kernels either way (their ratio is noise around 1)
        first = firsts[0] / firsts[1]
        judged = {"judged_by": "the first step (a cold start removed by a warm-up)", "judged_speedup": first}
        significant = first >= MIN_SPEEDUP and not _parity_failed(comparison)
    return {
        **judged,
        "arm": name,
        "dir": arm_dir,
        "finding": cand.finding,
        "mechanism": cand.mechanism,
        "summary": cand.summary,
        "exit_code": code,
        "predicted_saving_s_per_step": change.get(
            "predicted_saving_s_per_step", cand.predicted_saving_s_per_step
        ),
        "predicted_step_time_s": change.get("predicted_step_time_s"),
        "measured_mean_step_s": change.get("measured_mean_step_s"),
        "baseline_median_step_s": (comparison.get("baseline") or {}).get("median_step_s"),
        "baseline_mean_step_s": (comparison.get("baseline") or {}).get("mean_step_s"),
        "measured_step_time_s": (comparison.get("candidate") or {}).get("median_step_s"),
        "speedup": comparison.get("speedup"),
        "speedup_ci95": comparison.get("speedup_ci95"),
        "verdict": comparison.get("verdict"),
        "loss_parity": (comparison.get("loss_parity") or {}).get("passed"),
        "significant": significant,
        "patch": patch,
    }


REPEAT_SPAN = 1.2  # an interval reaching a 20 % gain does not rule a real one out


def _row_interval(row):
    return (
        row.get("mean_speedup_ci95")
        if row.get("judged_by", "median") != "median"
        else row.get("speedup_ci95")
    )


def _worth_repeating(row):
    """An arm that ran, kept parity and was not proven faster where the measurement does not
    settle it: its interval reaches REPEAT_SPAN (a real gain not ruled out), or its baseline's
    ledger predicted a significant gain (a result that contradicts its prediction is measured
    again before it is believed). A cold start judged by its first step and a failed or
    diverging arm are not measured again."""
    from traindx.derive.stats import MIN_SPEEDUP

    if row["significant"] or row["exit_code"] != 0 or row["loss_parity"] is False:
        return False
    if str(row.get("judged_by") or "").startswith("the first step"):
        return False
    interval = _row_interval(row)
    by_mean = str(row.get("judged_by") or "").startswith("mean")
    base = row.get("baseline_mean_step_s" if by_mean else "baseline_median_step_s")
    saving = row.get("predicted_saving_s_per_step")
    promised = bool(base and saving and saving >= (1 - 1 / MIN_SPEEDUP) * base)
    return bool((interval and interval[1] >= REPEAT_SPAN) or promised)


def _judged_text(row):
    speedup, interval = row.get("judged_speedup"), _row_interval(row)
    if speedup is None:
        return str(row.get("verdict"))
    by = (row.get("judged_by") or "median").split(" (")[0]
    return f"{speedup:.2f}x by the {by}" + (
        f", interval {interval[0]:.2f}-{interval[1]:.2f}x" if interval else ""
    )


def _baseline_again_dir(root, arm):
    suffix = arm[len("candidate") :] if arm.startswith("candidate") else "-" + arm
    return os.path.join(root, f"baseline-again{suffix}")


def _quicker(first, second, judged_by=None):
    """Of two recordings of one arm, the one whose steady steps took less (median, or mean
    where the arm is judged by the mean): load from outside the job only adds time."""
    from traindx.recipes.ab import measure_arm

    def typical(run):
        summary, values = measure_arm(run)
        if not len(values):
            return float("inf")
        return float(
            values.mean()
            if str(judged_by or "").startswith("mean")
            else summary.get("median_step_s") or float("inf")
        )

    return second if typical(second) < typical(first) else first


UNSURE_SHARE = 0.5  # a win under half its predicted saving: the next candidate is tried too


def _as_predicted(row):
    """A significant win that reaches at least half the saving predicted for it settles the
    search; a smaller one (a 1.3x where the finding predicted 20x: noise, or a partial fix) lets
    the next candidate be measured, and the faster one is kept. Without a positive prediction,
    significance alone settles it."""
    predicted = row.get("predicted_saving_s_per_step")
    base, cand = row.get("baseline_median_step_s"), row.get("measured_step_time_s")
    if row.get("judged_by", "median") != "median" and row.get("judged_speedup"):
        return True  # a periodic cost: the medians do not measure it
    if not predicted or predicted <= 0 or base is None or cand is None:
        return True
    return base - cand >= UNSURE_SHARE * predicted


SAME_GAIN_TOLERANCE = 0.10  # two wins within 10 % of each other: noise on these machines
# lasting fixes first; a runtime shim patch proves the diagnosis, its lasting form is the source
# patch or the upgrade
MECHANISM_ORDER = {"config": 0, "source": 1, "overlay": 2, "runtime": 3, "precompile": 4}


def _keep(arms):
    """The arm to keep: the fastest significant win with parity; else the fastest arm that ran,
    kept parity and was not slower than the baseline (marked not significant); None when none
    did."""
    # never an arm slower than the baseline: "the fastest with parity" of arms that all lost
    # would hand the user a patch that costs time (a thread started per appended item: 0.01x)
    ok = [
        a
        for a in arms
        if a["exit_code"] == 0
        and a["loss_parity"] is not False
        and a.get("judged_speedup") is not None
        and a["judged_speedup"] >= 1.0
    ]
    wins = [a for a in ok if a["significant"]]
    pool = wins or ok
    if not pool:
        return None
    # wins within run-to-run noise of the fastest are the same gain: keep the least invasive
    # (the job's own flag before an edit of its source: `--workers 2` over a patched literal)
    best = max(a["judged_speedup"] for a in pool)
    close = [a for a in pool if a["judged_speedup"] >= best * (1 - SAME_GAIN_TOLERANCE)]
    return min(
        close,
        key=lambda a: (MECHANISM_ORDER.get(a.get("mechanism"), len(MECHANISM_ORDER)), -a["judged_speedup"]),
    )


def fix(command: list, options: FixOptions | None = None) -> FixResult:
    """Baseline, candidates by predicted saving, measured arms, the kept one (module doc)."""
    from traindx.profiler.launcher import CommandNotFound, Options, new_run_dir, resolve_command

    options = options or FixOptions()
    record_options = options.record or Options()
    if options.cwd and not record_options.cwd:
        record_options = _with(record_options, cwd=options.cwd)
    cwd = record_options.cwd or os.getcwd()
    run_job = options.run_job or _default_job
    reporter = options.reporter or (lambda event: None)

    def say(kind, text="", **data):
        reporter(FixEvent(kind, text, data))

    if not command:
        raise UserError("no command given")
    if options.tries < 1:
        raise UserError("--fix-tries must be at least 1")
    try:
        resolve_command(command)
    except CommandNotFound as exc:
        raise UserError(str(exc)) from None
    root = os.path.abspath(options.run_dir or new_run_dir(options.out))
    os.makedirs(root, exist_ok=True)
    base_dir = os.path.join(root, "baseline")
    if os.path.exists(os.path.join(root, "candidate", "manifest.json")):
        raise UserError(f"{os.path.join(root, 'candidate')} already holds a run: give --fix a new --run-dir")
    reuse = _finished_baseline(base_dir, command)
    result = FixResult(root=root, status="baseline", exit_code=0, baseline=base_dir)
    try:
        _loop(command, options, record_options, cwd, run_job, say, result, reuse)
    except BaseException:
        if result.status not in ("done", "nothing to apply", "baseline failed"):
            result.status = f"interrupted during {result.status}"
        raise
    finally:
        _write_json(result.fix_json, _fix_document(command, result))
    say("info", f"fix: {root}")
    return result


def _fix_document(command, result):
    doc = result.to_dict()
    doc["command"] = command
    best = next((a for a in result.arms if a["dir"] == result.best), None)
    doc["candidate"] = result.best
    doc["kept"] = best
    return doc


def _loop(command, options, record_options, cwd, run_job, say, result, reuse):
    from traindx.derive.run import load_run
    from traindx.profiler.launcher import exit_status
    from traindx.recipes.ab import compare_runs

    root, base_dir = result.root, result.baseline
    say("stage", "baseline arm")
    if reuse is not None:
        say("info", f"baseline: reusing the finished run in {base_dir}")
        code = reuse
    else:
        os.makedirs(base_dir)
        code = (
            run_job(command, base_dir, record_options, until_diagnosed=True)
            if options.until_diagnosed
            else run_job(command, base_dir, record_options)
        )
    baseline, findings, report = _analyze(base_dir, say)
    if options.until_diagnosed and len(baseline.steps):
        # the candidates run the steps the baseline ran (its own stop, or the job's end)
        record_options = _with(record_options, steps=int(baseline.steps.groupby("rank").size().max()))
        stopped = len(baseline.of_type("stop_requested")) > 0
        say(
            "info",
            f"baseline: {'stopped once diagnosed, after' if stopped else 'ran'} "
            f"{record_options.steps} steps; each candidate runs as many",
        )
    say("summary", "baseline", record=baseline, findings=findings, report=report)
    result.exit_code = exit_status(code)
    if result.exit_code != 0:
        result.status = "baseline failed"
        say(
            "info",
            f"the baseline arm exited with {result.exit_code}: no candidate run (a fix "
            "is measured against a baseline that ran)",
        )
        return

    prefer = "overlay" if options.wheels else None
    candidates, listing = candidate_plans(command, findings, baseline.path, prefer=prefer, cwd=cwd)
    result.plan = dict(listing.to_dict(), candidates=[c.to_dict() for c in candidates])
    say("stage", "prescriptions")
    for i, c in enumerate(candidates):
        tried = "" if i < options.tries else " (beyond --fix-tries: not measured)"
        gain = c.predicted_saving_s_per_step
        say(
            "plan",
            f"candidate {i + 1}: [{c.finding}] ({c.mechanism}) {c.summary}"
            + (f"; predicted saving {gain * 1000:.1f} ms/step" if gain else "")
            + tried,
        )
    for line in listing.instructions:
        say("plan", f"by hand: {line}")
    for line in listing.deferred:
        say("plan", f"later: {line}")
    for line in listing.warnings:
        say("warning", line)
    if not candidates:
        result.status = "nothing to apply"
        say("info", "nothing to apply automatically: no candidate run")
        return

    comparisons, arm_candidates, arm_findings = {}, {}, {}
    for i, cand in enumerate(candidates[: options.tries]):
        name = "candidate" if i == 0 else f"candidate-{i + 1}"
        result.status = name
        others = [f"[{c.finding}] ({c.mechanism}) {c.summary}" for c in candidates if c is not cand]
        row, comparison, cand_code, cand_findings = _run_arm(
            name,
            cand,
            command,
            baseline,
            findings,
            root,
            options,
            record_options,
            run_job,
            say,
            compare_runs,
            load_run,
            alternatives=listing.alternatives + others,
            searched=result.arms,
        )
        comparisons[row["dir"]] = comparison
        arm_candidates[row["dir"]], arm_findings[row["dir"]] = cand, cand_findings
        result.arms.append(row)
        if row["significant"] and _as_predicted(row):
            break
        why = (
            "its numerics differ from the baseline's"
            if _parity_failed(comparison)
            else f"it failed (exit {row['exit_code']})"
            if row["exit_code"] != 0
            else "under half its predicted saving"
            if row["significant"]
            else f"no significant gain ({row['verdict']})"
        )
        if i + 1 < min(len(candidates), options.tries):
            say("info", f"{name}: {why}; trying the next candidate")
    kept = _keep(result.arms)
    result.best = kept["dir"] if kept else None
    # the job's exit code passes through: the kept arm's, else the last arm's
    result.exit_code = (kept or result.arms[-1])["exit_code"]
    result.comparison = comparisons.get(result.best) if kept else None
    if kept and kept["dir"] != result.arms[-1]["dir"]:
        # the search went past the kept arm: its comparison and report are redrawn with every
        # arm measured, the kept one marked
        comparison = result.comparison
        comparison["search"] = [_search_row(a, kept["dir"]) for a in result.arms]
        _write_json(os.path.join(kept["dir"], "comparison.json"), comparison)
        try:
            _analyze(kept["dir"], say, comparison=comparison)
        except Exception as exc:  # the comparison.json above has it all
            say("warning", f"could not redraw {kept['dir']}/report.html: {exc}")
    if kept:
        result.apply = comparisons[kept["dir"]].get("change", {}).get("apply") or (
            comparisons[kept["dir"]].get("apply") or []
        )
    warm = None
    if kept and options.warm_up_after_fix and kept["exit_code"] == 0:
        warm = warm_up_after(arm_candidates[kept["dir"]], arm_findings[kept["dir"]], kept["dir"])
    if warm is not None:
        result.status = "warm-up"
        row, comparison, _, _ = _run_arm(
            "warm-up",
            warm,
            command,
            load_run(kept["dir"]),
            arm_findings[kept["dir"]],
            root,
            options,
            record_options,
            run_job,
            say,
            compare_runs,
            load_run,
            searched=[],
        )
        row["after"] = kept["dir"]
        result.arms.append(row)
        if row["significant"]:
            result.warm_up = row["dir"]
            # the kept change's own lines stay first; the warm-up adds its commands and env
            result.apply = result.apply + [
                line
                for line in comparison.get("apply") or []
                if line not in result.apply
                and (
                    "kernel-cache warm" in line
                    or any(line.startswith(f"export {var}=") for var in (CACHE_ENABLE_VAR, CACHE_DIR_VAR))
                )
            ]
    patch = os.path.join(root, "fix.patch")
    if kept and kept.get("patch"):
        shutil.copyfile(kept["patch"], patch)
        result.apply = [line.replace(kept["patch"], patch) for line in result.apply]
    elif os.path.exists(patch):
        os.unlink(patch)
    for a in result.arms:
        mark = (
            "kept"
            if kept and a["dir"] == kept["dir"]
            else "then kept"
            if a["dir"] == result.warm_up
            else "tried"
        )
        judged = (a.get("judged_by") or "median").split(" (")[0]
        speed = (f"{a['judged_speedup']:.2f}x" if a.get("judged_speedup") is not None else "n/a") + (
            ""
            if judged == "median"
            else f" by {judged}"
            if judged.startswith("the ")
            else f" by the {judged}"
        )
        pred, meas = a.get("predicted_step_time_s"), a.get("measured_step_time_s")
        pm = (
            f"; predicted {pred:.4f} s/step, measured {meas:.4f} s/step"
            if pred is not None and meas is not None
            else ""
        )
        say("info", f"{mark}: {a['arm']} [{a['finding']}] ({a['mechanism']}) {speed}, {a['verdict']}{pm}")
    result.status = "done"


def _run_arm(
    name,
    cand,
    command,
    baseline,
    findings,
    root,
    options,
    record_options,
    run_job,
    say,
    compare_runs,
    load_run,
    alternatives=(),
    searched=(),
):
    """Prepare, record, compare and analyze one candidate arm. Returns (row, comparison, code)."""
    from traindx.profiler.launcher import exit_status

    plan = cand.plan
    arm_dir = os.path.join(root, name)
    say("stage", f"{name}: [{cand.finding}] ({cand.mechanism}) {cand.summary}")
    for line in plan.applied:
        say("step", f"apply: {line}")
    if plan.command_changed:
        say("step", f"candidate command: {shlex.join(plan.command)}")
    for var, value in plan.env.items():
        say("step", f"candidate env: {var}={value}")
    for line in plan.warnings:
        say("warning", line)
    cand_command, cand_env, cand_cwd, records = prepare_candidate(
        plan, root, say, record_options.cwd, out=options.out, wheels=options.wheels, arm=name
    )
    precompiled = []
    for source in plan.precompile:
        env = dict(os.environ)
        env.update(cand_env)
        rc, output = warm_cache(source, env, say)
        precompiled.append({"from_run": source, "exit_code": rc, "output_tail": output})
        if rc != 0:
            plan.warnings.append(
                f"kernel-cache warm --from-run {source} exited with {rc}: "
                f"{last_lines(output)}; the candidate runs with whatever "
                "the cache holds (FA4 compiles what is missing)"
            )
            say("warning", plan.warnings[-1])
    apply = apply_commands(plan, records, command)
    os.makedirs(arm_dir)
    extra = dict(record_options.extra_env or {})
    extra.update(cand_env)
    cand_code = run_job(cand_command, arm_dir, _with(record_options, extra_env=extra, cwd=cand_cwd))
    candidate = load_run(arm_dir)
    deferred = [line.replace("<the candidate run>", arm_dir) for line in plan.deferred]
    change = {
        "applied": plan.applied,
        "alternatives": list(dict.fromkeys(plan.alternatives + list(alternatives))),
        "instructions": plan.instructions + deferred,
        "warnings": plan.warnings,
        "precompiled": [
            f"kernel-cache warm --from-run {p['from_run']} (exit {p['exit_code']})" for p in precompiled
        ],
    }
    change["steps"] = records["steps"] + [
        {
            "step": "kernel-cache warm",
            "ok": p["exit_code"] == 0,
            "from_run": p["from_run"],
            "error": None if p["exit_code"] == 0 else last_lines(p["output_tail"]),
        }
        for p in precompiled
    ]
    change["apply"] = apply
    patch = (records.get("source_patch") or {}).get("patch")
    finding = next((f for f in findings if f.id == cand.finding), None)

    def judge(base_run, cand_run):
        comparison = compare_runs(base_run, cand_run, change=change)
        comparison["precompile_runs"] = precompiled
        comparison["changes"] = attribute_changes(plan.changes, comparison, base_run, findings, cand_run)
        comparison["apply"] = apply
        if patch:
            comparison["fix_patch"] = patch
        if records.get("overlay"):
            comparison["overlay"] = records["overlay"]
        if exit_status(cand_code) != 0:
            # a candidate that crashed (an unknown flag, a broken env) proves nothing but that
            comparison["verdict"] = (
                f"candidate failed (exit {exit_status(cand_code)}): the change does not work as applied"
            )
            tail = _stderr_tail(arm_dir)
            if tail:
                comparison["problems"].append(f"the candidate's last error lines: {tail}")
            if any(c["mechanism"] == "source" for c in plan.changes) and plan.fallbacks:
                comparison["problems"].append(
                    f"the source patch changed what the job's code expects downstream; prove "
                    f"the diagnosis without it: {PREFER_VAR}=runtime diagnose --fix --run-dir "
                    f"{root} (the baseline is reused), then adapt fix.patch"
                )
        elif _parity_failed(comparison):
            comparison["problems"].append(
                "loss parity failed: this change alters the numerics; it is reported, not kept"
            )
        return comparison, _arm_row(name, arm_dir, cand, comparison, exit_status(cand_code), patch, finding)

    comparison, row = judge(baseline, candidate)
    if options.repeat_inconclusive and _worth_repeating(row):
        first = {
            k: row.get(k)
            for k in ("judged_by", "judged_speedup", "speedup_ci95", "mean_speedup_ci95", "verdict")
        }
        say(
            "info",
            f"{name}: not proven ({_judged_text(row)}): measured again, the candidate "
            "then the baseline (A B B A); each side is judged by its quicker run",
        )
        again_dir, base_again_dir = arm_dir + "-again", _baseline_again_dir(root, name)
        os.makedirs(again_dir)
        again_code = run_job(cand_command, again_dir, _with(record_options, extra_env=extra, cwd=cand_cwd))
        os.makedirs(base_again_dir)
        base_again_code = run_job(command, base_again_dir, record_options)
        if exit_status(again_code) == 0 and exit_status(base_again_code) == 0:
            base_pick = _quicker(baseline, load_run(base_again_dir), row.get("judged_by"))
            cand_pick = _quicker(candidate, load_run(again_dir), row.get("judged_by"))
            comparison, row = judge(base_pick, cand_pick)
            comparison["problems"].append(
                f"measured twice (the candidate then the baseline again: A B B A); the first "
                f"pair gave {_judged_text(first)}; each side is judged by its quicker run "
                f"(another job's load only adds time): the baseline of {base_pick.path}, the "
                f"candidate of {cand_pick.path}"
            )
        else:
            comparison["problems"].append(
                f"measured again, but a repeated arm failed (candidate exit "
                f"{exit_status(again_code)}, baseline exit {exit_status(base_again_code)}): "
                "judged by the first pair"
            )
        row["repeat"] = {
            "first": first,
            "candidate": again_dir,
            "baseline": base_again_dir,
            "judged_on": [comparison["baseline"]["run"], comparison["candidate"]["run"]],
        }
    # a significant arm that reaches its prediction ends the search and is kept
    comparison["search"] = [_search_row(a) for a in searched] + [
        _search_row(row, arm_dir if row["significant"] and _as_predicted(row) else None)
    ]
    _write_json(os.path.join(arm_dir, "comparison.json"), comparison)
    record, cand_findings, cand_report = _analyze(arm_dir, say, comparison=comparison)
    say("summary", name, record=record, findings=cand_findings, report=cand_report)
    say("comparison", name, comparison=comparison, arm=arm_dir)
    return row, comparison, cand_code, cand_findings


def _search_row(arm, kept=None):
    row = {
        k: arm.get(k)
        for k in ("arm", "finding", "mechanism", "verdict", "predicted_step_time_s", "measured_step_time_s")
    }
    row["speedup"] = arm.get("judged_speedup")
    row["kept"] = kept is not None and arm["dir"] == kept
    return row
