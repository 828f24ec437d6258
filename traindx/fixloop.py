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

    @property
    def changes_anything(self):
        return bool(self.env or self.precompile or self.command_changed)

    def to_dict(self):
        return {"command": self.command, "env": self.env, "precompile": self.precompile,
                "applied": self.applied, "alternatives": self.alternatives,
                "instructions": self.instructions, "deferred": self.deferred,
                "warnings": self.warnings}


def _instruction(finding, p):
    text = f"[{finding.id}] {p.summary}"
    change = p.change or {}
    if "code" in change:
        c = change["code"]
        where = f"{c.get('file')}:{c.get('line')}" if c.get("file") else ""
        text += f" ({where}: `{c.get('before', '')}` → `{c.get('after', '')}`)" if where else ""
    if "upgrade" in change and not p.command:
        u = change["upgrade"]
        text += f" (pip install -U '{u.get('package')}>={u.get('min_version')}')"
    if p.command:
        text += f" — {p.command}"
    return text


def _is_precompile(p):
    return "precompile" in (p.change or {}) or p.kind == "precompile"


def plan_fixes(command, findings, baseline_path, environ=None):
    """What `--fix` will do to the command, from the baseline's ranked findings.

    A precompile step replays the kernels the baseline compiled. When another fix rewrites the
    command, the candidate compiles other kernels (e.g. an int max_seqlen gives other compile
    keys than a tensor one), so the warm-up would be wasted: it is left for after the fix, as
    an instruction naming the candidate run.
    """
    environ = os.environ if environ is None else environ
    plan = Plan(command=list(command))
    flags_set = {}      # normalized flag -> (value, finding id)
    precompiles = []    # (finding, prescription): planned once the command is known
    for finding in findings:
        automatic = [p for p in finding.prescriptions if p.automatic]
        first_fix = next((p for p in automatic if not _is_precompile(p)), None)
        for p in finding.prescriptions:
            if not p.automatic:
                plan.instructions.append(_instruction(finding, p))
            elif _is_precompile(p):
                precompiles.append((finding, p))
            elif p is not first_fix:
                plan.alternatives.append(f"[{finding.id}] {p.summary}")
            else:
                applied = _apply_env(plan, finding, p) + _apply_args(plan, finding, p, flags_set)
                if applied:
                    plan.applied.append(f"[{finding.id}] {p.summary}: " + "; ".join(applied))
    for finding, p in precompiles:
        if plan.command_changed:
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
    proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    for line in proc.stdout.splitlines()[-15:]:
        console.print(f"  {line}", markup=False, highlight=False)
    return proc.returncode, proc.stdout[-4000:]


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
    root = args.run_dir or new_run_dir(args.out)
    os.makedirs(root, exist_ok=True)
    base_dir, cand_dir = os.path.join(root, "baseline"), os.path.join(root, "candidate")
    for d in (base_dir, cand_dir):
        if os.path.exists(os.path.join(d, "manifest.json")):
            raise UserError(f"{d} already holds a run: give --fix a new --run-dir")
    fix_path = os.path.join(root, "fix.json")
    fix = {"command": command, "baseline": base_dir, "candidate": None, "plan": None,
           "comparison": None, "status": "baseline"}
    _write_json(fix_path, fix)

    # 1. baseline
    console.rule("traindx --fix: baseline arm")
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
    plan = plan_fixes(command, findings, baseline.path)
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

    precompiled = []
    if plan.precompile:
        env = dict(os.environ)
        env.update(plan.env)
        for source in plan.precompile:
            rc, output = warm_cache(source, env, console)
            precompiled.append({"from_run": source, "exit_code": rc, "output_tail": output})
            if rc != 0:
                plan.warnings.append(f"kernel-cache warm --from-run {source} exited with {rc}: "
                                     "the candidate runs with whatever the cache holds")
                console.print(f"warning: {plan.warnings[-1]}", style="yellow", markup=False)

    # 3. candidate
    console.rule("traindx --fix: candidate arm")
    os.makedirs(cand_dir)
    fix["candidate"] = cand_dir
    fix["status"] = "candidate"
    _write_json(fix_path, fix)
    cand_code = record_job(plan.command, cand_dir, options_from(args, extra_env=plan.env),
                           quiet=args.quiet)

    # 4. comparison
    from traindx.record import load_run

    candidate = load_run(cand_dir)
    deferred = [line.replace("<the candidate run>", cand_dir) for line in plan.deferred]
    change = {"applied": plan.applied, "alternatives": plan.alternatives,
              "instructions": plan.instructions + deferred, "warnings": plan.warnings,
              "precompiled": [f"kernel-cache warm --from-run {p['from_run']} (exit {p['exit_code']})"
                              for p in precompiled]}
    comparison = compare_runs(baseline, candidate, change=change)
    comparison["precompile_runs"] = precompiled
    if exit_status(cand_code) != 0:
        # a candidate that crashed (an unknown flag, a broken env) proves nothing but that
        comparison["verdict"] = (f"candidate failed (exit {exit_status(cand_code)}): the change "
                                 "does not work as applied")
    _write_json(os.path.join(cand_dir, "comparison.json"), comparison)
    candidate, cand_findings, cand_report = _analyze(cand_dir, comparison=comparison)
    print_summary(candidate, cand_findings, cand_report, console=console)
    print_comparison(comparison, console)
    fix.update(status="done", comparison=comparison)
    _write_json(fix_path, fix)
    console.print(f"fix: {root}", markup=False)
    return exit_status(cand_code)
