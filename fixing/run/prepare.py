"""What a --fix candidate arm needs before it runs: the overlay (a fixed release on its
PYTHONPATH), the scratch copy with its source patch, the kernel-cache warm-up, and the commands
a user runs to keep the change. A step that fails says why and what the arm runs instead."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from traindx.common.atomic import write_text
from traindx.fixing.plan import source as fix_source
from traindx.fixing.plan.ladder import ladder_switch
from traindx.fixing.plan.planner import RUNTIME_PATCH_VAR, Plan, mechanism
from traindx.fixing.run import overlay as fix_overlay
from traindx.fixing.run.model import Say
from traindx.fixing.run.scratch import make_scratch

WARM_TIMEOUT_S = 1800


def warm_cache(from_run: str, env: dict[str, str], say: Say, wrap: Sequence[str] = ()) -> tuple[int, str]:
    """`kernel-cache warm --from-run RUN` in a process with the candidate's environment: the
    cache only serves the exact FA4 it was written by, so it must import the FA4 the job
    imports (the job's PYTHONPATH), not traindx's own. `wrap`: the arm's private view (its
    writes to the cache are the arm's, kept like its other outputs only on request)."""
    code = "import sys; from traindx.kernel_cache.cli.main import main; sys.exit(main(sys.argv[1:]))"
    argv = [*wrap, sys.executable, "-c", code, "warm", "--from-run", from_run]
    say("step", f"precompiling: kernel-cache warm --from-run {from_run}")
    try:
        proc = subprocess.run(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=WARM_TIMEOUT_S,
        )
        rc, output = proc.returncode, proc.stdout or ""
    except subprocess.TimeoutExpired as exc:
        rc = 124
        output = _text(exc.stdout) + f"\nkernel-cache warm: timed out after {WARM_TIMEOUT_S} s"
    lines = output.rstrip().splitlines()
    for line in lines[-15:]:
        say("output", f"  {line}")
    if rc != 0 and not lines:
        output = f"kernel-cache warm exited with {rc} and printed nothing"
    return rc, output[-4000:]


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def last_lines(text: object, n: int = 4) -> str:
    lines = [line.strip() for line in str(text or "").strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])[:800] or "(no output)"


def prepare_candidate(
    plan: Plan,
    root: str,
    say: Say,
    cwd: str | None,
    out: str = "runs",
    wheels: str | None = None,
    arm: str = "candidate",
    link_big: bool = False,
) -> tuple[list[str], dict[str, str], str, dict[str, Any]]:
    """Make what the candidate needs: the overlay, the scratch copy with fix.patch (its large
    files linked only with link_big: the arm runs in a private view, confine.py). Returns
    (command, env, cwd, records); a step that fails says why and what runs instead."""
    env = dict(plan.env)
    here = cwd or os.getcwd()
    command, run_cwd = list(plan.command), here
    records: dict[str, Any] = {"steps": []}
    if plan.overlays:
        _install_overlay(plan, env, records, root, wheels, say)
    if plan.source_edits:
        patched = _patch_source(plan, env, records, root, here, (out, arm), say, link_big)
        if patched is not None:
            command, run_cwd = patched
    return command, env, run_cwd, records


def _install_overlay(
    plan: Plan, env: dict[str, str], records: dict[str, Any], root: str, wheels: str | None, say: Say
) -> None:
    """pip install the plan's fixed releases into <root>/overlay, put first on PYTHONPATH."""
    target = os.path.join(root, "overlay")
    say(
        "step",
        f"overlay: pip install --no-deps --target {target} "
        f"{' '.join(plan.overlays)}" + (f" --find-links {wheels}" if wheels else ""),
    )
    try:
        result = fix_overlay.install(target, plan.overlays, wheels=wheels)
    except fix_overlay.OverlayError as exc:
        instead = _fall_back(plan, env, "overlay")
        runs = _runs_with(plan, instead)
        msg = f"overlay install failed: {exc.line}; last lines: {last_lines(exc.tail)}; {runs}"
        plan.warnings.append(msg)
        records["steps"].append(
            {"step": "overlay", "ok": False, "error": exc.line, "output_tail": exc.tail, "instead": instead}
        )
        say("warning", msg)
        return
    env["PYTHONPATH"] = fix_overlay.candidate_pythonpath(target)
    records["overlay"] = {
        "path": target,
        "requirements": plan.overlays,
        "installed": result["installed"],
        "wheels": wheels,
    }
    records["steps"].append({"step": "overlay", "ok": True, "installed": result["installed"]})
    say("step", f"overlay: installed {result['installed']}")


def _patch_source(
    plan: Plan,
    env: dict[str, str],
    records: dict[str, Any],
    root: str,
    here: str,
    out_arm: tuple[str, str],
    say: Say,
    link_big: bool,
) -> tuple[list[str], str] | None:
    """The plan's source edits on a scratch copy of the job's tree (<arm>.patch beside it):
    (the command rebased onto the copy, the folder it runs in), None when it failed."""
    out, arm = out_arm
    files = [e["file"] for e in plan.source_edits]
    tree = fix_source.tree_root(files, plan.command, here) or ""
    scratch = os.path.join(root, "scratch", arm, os.path.basename(tree.rstrip(os.sep)) or "tree")
    try:
        if not tree:
            raise fix_source.PatchError("the patched files do not share one tree with the job")
        exclude = [root, os.path.abspath(os.path.join(here, out))]
        diff = make_scratch(tree, scratch, plan.source_edits, exclude=exclude, link_big=link_big)
        patch_path = os.path.join(root, f"{arm}.patch")
        write_text(patch_path, diff)
    except (OSError, fix_source.PatchError) as exc:
        instead = _fall_back(plan, env, "source")
        msg = f"source patch failed: {exc}; {_runs_with(plan, instead)}"
        plan.warnings.append(msg)
        records["steps"].append({"step": "source patch", "ok": False, "error": str(exc), "instead": instead})
        say("warning", msg)
        return None
    # a script runs from the copy but in the job's own folder, so its relative paths
    # (../data, ./checkpoints) mean what they meant; a module (-m) runs from the copy
    script = fix_source.runs_a_script(plan.command)
    command = fix_source.rebase_command(list(plan.command), tree, scratch, cwd=here)
    base_pp = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    if base_pp:
        env["PYTHONPATH"] = fix_source.rebase_pythonpath(base_pp, tree, scratch) or base_pp
    inside = not script and fix_source.inside(here, tree)
    cwd = os.path.join(scratch, os.path.relpath(here, tree)) if inside else here
    records["source_patch"] = {
        "tree": tree,
        "scratch": scratch,
        "patch": patch_path,
        "apply": f"cd {tree} && git apply {patch_path}",
        "edits": plan.source_edits,
    }
    records["steps"].append({"step": "source patch", "ok": True, "patch": patch_path})
    say("step", f"source patch: {patch_path} (the candidate runs from {scratch}; {tree} is not touched)")
    return command, cwd


def _fall_back(plan: Plan, env: dict[str, str], failed: str) -> str:
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
            for k, v in (p.change.get("env") or {}).items():
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


def _runs_with(plan: Plan, instead: str) -> str:
    """What the candidate runs with after a failed step, or that it is not run (run_arm: an arm
    with nothing left of its plan measures the job against itself)."""
    if plan.changes_left:
        return f"the candidate runs with {instead}"
    return "nothing else is left in its plan: the candidate is not run"


def apply_commands(plan: Plan, records: dict[str, Any], command: list[str]) -> list[str]:
    """The exact commands a user runs to keep each change (fix.json's "apply")."""
    out = []
    if records.get("source_patch"):
        out.append(records["source_patch"]["apply"])
    if records.get("overlay"):
        out.append("pip install -U " + " ".join(f"'{r}'" for r in plan.overlays))
    switches = [ladder_switch(name) for name in plan.runtime_patches]
    out.extend(
        f"# in your code: {switch} (the switch --fix flipped with {RUNTIME_PATCH_VAR}={name})"
        for name, switch in zip(plan.runtime_patches, switches)
        if switch
    )
    if plan.runtime_patches and not records.get("source_patch") and not all(switches):
        out.append(
            f"# a runtime patch proves the diagnosis; keep the fix with the source patch "
            f"or upgrade listed above ({RUNTIME_PATCH_VAR}={','.join(plan.runtime_patches)})"
        )
    out.extend(f"kernel-cache warm --from-run {shlex.quote(source)}" for source in plan.precompile)
    for name, value in plan.env.items():
        if name != RUNTIME_PATCH_VAR:
            out.append(f"export {name}={shlex.quote(str(value))}")
    if plan.command_changed:
        out.append(shlex.join(plan.command))
    return out
