"""`diagnose --fix`: prescribe, apply, re-measure, prove — as a Python engine.

    result = traindx.fix(command, traindx.FixOptions(record=Options(steps=20)))

1. Baseline arm: the command as given, recorded and analyzed like `diagnose -- <cmd>`.
2. The candidates (traindx.fixing.plan.planner.candidate_plans): every concrete change a finding prescribes,
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

The engine's parts: model (options, events, result), prepare (what an arm needs before
it runs), arm (one arm run, compared and recorded), runner (the loop). Every verdict,
whether an arm is a win, is measured again, settles the search or is kept, is the judge's
(traindx.analyzers.core.ab_verdict): the runner runs arms and decides nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from traindx.analyzers.core import ab_verdict
from traindx.analyzers.core.ab_verdict import Arm
from traindx.analyzers.core.ab_verdict import periodic_cost as _periodic  # noqa: F401  (re-exported)
from traindx.common.errors import UserError
from traindx.fixing.plan.planner import (  # noqa: F401  (the plan API, re-exported)
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
from traindx.fixing.run import confine as fix_confine
from traindx.fixing.run.arm import attribute_changes  # noqa: F401  (re-exported)
from traindx.fixing.run.model import (  # noqa: F401  (re-exported: the engine's API)
    DEFAULT_TRIES,
    FixEvent,
    FixOptions,
    FixResult,
    with_options,
    write_fix_json,
)
from traindx.fixing.run.prepare import (  # noqa: F401  (re-exported)
    apply_commands,
    last_lines,
    prepare_candidate,
    warm_cache,
)
from traindx.fixing.run.runner import run_loop
from traindx.fixing.run.scrub import scrub_copies
from traindx.profiler.launcher import CommandNotFound, Job, Options, new_run_dir, resolve_command
from traindx.profiler.manifest import RunDirRefused, refuse_a_foreign_folder


def fix(command: list[str], options: FixOptions | None = None) -> FixResult:
    """Baseline, candidates by predicted saving, measured arms, the kept one (module doc)."""
    options = options or FixOptions()
    record_options = options.record or Options()
    if options.cwd and not record_options.cwd:
        record_options = with_options(record_options, cwd=options.cwd)
    cwd = record_options.cwd or os.getcwd()
    run_job = options.run_job or _default_job
    reporter = options.reporter or (lambda event: None)

    def say(kind: str, text: str = "", **data: Any) -> None:
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
    try:
        refuse_a_foreign_folder(root)  # the arms go into it: never a folder of the user's
    except RunDirRefused as exc:
        raise UserError(str(exc)) from None
    os.makedirs(root, exist_ok=True)
    say("info", f"evidence goes to {root} (the baseline's and each arm's run folders)")
    base_dir = os.path.join(root, "baseline")
    if os.path.exists(os.path.join(root, "candidate", "manifest.json")):
        raise UserError(f"{os.path.join(root, 'candidate')} already holds a run: give --fix a new --run-dir")
    reuse = _finished_baseline(base_dir, command)
    result = FixResult(root=root, status="baseline", exit_code=0, baseline=base_dir)
    if options.confine not in ("auto", "namespace", "copy"):
        raise UserError(f"unknown confinement {options.confine!r} (auto, namespace or copy)")
    confiner = fix_confine.Confiner(root, cwd, method=None if options.confine == "auto" else options.confine)
    options = dataclasses.replace(options, confine=confiner.method)
    for kind, line in confiner.notice(_runs_at_most(options, reuse)):
        say(kind, line)
    try:
        run_loop(
            command, options, record_options, cwd, confiner.wrap_runner(run_job, say), say, result, reuse
        )
    except BaseException:
        if result.status not in ("done", "nothing to apply", "baseline failed"):
            result.status = f"interrupted during {result.status}"
        raise
    finally:
        try:
            result.confinement = confiner.finish(result.best, options.keep_outputs, say)
        finally:
            write_fix_json(result.fix_json, _fix_document(command, result))
            for problem in scrub_copies(root, command, os.environ):
                say("warning", f"a copy of the job's files may still hold a secret: {problem}")
    say("info", f"fix: {root}")
    return result


def _runs_at_most(options: FixOptions, reuse: int | None) -> int:
    """How many times --fix may run the job: the baseline, each candidate (measured again with
    the baseline when not proven), the warm-up arm."""
    per_arm = 3 if options.repeat_inconclusive else 1
    return (0 if reuse is not None else 1) + options.tries * per_arm + (1 if options.warm_up_after_fix else 0)


def _fix_document(command: list[str], result: FixResult) -> dict[str, Any]:
    doc = result.to_dict()
    doc["command"] = command
    best = next((a for a in result.arms if a["dir"] == result.best), None)
    doc["candidate"] = result.best
    doc["kept"] = best
    return doc


def _finished_baseline(base_dir: str, command: list[str]) -> int | None:
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


def _default_job(command: list[str], run_dir: str, options: Any, until_diagnosed: bool = False) -> int | None:
    """(until_diagnosed: no live judgement here, the arm runs its steps.)"""

    try:
        return Job(command, run_dir, options).run()  # output to our stdout/stderr
    except CommandNotFound as exc:
        raise UserError(str(exc)) from None


def _keep(rows: list[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The fix.json row of the arm to keep (the judge's choice: ab_verdict.keep)."""
    arms = [Arm.from_row(row) for row in rows]
    kept = ab_verdict.keep(arms)
    return next((row for row, arm in zip(rows, arms) if arm is kept), None)
