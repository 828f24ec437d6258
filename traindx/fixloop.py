"""`diagnose --fix`: prescribe, apply, re-measure, prove.

1. Baseline arm: the command as given, recorded and analyzed like `diagnose -- <cmd>`.
2. The plan: from every finding, its first automatic prescription (alternatives after it are
   listed, not applied: they answer the same problem) plus its automatic precompile steps.
   Applied automatically: environment changes, command-line flags of known frameworks
   (Megatron, ms-swift, slime, torchtitan, HF Trainer, the examples), `kernel-cache warm
   --from-run <baseline>` with FA4's persistent cache enabled for the candidate. Code changes
   and upgrades are printed as instructions.
3. Candidate arm: the rewritten command with the same traindx options and the same --steps.
4. The comparison (traindx.recipes.ab): printed, written to <candidate>/comparison.json and
   rendered in the candidate's report.html.

Folders: `runs/<id>/baseline/` and `runs/<id>/candidate/` (each a complete run folder), and
`runs/<id>/fix.json` (the plan and the comparison). `diagnose compare runs/<id>` re-compares.
"""
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from traindx.errors import UserError

# Frameworks whose flags `--fix` may rewrite; all parse `--flag value` / `--flag=value`.
# ms-swift and the HF Trainer (HfArgumentParser) accept `_` and `-` alike in flag names;
# torchtitan's `--section.key`, slime's and Megatron's dashes are matched the same way.
KNOWN_FRAMEWORKS = ("megatron", "ms-swift", "slime", "torchtitan", "hf", "hf-trainer",
                    "transformers", "example")
PYTHON_LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
CACHE_ENABLE_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
RUNTIME_PATCH_VAR = "TRAINDX_RUNTIME_PATCHES"   # read by the shim (runtime_patches.py)
# which mechanism to try first for every finding: config | source | runtime | overlay
# (default: each finding's own order, strongest first; --wheels DIR prefers overlay)
PREFER_VAR = "TRAINDX_FIX_MECHANISM"


# -- rewriting a command's flags ----------------------------------------------------------------
def _flag_name(token):
    """'--max_seqlen=3' -> 'max-seqlen' (normalized), None for a token that is no long flag."""
    if not token.startswith("--") or len(token) < 3:
        return None
    return token[2:].split("=", 1)[0].replace("_", "-")


def program_args_start(command):
    """Index of the first argument that belongs to the training program itself (after
    `python [-m module | script.py]`, `torchrun ... script.py`, `bash script.sh`); a launcher's
    own flags are never rewritten."""
    for i, token in enumerate(command):
        if token.endswith((".py", ".sh")) and not token.startswith("-"):
            return i + 1
        if token == "-m" and i + 1 < len(command):
            return i + 2
    return 1


def set_flags(command, flags):
    """A new command with each `--flag` set to its value: every occurrence replaced (argparse
    keeps the last), else appended. Value True: a bare switch (or `True` where the command gives
    the switch a value); False/None: the flag (and its value) removed."""
    command = list(command)
    start = program_args_start(command)
    head, args = command[:start], command[start:]
    for flag, value in flags.items():
        if not flag.startswith("-"):
            flag = "--" + flag
        name = _flag_name(flag)
        out, found, i = [], False, 0
        while i < len(args):
            token = args[i]
            if _flag_name(token) == name:
                found = True
                inline = "=" in token
                has_value = inline or (i + 1 < len(args) and not args[i + 1].startswith("--"))
                spelled = token.split("=", 1)[0]  # keep the command's own spelling
                i += 1 if inline or not has_value else 2
                if value is None or value is False:
                    continue
                if value is True:
                    out.extend([spelled, "True"] if has_value else [spelled])
                else:
                    out.append(f"{spelled}={value}" if inline else spelled)
                    if not inline:
                        out.append(str(value))
                continue
            out.append(token)
            i += 1
        if not found and value is not None and value is not False:
            out.extend([flag] if value is True else [flag, str(value)])
        args = out
    return head + args


# -- the plan -------------------------------------------------------------------------------------
@dataclass
class Plan:
    command: list
    env: dict = field(default_factory=dict)
    precompile: list = field(default_factory=list)      # run folders to warm the cache from
    applied: list = field(default_factory=list)         # one line per applied prescription
    alternatives: list = field(default_factory=list)    # automatic, not applied (see the finding)
    instructions: list = field(default_factory=list)    # code changes, upgrades: by hand
    deferred: list = field(default_factory=list)        # automatic, but only after this fix
    warnings: list = field(default_factory=list)
    command_changed: bool = False
    source_edits: list = field(default_factory=list)    # resolved edits for the scratch copy
    runtime_patches: list = field(default_factory=list)  # names the shim applies (candidate only)
    overlays: list = field(default_factory=list)        # requirements installed into an overlay
    changes: list = field(default_factory=list)         # per applied prescription: mechanism, gain
    fallbacks: dict = field(default_factory=dict)       # finding id -> its next prescription

    @property
    def changes_anything(self):
        return bool(self.env or self.precompile or self.command_changed or self.source_edits
                    or self.runtime_patches or self.overlays)

    def to_dict(self):
        return {"command": self.command, "env": self.env, "precompile": self.precompile,
                "applied": self.applied, "alternatives": self.alternatives,
                "instructions": self.instructions, "deferred": self.deferred,
                "warnings": self.warnings, "source_edits": self.source_edits,
                "runtime_patches": self.runtime_patches, "overlays": self.overlays,
                "changes": self.changes}


def _instruction(finding, p):
    text = f"[{finding.id}] {p.summary}"
    change = p.change or {}
    if "code" in change:
        c = change["code"]
        where = f"{c.get('file')}:{c.get('line')}" if c.get("file") else ""
        if where and c.get("after"):
            text += f" ({where}: `{c.get('before', '')}` → `{c.get('after')}`)"
        elif where:
            text += f" ({where})"
    if "upgrade" in change and not p.command:
        u = change["upgrade"]
        text += f" (pip install -U '{u.get('package')}>={u.get('min_version')}')"
    if p.command:
        text += f" — {p.command}"
    return text


def _is_precompile(p):
    return "precompile" in (p.change or {}) or p.kind == "precompile"


def mechanism(p):
    """How --fix applies a prescription: config (the framework's own flag / env var), source (a
    patch on a scratch copy), runtime (a shim patch at a library boundary), overlay (a fixed
    release shadowing the user's), precompile."""
    change = p.change or {}
    if _is_precompile(p):
        return "precompile"
    if "runtime" in change:
        return "runtime"
    if "upgrade" in change and p.kind == "upgrade":
        return "overlay"
    if p.kind == "code" and "code" in change:
        return "source"
    return "config"


def plan_fixes(command, findings, baseline_path, environ=None, prefer=None, cwd=None):
    """What `--fix` will do to the command, from the baseline's ranked findings.

    A precompile step replays the kernels the baseline compiled. When another fix rewrites the
    command, the candidate compiles other kernels (e.g. an int max_seqlen gives other compile
    keys than a tensor one), so the warm-up would be wasted: it is left for after the fix, as
    an instruction naming the candidate run.
    """
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    plan = Plan(command=list(command))
    flags_set = {}      # normalized flag -> (value, finding id)
    precompiles = []    # (finding, prescription): planned once the command is known
    prefer = prefer or environ.get(PREFER_VAR) or None
    for finding in findings:
        fixes = [p for p in finding.prescriptions if p.automatic and not _is_precompile(p)]
        fixes.sort(key=lambda p: 0 if prefer and mechanism(p) == prefer else 1)  # stable
        chosen = None
        for p in fixes:
            applied = _apply(plan, finding, p, flags_set, command)
            if applied:
                chosen = p
                plan.applied.append(f"[{finding.id}] ({mechanism(p)}) {p.summary}: "
                                    + "; ".join(applied))
                plan.changes.append({"finding": finding.id, "mechanism": mechanism(p),
                                     "summary": p.summary,
                                     "predicted_saving_s_per_step": p.expected_gain_s_per_step,
                                     "applied": applied})
                rest = [q for q in fixes if q is not p and mechanism(q) in ("runtime", "config")]
                if rest and mechanism(p) in ("overlay", "source"):
                    plan.fallbacks[finding.id] = rest[0]
                break
        for p in finding.prescriptions:
            if not p.automatic:
                plan.instructions.append(_instruction(finding, p))
            elif _is_precompile(p):
                precompiles.append((finding, p))
            elif p is not chosen:
                plan.alternatives.append(f"[{finding.id}] ({mechanism(p)}) {_instruction(finding, p)[len(finding.id) + 3:]}")
    if plan.runtime_patches:
        plan.env[RUNTIME_PATCH_VAR] = ",".join(plan.runtime_patches)
    for finding, p in precompiles:
        if plan.command_changed or plan.source_edits or plan.runtime_patches or plan.overlays:
            plan.deferred.append(
                f"[{finding.id}] after this fix: kernel-cache warm --from-run <the candidate "
                "run>, then train with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (the "
                "baseline's kernels are not the ones the changed command compiles)")
            continue
        applied = _apply_env(plan, finding, p)
        source = ((p.change or {}).get("precompile") or {}).get("from_run") or baseline_path
        if source not in plan.precompile:
            plan.precompile.append(source)
        plan.env.setdefault(CACHE_ENABLE_VAR, "1")
        applied.append(f"kernel-cache warm --from-run {source}")
        plan.applied.append(f"[{finding.id}] {p.summary}: " + "; ".join(applied))
    if plan.precompile and CACHE_DIR_VAR not in plan.env:
        # explicit, so the warm-up and the candidate agree and the card records it
        from traindx.kernel_cache.store import default_cache_dir

        plan.env[CACHE_DIR_VAR] = str(default_cache_dir(environ))
    if plan.command_changed and _is_shell_script(command):
        plan.warnings.append(
            "the command is a shell script: the flags were appended to the script's arguments; "
            "they take effect only if it passes them on (\"$@\") to the training program")
    return plan


def _apply(plan, finding, p, flags_set, command):
    """Apply one prescription to the plan by its mechanism; [] when it cannot be applied here
    (the next one of the finding is tried)."""
    kind = mechanism(p)
    change = p.change or {}
    if kind == "runtime":
        name = change["runtime"].get("patch")
        if name and name not in plan.runtime_patches:
            plan.runtime_patches.append(name)
        return [f"{RUNTIME_PATCH_VAR}={name} (shim patch, candidate only)"] if name else []
    if kind == "overlay":
        u = change["upgrade"]
        req = f"{u.get('package')}>={u.get('min_version')}" if u.get("min_version") else u.get("package")
        if req not in plan.overlays:
            plan.overlays.append(req)
        return [f"overlay install {req} (candidate's PYTHONPATH only)"]
    if kind == "source":
        edit = _source_edit(p, command, plan)
        if edit is None:
            return []
        plan.source_edits.append({**edit, "finding": finding.id})
        return [f"source patch {os.path.relpath(edit['file'])}:{edit['line']} on a scratch copy"]
    return _apply_env(plan, finding, p) + _apply_args(plan, finding, p, flags_set)


def _source_edit(p, command, plan):
    """The concrete edit of a code prescription, checked against the file; None when there is
    none to make automatically (a sentence, a file outside the job's tree, a moved line)."""
    from traindx import fix_source

    code = (p.change or {}).get("code") or {}
    if code.get("autotune_key"):
        spec = code["autotune_key"]
        files = [f for f in (spec.get("files") or []) if f]
        root = fix_source.tree_root(files[:1], command, os.getcwd()) if files else None
        root = root or os.getcwd()
        edit = fix_source.autotune_key_edit(spec.get("kernel"), spec.get("drop") or [],
                                            files + fix_source.python_files(root))
        if edit is None:
            plan.warnings.append(f"no @triton.autotune(key=[...]) of {spec.get('kernel')} found "
                                 "in the job's tree: the key change is left to do by hand")
            return None
        code = edit
    if not code.get("file") or not code.get("after_line") or not code.get("before_line"):
        return None
    try:
        edit = fix_source.resolve_edit({"file": code["file"], "line": code.get("line"),
                                        "before_line": code["before_line"],
                                        "after_line": code["after_line"]})
    except fix_source.PatchError as exc:
        plan.warnings.append(f"source patch not applied: {exc}")
        return None
    if fix_source.tree_root([edit["file"]], command, os.getcwd()) is None:
        plan.warnings.append(f"{edit['file']} is outside the job's tree (a library): patch it by "
                             "hand or use another mechanism")
        return None
    return edit


def _apply_env(plan, finding, p):
    applied = []
    for name, value in ((p.change or {}).get("env") or {}).items():
        if value is None:
            plan.instructions.append(f"[{finding.id}] unset {name}")
            continue
        if name in plan.env and plan.env[name] != str(value):
            plan.warnings.append(f"[{finding.id}] wants {name}={value}; kept "
                                 f"{name}={plan.env[name]} from a higher-ranked finding")
            continue
        plan.env[name] = str(value)
        applied.append(f"{name}={value}")
    return applied


def _apply_args(plan, finding, p, flags_set):
    arg = (p.change or {}).get("arg")
    if not arg:
        return []
    framework = str(arg.get("framework", "")).lower()
    if framework not in KNOWN_FRAMEWORKS:
        plan.instructions.append(f"[{finding.id}] {p.summary} (flags of "
                                 f"{framework or 'an unknown framework'}: by hand)")
        return []
    wanted = {}
    for flag, value in (arg.get("set") or {}).items():
        key = _flag_name(flag if flag.startswith("-") else "--" + flag)
        if key in flags_set and flags_set[key][0] != value:
            plan.warnings.append(f"[{finding.id}] wants {flag} {value}; kept "
                                 f"{flags_set[key][0]} from [{flags_set[key][1]}]")
            continue
        flags_set[key] = (value, finding.id)
        wanted[flag] = value
    for flag in arg.get("remove") or ():
        wanted[flag] = None
    new = set_flags(plan.command, wanted)
    if new == plan.command:
        return []
    plan.command = new
    plan.command_changed = True
    return [" ".join(f if v is None or v is True or v is False else f"{f} {v}"
                     for f, v in wanted.items())]


def _is_shell_script(command):
    return any(t.endswith(".sh") for t in command[:3]) or os.path.basename(command[0]) in (
        "bash", "sh", "zsh")


# -- precompile -----------------------------------------------------------------------------------
def warm_cache(from_run, env, console):
    """`kernel-cache warm --from-run RUN` in a process with the candidate's environment: the
    cache only serves the exact FA4 it was written by, so it must import the FA4 the job
    imports (the job's PYTHONPATH), not traindx's own."""
    code = ("import sys; from traindx.kernel_cache.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    argv = [sys.executable, "-c", code, "warm", "--from-run", from_run]
    console.print(f"precompiling: kernel-cache warm --from-run {from_run}", markup=False)
    try:
        proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
        code, output = proc.returncode, proc.stdout or ""
    except subprocess.TimeoutExpired as exc:
        code, output = 124, (exc.stdout or "") + "\nkernel-cache warm: timed out after 1800 s"
    lines = output.rstrip().splitlines()
    for line in lines[-15:]:
        console.print(f"  {line}", markup=False, highlight=False)
    if code != 0 and not lines:
        output = f"kernel-cache warm exited with {code} and printed nothing"
    return code, output[-4000:]


def last_lines(text, n=4):
    lines = [l.strip() for l in str(text or "").strip().splitlines() if l.strip()]
    return " | ".join(lines[-n:])[:800] or "(no output)"


# -- the candidate's mechanisms ----------------------------------------------------------------------
def prepare_candidate(plan, root, args, console):
    """Make what the candidate needs: the overlay, the scratch copy with fix.patch. Returns
    (command, env, cwd, records); a step that fails says why and what runs instead."""
    from traindx import fix_overlay, fix_source

    env = dict(plan.env)
    command, cwd, records = list(plan.command), os.getcwd(), {"steps": []}
    if plan.overlays:
        target = os.path.join(root, "overlay")
        wheels = getattr(args, "wheels", None)
        console.print(f"overlay: pip install --no-deps --target {target} "
                      f"{' '.join(plan.overlays)}" + (f" --find-links {wheels}" if wheels else ""),
                      markup=False)
        try:
            result = fix_overlay.install(target, plan.overlays, wheels=wheels)
            env["PYTHONPATH"] = fix_overlay.candidate_pythonpath(target)
            records["overlay"] = {"path": target, "requirements": plan.overlays,
                                  "installed": result["installed"], "wheels": wheels}
            records["steps"].append({"step": "overlay", "ok": True,
                                     "installed": result["installed"]})
            console.print(f"overlay: installed {result['installed']}", markup=False)
        except fix_overlay.OverlayError as exc:
            instead = _fall_back(plan, env, "overlay")
            msg = (f"overlay install failed: {exc.line}; last lines: {last_lines(exc.tail)}; "
                   f"the candidate runs with {instead}")
            plan.warnings.append(msg)
            records["steps"].append({"step": "overlay", "ok": False, "error": exc.line,
                                     "output_tail": exc.tail, "instead": instead})
            console.print(f"warning: {msg}", style="yellow", markup=False)
    if plan.source_edits:
        files = [e["file"] for e in plan.source_edits]
        tree = fix_source.tree_root(files, plan.command, cwd) or ""
        scratch = os.path.join(root, "scratch", os.path.basename(tree.rstrip(os.sep)) or "tree")
        try:
            if not tree:
                raise fix_source.PatchError("the patched files do not share one tree with the job")
            diff = fix_source.make_scratch(tree, scratch, plan.source_edits,
                                           exclude=[root, os.path.abspath(args.out)])
            patch_path = os.path.join(root, "fix.patch")
            with open(patch_path, "w", encoding="utf-8") as f:
                f.write(diff)
            command = fix_source.rebase_command(command, tree, scratch)
            base_pp = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
            if base_pp:
                env["PYTHONPATH"] = fix_source.rebase_pythonpath(base_pp, tree, scratch)
            cwd = os.path.join(scratch, os.path.relpath(os.getcwd(), tree)) \
                if fix_source._inside(os.getcwd(), tree) else os.getcwd()
            records["source_patch"] = {"tree": tree, "scratch": scratch, "patch": patch_path,
                                       "apply": f"cd {tree} && git apply {patch_path}",
                                       "edits": plan.source_edits}
            records["steps"].append({"step": "source patch", "ok": True, "patch": patch_path})
            console.print(f"source patch: {patch_path} (the candidate runs from {scratch}; "
                          f"{tree} is not touched)", markup=False)
        except (OSError, fix_source.PatchError) as exc:
            instead = _fall_back(plan, env, "source")
            msg = (f"source patch failed: {exc}; the candidate runs with {instead}")
            plan.warnings.append(msg)
            records["steps"].append({"step": "source patch", "ok": False, "error": str(exc),
                                     "instead": instead})
            console.print(f"warning: {msg}", style="yellow", markup=False)
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
        plan.changes.append({"finding": change["finding"], "mechanism": mechanism(p),
                             "summary": p.summary, "instead_of": failed,
                             "predicted_saving_s_per_step": p.expected_gain_s_per_step})
    return ", ".join(used) if used else f"no {failed} change (the rest of the plan only)"


def apply_commands(plan, records, command):
    """The exact commands a user runs to keep each change (fix.json's "apply")."""
    out = []
    if records.get("source_patch"):
        out.append(records["source_patch"]["apply"])
    if records.get("overlay"):
        out.append("pip install -U " + " ".join(f"'{r}'" for r in plan.overlays))
    if plan.runtime_patches and not records.get("source_patch"):
        out.append(f"# a runtime patch proves the diagnosis; keep the fix with the source patch "
                   f"or upgrade listed above ({RUNTIME_PATCH_VAR}={','.join(plan.runtime_patches)})")
    for name, value in plan.env.items():
        if name != RUNTIME_PATCH_VAR:
            out.append(f"export {name}={shlex.quote(str(value))}")
    if plan.command_changed:
        out.append(shlex.join(plan.command))
    return out


# -- the loop -------------------------------------------------------------------------------------
def _analyze(run_dir, comparison=None):
    """Load, analyze, write findings.json and report.html (with the comparison, if any)."""
    from traindx.outputs import analyze_and_write
    from traindx.record import load_run

    record = load_run(run_dir)
    try:
        findings, report_path = analyze_and_write(record)
    except UserError:
        raise
    except Exception as exc:  # a broken report must not stop the loop: the findings decide
        from traindx.analyzers import analyze
        from traindx.outputs import write_findings

        print(f"diagnose: internal error writing the report of {run_dir}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
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
                print(f"diagnose: internal error drawing the comparison into the report: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
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
            lines = [l.split(" ", 2)[2].rstrip() for l in f if l.split(" ", 2)[1:2] == ["e"]
                     and len(l.split(" ", 2)) == 3]
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
        raise UserError(f"{base_dir} already holds a run of another command (or an unfinished "
                        "one): give --fix a new --run-dir")
    return int(manifest.get("exit_code") or 0)


def _mean_steady_step(run):
    from traindx.ledger import steady_rows

    led = steady_rows(run)
    return float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None


def attribute_changes(changes, comparison, baseline=None, findings=(), candidate=None):
    """Per applied change: the predicted step time (from the baseline's time ledger: the mean
    steady step minus the ledger lines the fix removes; the prescription's expected gain where
    the finding names no ledger line) and the measured one. With several changes in one
    candidate the measured figure is their joint effect: said so, not split by guess."""
    from traindx.ledger import predicted_step_time

    base = (comparison.get("baseline") or {}).get("median_step_s")
    cand = (comparison.get("candidate") or {}).get("median_step_s")
    by_id = {f.id: f for f in findings}
    live = [c for c in changes if not c.get("failed")]
    out = []
    for c in changes:
        gain = c.get("predicted_saving_s_per_step")
        row = dict(c)
        row["predicted_step_time_s"] = (max(base - gain, 0.0) if base is not None and gain
                                        else None)
        finding = by_id.get(c.get("finding"))
        if baseline is not None and finding is not None:
            try:
                pred = predicted_step_time(baseline, finding)
            except Exception as exc:  # a prediction must never cost the comparison
                pred = {"method": f"no ledger prediction: {type(exc).__name__}: {exc}"}
            row["ledger_prediction"] = pred
            if pred.get("predicted_step_s") is not None:
                row["predicted_step_time_s"] = pred["predicted_step_s"]
                row["predicted_saving_s_per_step"] = pred.get("removed_s")
                # the prediction is a mean steady step: measured the same way on the candidate
                if candidate is not None and not c.get("failed"):
                    row["measured_mean_step_s"] = _mean_steady_step(candidate)
        row["measured_step_time_s"] = cand if not c.get("failed") else None
        row["measured_saving_s_per_step"] = (base - cand if base is not None and cand is not None
                                             and not c.get("failed") else None)
        row["measured_jointly_with"] = [o["finding"] for o in live if o is not c] \
            if not c.get("failed") else []
        out.append(row)
    return out


def run_fix_loop(command, args):
    from rich.console import Console

    from traindx.commands.compare import print_comparison
    from traindx.commands.run import options_from, record_job
    from traindx.profiler.launcher import CommandNotFound, exit_status, new_run_dir, resolve_command
    from traindx.recipes.ab import compare_runs
    from traindx.report.terminal import print_summary

    console = Console(file=sys.stderr)
    try:
        resolve_command(command)
    except CommandNotFound as exc:
        raise UserError(str(exc)) from None
    root = os.path.abspath(args.run_dir or new_run_dir(args.out))
    os.makedirs(root, exist_ok=True)
    base_dir, cand_dir = os.path.join(root, "baseline"), os.path.join(root, "candidate")
    if os.path.exists(os.path.join(cand_dir, "manifest.json")):
        raise UserError(f"{cand_dir} already holds a run: give --fix a new --run-dir")
    reuse = _finished_baseline(base_dir, command)
    fix_path = os.path.join(root, "fix.json")
    fix = {"command": command, "baseline": base_dir, "candidate": None, "plan": None,
           "comparison": None, "status": "baseline"}
    _write_json(fix_path, fix)

    # 1. baseline (a finished baseline of the same command in --run-dir is measured once only:
    # another mechanism can be proved against it)
    console.rule("traindx --fix: baseline arm")
    if reuse is not None:
        console.print(f"baseline: reusing the finished run in {base_dir}", markup=False)
        code = reuse
    else:
        os.makedirs(base_dir)
        code = record_job(command, base_dir, options_from(args), quiet=args.quiet)
    baseline, findings, report = _analyze(base_dir)
    print_summary(baseline, findings, report, console=console)
    if exit_status(code) != 0:
        fix["status"] = "baseline failed"
        _write_json(fix_path, fix)
        console.print(f"the baseline arm exited with {exit_status(code)}: no candidate run "
                      "(a fix is measured against a baseline that ran)", markup=False)
        return exit_status(code)

    # 2. the plan
    prefer = "overlay" if getattr(args, "wheels", None) else None
    plan = plan_fixes(command, findings, baseline.path, prefer=prefer)
    fix["plan"] = plan.to_dict()
    _write_json(fix_path, fix)
    console.rule("traindx --fix: prescriptions")
    for line in plan.applied:
        console.print(f"apply: {line}", markup=False)
    for line in plan.alternatives:
        console.print(f"alternative (not applied): {line}", markup=False)
    for line in plan.instructions:
        console.print(f"by hand: {line}", markup=False)
    for line in plan.deferred:
        console.print(f"later: {line}", markup=False)
    for line in plan.warnings:
        console.print(f"warning: {line}", style="yellow", markup=False)
    if not plan.changes_anything:
        fix["status"] = "nothing to apply"
        _write_json(fix_path, fix)
        console.print("nothing to apply automatically: no candidate run", markup=False)
        return exit_status(code)
    if plan.command_changed:
        console.print(f"candidate command: {shlex.join(plan.command)}", markup=False)
    for name, value in plan.env.items():
        console.print(f"candidate env: {name}={value}", markup=False)

    cand_command, cand_env, cand_cwd, records = prepare_candidate(plan, root, args, console)
    precompiled = []
    if plan.precompile:
        env = dict(os.environ)
        env.update(cand_env)
        for source in plan.precompile:
            rc, output = warm_cache(source, env, console)
            precompiled.append({"from_run": source, "exit_code": rc, "output_tail": output})
            if rc != 0:
                plan.warnings.append(f"kernel-cache warm --from-run {source} exited with {rc}: "
                                     f"{last_lines(output)}; the candidate runs with whatever "
                                     "the cache holds (FA4 compiles what is missing)")
                console.print(f"warning: {plan.warnings[-1]}", style="yellow", markup=False)
    fix["apply"] = apply_commands(plan, records, command)
    fix["mechanisms"] = records
    fix["plan"] = plan.to_dict()

    # 3. candidate
    console.rule("traindx --fix: candidate arm")
    os.makedirs(cand_dir)
    fix["candidate"] = cand_dir
    fix["status"] = "candidate"
    _write_json(fix_path, fix)
    here = os.getcwd()
    os.chdir(cand_cwd)   # a source patch: the candidate runs from the scratch copy
    try:
        cand_code = record_job(cand_command, cand_dir, options_from(args, extra_env=cand_env),
                               quiet=args.quiet)
    finally:
        os.chdir(here)

    # 4. comparison
    from traindx.record import load_run

    candidate = load_run(cand_dir)
    deferred = [line.replace("<the candidate run>", cand_dir) for line in plan.deferred]
    change = {"applied": plan.applied, "alternatives": plan.alternatives,
              "instructions": plan.instructions + deferred, "warnings": plan.warnings,
              "precompiled": [f"kernel-cache warm --from-run {p['from_run']} (exit {p['exit_code']})"
                              for p in precompiled]}
    change["steps"] = records["steps"] + [
        {"step": "kernel-cache warm", "ok": p["exit_code"] == 0, "from_run": p["from_run"],
         "error": None if p["exit_code"] == 0 else last_lines(p["output_tail"])}
        for p in precompiled]
    change["apply"] = fix["apply"]
    comparison = compare_runs(baseline, candidate, change=change)
    comparison["precompile_runs"] = precompiled
    comparison["changes"] = attribute_changes(plan.changes, comparison, baseline, findings, candidate)
    if records.get("source_patch"):
        comparison["fix_patch"] = records["source_patch"]["patch"]
    if records.get("overlay"):
        comparison["overlay"] = records["overlay"]
    if exit_status(cand_code) != 0:
        # a candidate that crashed (an unknown flag, a broken env) proves nothing but that
        comparison["verdict"] = (f"candidate failed (exit {exit_status(cand_code)}): the change "
                                 "does not work as applied")
        tail = _stderr_tail(cand_dir)
        if tail:
            comparison["problems"].append(f"the candidate's last error lines: {tail}")
        if any(c["mechanism"] == "source" for c in plan.changes) and plan.fallbacks:
            comparison["problems"].append(
                f"the source patch changed what the job's code expects downstream; prove the "
                f"diagnosis without it: {PREFER_VAR}=runtime diagnose --fix --run-dir {root} "
                "(the baseline is reused), then adapt fix.patch")
    _write_json(os.path.join(cand_dir, "comparison.json"), comparison)
    candidate, cand_findings, cand_report = _analyze(cand_dir, comparison=comparison)
    print_summary(candidate, cand_findings, cand_report, console=console)
    print_comparison(comparison, console)
    fix.update(status="done", comparison=comparison)
    _write_json(fix_path, fix)
    console.print(f"fix: {root}", markup=False)
    return exit_status(cand_code)
