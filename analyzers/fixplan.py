"""The `--fix` plan: which changes the candidate arms make, from the baseline's findings.

Judge layer (fix planning): it reads findings and the job's own files, writes no run folder and
runs nothing (traindx.cli.fixloop runs the arms).

- `plan_fixes`: one plan from every finding's first applicable prescription (the historical
  single-arm plan; still used for a `TRAINDX_FIX_MECHANISM` choice and by tests).
- `candidate_plans`: the search. Every concrete change a prescription names (an env var, a flag,
  a code edit at file:line, a runtime patch, an overlay, a kernel-cache warm-up) becomes one
  candidate plan of its own, ordered by predicted saving; the loop measures them in turn. The
  planner also derives the job's own flag where a literal would do: a keyword whose value reads
  `args.workers` becomes `--workers N`; a cost under `if step % args.save_every == 0` becomes a
  larger `--save-every`; a frequency flag of the command whose value is the finding's period is
  raised.
"""

import json
import os
import re
from dataclasses import dataclass, field, replace

from traindx.analyzers.findings import Prescription
from traindx.analyzers.fix_source import derived_edit_options
from traindx.analyzers.fix_source import job_script_files as _script_files
from traindx.analyzers.fix_source import named_sites as _sites
from traindx.analyzers.stability import LESS_OFTEN  # a periodic cost made this many times rarer
from traindx.kernel_cache.store.cache import DIR_VAR, ENABLE_VAR, default_cache_dir

# Frameworks whose flags `--fix` may rewrite; all parse `--flag value` / `--flag=value`.
# ms-swift and the HF Trainer (HfArgumentParser) accept `_` and `-` alike in flag names;
# torchtitan's `--section.key`, slime's and Megatron's dashes are matched the same way.
KNOWN_FRAMEWORKS = (
    "megatron",
    "ms-swift",
    "slime",
    "torchtitan",
    "hf",
    "hf-trainer",
    "transformers",
    "example",
    "argparse",
)
# "argparse": the job's own parser, found by reading the script (traindx.analyzers.fix_source.argparse_flags)
PYTHON_LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
# FA4's cache variables are the kernel cache's (FA4's own names)
CACHE_DIR_VAR, CACHE_ENABLE_VAR = DIR_VAR, ENABLE_VAR
RUNTIME_PATCH_VAR = "TRAINDX_RUNTIME_PATCHES"  # read by the shim (runtime_patches.py)
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
    precompile: list = field(default_factory=list)  # run folders to warm the cache from
    applied: list = field(default_factory=list)  # one line per applied prescription
    alternatives: list = field(default_factory=list)  # automatic, not applied (see the finding)
    instructions: list = field(default_factory=list)  # code changes, upgrades: by hand
    deferred: list = field(default_factory=list)  # automatic, but only after this fix
    warnings: list = field(default_factory=list)
    command_changed: bool = False
    source_edits: list = field(default_factory=list)  # resolved edits for the scratch copy
    runtime_patches: list = field(default_factory=list)  # names the shim applies (candidate only)
    overlays: list = field(default_factory=list)  # requirements installed into an overlay
    changes: list = field(default_factory=list)  # per applied prescription: mechanism, gain
    fallbacks: dict = field(default_factory=dict)  # finding id -> its next prescription

    @property
    def changes_anything(self):
        return bool(
            self.env
            or self.precompile
            or self.command_changed
            or self.source_edits
            or self.runtime_patches
            or self.overlays
        )

    def to_dict(self):
        return {
            "command": self.command,
            "env": self.env,
            "precompile": self.precompile,
            "applied": self.applied,
            "alternatives": self.alternatives,
            "instructions": self.instructions,
            "deferred": self.deferred,
            "warnings": self.warnings,
            "source_edits": self.source_edits,
            "runtime_patches": self.runtime_patches,
            "overlays": self.overlays,
            "changes": self.changes,
        }


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
    if "code" in change and p.kind in ("code", "source"):
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
    flags_set = {}  # normalized flag -> (value, finding id)
    precompiles = []  # (finding, prescription): planned once the command is known
    prefer = prefer or environ.get(PREFER_VAR) or None
    for finding in findings:
        fixes = [p for p in finding.prescriptions if p.automatic and not _is_precompile(p)]
        fixes.sort(key=lambda p: 0 if prefer and mechanism(p) == prefer else 1)  # stable
        chosen = None
        for p in fixes:
            applied = _apply(plan, finding, p, flags_set, command, cwd)
            if applied:
                chosen = p
                plan.applied.append(f"[{finding.id}] ({mechanism(p)}) {p.summary}: " + "; ".join(applied))
                plan.changes.append(
                    {
                        "finding": finding.id,
                        "mechanism": mechanism(p),
                        "summary": p.summary,
                        "predicted_saving_s_per_step": p.expected_gain_s_per_step,
                        "applied": applied,
                    }
                )
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
                plan.alternatives.append(
                    f"[{finding.id}] ({mechanism(p)}) {_instruction(finding, p)[len(finding.id) + 3 :]}"
                )
    if plan.runtime_patches:
        plan.env[RUNTIME_PATCH_VAR] = ",".join(plan.runtime_patches)
    for finding, p in precompiles:
        if plan.command_changed or plan.source_edits or plan.runtime_patches or plan.overlays:
            plan.deferred.append(
                f"[{finding.id}] after this fix: kernel-cache warm --from-run <the candidate "
                "run>, then train with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (the "
                "baseline's kernels are not the ones the changed command compiles)"
            )
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

        plan.env[CACHE_DIR_VAR] = str(default_cache_dir(environ))
    if plan.command_changed and _is_shell_script(command):
        plan.warnings.append(
            "the command is a shell script: the flags were appended to the script's arguments; "
            'they take effect only if it passes them on ("$@") to the training program'
        )
    return plan


def _apply(plan, finding, p, flags_set, command, cwd=None):
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
        codes = (p.change or {}).get("codes") or [(p.change or {}).get("code")]
        edits = [
            _source_edit(replace(p, change={"code": c}), command, plan, cwd or os.getcwd()) for c in codes
        ]
        if not edits or any(e is None for e in edits):
            return []  # edits made together apply together, or not at all
        plan.source_edits.extend({**e, "finding": finding.id} for e in edits)
        return [f"source patch {os.path.relpath(e['file'])}:{e['line']} on a scratch copy" for e in edits]
    return _apply_env(plan, finding, p) + _apply_args(plan, finding, p, flags_set)


def _source_edit(p, command, plan, cwd):
    """The concrete edit of a code prescription, checked against the file; None when there is
    none to make automatically (a sentence, a file outside the job's tree, a moved line)."""
    from traindx.analyzers import fix_source

    code = (p.change or {}).get("code") or {}
    if code.get("autotune_key"):
        spec = code["autotune_key"]
        files = [f for f in (spec.get("files") or []) if f]
        root = fix_source.tree_root(files[:1], command, cwd) if files else None
        root = root or cwd
        edit = fix_source.autotune_key_edit(
            spec.get("kernel"), spec.get("drop") or [], files + fix_source.python_files(root)
        )
        if edit is None:
            plan.warnings.append(
                f"no @triton.autotune(key=[...]) of {spec.get('kernel')} found "
                "in the job's tree: the key change is left to do by hand"
            )
            return None
        code = edit
    if (
        not code.get("file")
        or not ("before_line" in code or code.get("before"))
        or ("after_line" not in code and "after" not in code)
    ):
        return None
    code = dict(code, file=os.path.abspath(os.path.join(cwd, code["file"])))
    if fix_source.tree_root([code["file"]], command, cwd) is None:
        plan.warnings.append(
            f"{code['file']} is outside the job's tree (a library): patch it by hand or use another mechanism"
        )
        return None
    keys = ("file", "line", "last_line", "before", "after", "op", "before_line", "after_line")
    try:
        edit = fix_source.resolve_edit({k: code[k] for k in keys if k in code})
    except fix_source.PatchError as exc:
        plan.warnings.append(f"source patch not applied: {exc}")
        return None
    return edit


def _apply_env(plan, finding, p):
    applied = []
    for name, value in ((p.change or {}).get("env") or {}).items():
        if value is None:
            plan.instructions.append(f"[{finding.id}] unset {name}")
            continue
        if name in plan.env and plan.env[name] != str(value):
            plan.warnings.append(
                f"[{finding.id}] wants {name}={value}; kept "
                f"{name}={plan.env[name]} from a higher-ranked finding"
            )
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
        plan.instructions.append(
            f"[{finding.id}] {p.summary} (flags of {framework or 'an unknown framework'}: by hand)"
        )
        return []
    wanted = {}
    for flag, value in (arg.get("set") or {}).items():
        key = _flag_name(flag if flag.startswith("-") else "--" + flag)
        if key in flags_set and flags_set[key][0] != value:
            plan.warnings.append(
                f"[{finding.id}] wants {flag} {value}; kept {flags_set[key][0]} from [{flags_set[key][1]}]"
            )
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
    return [" ".join(f if v is None or v is True or v is False else f"{f} {v}" for f, v in wanted.items())]


def _is_shell_script(command):
    return any(t.endswith(".sh") for t in command[:3]) or os.path.basename(command[0]) in (
        "bash",
        "sh",
        "zsh",
    )


# -- the search: one candidate per concrete change -------------------------------------------------
FREQUENCY_FLAG = re.compile(r"interval|every|freq|period|save|ckpt|checkpoint", re.I)


def is_concrete(p: Prescription) -> bool:
    """A prescription --fix can apply by one of its mechanisms: marked automatic, or a code
    edit at a file:line of the job's own code (measured on a scratch copy, never in place)."""
    code = (p.change or {}).get("code") or {}
    return p.automatic or bool(code.get("file") and ("before" in code or "before_line" in code))


def _flags_of(files):
    from traindx.analyzers import fix_source

    flags = {}
    for path in files:
        for dest, spec in fix_source.argparse_flags(path).items():
            flags.setdefault(dest, spec)
    return flags


def _literal(text):
    import ast

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, (int, float, str, bool)) else None


def _flag_value(command, flag):
    """The value the command gives `flag` (the last occurrence), else None."""
    args = command[program_args_start(command) :]
    name, value = _flag_name(flag), None
    for i, token in enumerate(args):
        if _flag_name(token) == name:
            if "=" in token:
                value = token.split("=", 1)[1]
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
    return value


def own_flag_option(p, command, cwd):
    """A code edit whose changed keywords or arguments read the job's own flags
    (`num_workers=a.workers`, `dataloader_num_workers=args.workers`,
    `torch.set_num_threads(a.threads)`): the same setting through the job's flags
    (`--workers 4`), so the user keeps a command, not a patch. None when no changed keyword
    or argument reads a flag."""
    from traindx.analyzers import fix_source

    code = (p.change or {}).get("code") or {}
    if not code.get("file") or not code.get("before") or not code.get("after"):
        return None
    flags = _flags_of([code["file"]] + _script_files(command, cwd))
    before = fix_source.keyword_sources(code["before"])
    after = fix_source.keyword_sources(code["after"])
    wanted = {}
    for key, text in after.items():
        if key not in before or before[key] == text:
            continue
        spec = fix_source.flag_of(before[key], flags) or _command_flag_of(before[key], command)
        value = _literal(text)
        if spec and value is not None and not isinstance(value, bool):
            wanted[spec["flag"]] = str(value)
    if not wanted:
        return None
    said = " ".join(f"{k} {v}" for k, v in wanted.items())
    return Prescription(
        kind="arg",
        summary=f"{p.summary} — through the job's own flag ({said})",
        change={"arg": {"framework": "argparse", "set": wanted}},
        expected_gain_s_per_step=p.expected_gain_s_per_step,
        automatic=True,
    )


def _command_flag_of(expression, command):
    """The command-line flag a config attribute comes from, for config systems that take dotted
    overrides (`num_workers=config.num_workers` with `--trainer.num_workers=0` on the command
    line: minGPT's CfgNode, jsonargparse/LightningCLI, Hydra-style `--a.b.c`): the flag whose last
    dotted part names the attribute. None when the command has no such flag."""
    import ast

    try:
        node = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if not isinstance(node, ast.Attribute):
        return None
    wanted = node.attr.replace("_", "-")
    for token in command[program_args_start(command) :]:
        name = _flag_name(token)
        if name and name.rsplit(".", 1)[-1] == wanted:
            return {"flag": token.split("=", 1)[0], "default": None}
    return None


def less_often_options(finding, command, cwd):
    """A cost that runs every k steps, where k is the job's flag: the flag raised tenfold.
    Found two ways, both generic: the costly line sits under `if step % args.k == ...:` in the
    job's file; or a frequency flag on the command line (`--recovery-interval 2`, a framework's
    own) equals the finding's measured period."""
    from traindx.analyzers import fix_source

    lost = finding.seconds_lost_per_step
    if not lost:
        return []
    out, seen = [], set()

    def option(flag, current, why):
        try:
            current = int(current)
        except (TypeError, ValueError):
            return
        if current < 1 or flag in seen:
            return
        seen.add(flag)
        new = current * LESS_OFTEN
        out.append(
            Prescription(
                kind="arg",
                summary=f"do it {LESS_OFTEN}x less often: {flag} {new} (was {current}; {why})",
                change={"arg": {"framework": "argparse", "set": {flag: str(new)}}},
                expected_gain_s_per_step=lost * (1 - 1 / LESS_OFTEN),
                automatic=True,
            )
        )

    scripts = _script_files(command, cwd)
    sites = _sites(finding.evidence) + [
        ((p.change or {}).get("code") or {}).get("file")
        and (p.change["code"]["file"], p.change["code"].get("line"))
        for p in finding.prescriptions
    ]
    for site in sites:
        if not site or not site[0] or not isinstance(site[1], int):
            continue
        path = os.path.abspath(os.path.join(cwd, site[0]))
        if not os.path.isfile(path) or fix_source.tree_root([path], command, cwd) is None:
            continue
        spec = fix_source.periodic_flag(path, site[1], _flags_of([path] + scripts))
        if spec:
            option(
                spec["flag"],
                _flag_value(command, spec["flag"]) or spec["default"],
                f"the guard over {os.path.basename(path)}:{site[1]}",
            )
    period = (finding.evidence or {}).get("period")
    if isinstance(period, int) and period > 0:
        args = command[program_args_start(command) :]
        for i, token in enumerate(args):
            name = _flag_name(token)
            if name and FREQUENCY_FLAG.search(name):
                value = (
                    token.split("=", 1)[1] if "=" in token else (args[i + 1] if i + 1 < len(args) else None)
                )
                if value == str(period):
                    option(
                        token.split("=", 1)[0],
                        value,
                        f"the command's frequency flag equals the measured period {period}",
                    )
    return out


@dataclass
class Candidate:
    """One arm to measure: the plan of exactly one change (and its fallbacks)."""

    plan: "Plan"
    finding: str
    mechanism: str
    summary: str
    predicted_saving_s_per_step: float | None

    def to_dict(self):
        return {
            "finding": self.finding,
            "mechanism": self.mechanism,
            "summary": self.summary,
            "predicted_saving_s_per_step": self.predicted_saving_s_per_step,
            "plan": self.plan.to_dict(),
        }


def _signature(plan):
    return json.dumps(
        [
            plan.command,
            plan.env,
            [(e["file"], e["line"], e.get("after"), e.get("after_line")) for e in plan.source_edits],
            plan.runtime_patches,
            plan.overlays,
            plan.precompile,
        ],
        default=str,
    )


def candidate_plans(command, findings, baseline_path, environ=None, prefer=None, cwd=None):
    """(candidates best first, the plan of everything, for its listing): every concrete change
    of every finding as a candidate of its own, ordered by predicted saving (the finding's rank
    and the prescription's order break ties: a derived own-flag option goes before the code edit
    it comes from, which goes before the finding's alternatives)."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    prefer = prefer or environ.get(PREFER_VAR) or None
    listing = plan_fixes(command, findings, baseline_path, environ=environ, prefer=prefer, cwd=cwd)
    options = []  # (sort key, finding, [prescriptions tried in that arm])
    for rank, finding in enumerate(findings):
        fixes = [p for p in finding.prescriptions if is_concrete(p) and not _is_precompile(p)]
        fixes.sort(key=lambda p: 0 if prefer and mechanism(p) == prefer else 1)
        derived = []
        for p in fixes:
            flag = own_flag_option(p, command, cwd)
            derived += [flag, p] if flag else [p]
        derived = (
            less_often_options(finding, command, cwd) + derived_edit_options(finding, command, cwd) + derived
        )
        fallbacks = [q for q in fixes if mechanism(q) in ("runtime", "config")]
        precompile = [p for p in finding.prescriptions if _is_precompile(p)]
        for order, p in enumerate(derived):
            gain = p.expected_gain_s_per_step
            if gain is None:
                gain = finding.seconds_lost_per_step or 0.0
            rest = [q for q in fallbacks if q is not p] if mechanism(p) in ("source", "overlay") else []
            options.append(((-gain, rank, order), finding, [p] + rest, gain))
        for order, p in enumerate(precompile):
            gain = p.expected_gain_s_per_step or finding.seconds_lost_per_step or 0.0
            options.append(((-gain, rank, 100 + order), finding, [p], gain))
    options.sort(key=lambda o: o[0])
    out, seen = [], set()
    for _, finding, prescriptions, gain in options:
        single = replace(finding, prescriptions=tuple(replace(q, automatic=True) for q in prescriptions))
        plan = plan_fixes(command, [single], baseline_path, environ=environ, cwd=cwd)
        if not plan.changes_anything or not (plan.changes or plan.precompile):
            continue
        key = _signature(plan)
        if key in seen:
            continue
        seen.add(key)
        first = (
            plan.changes[0]
            if plan.changes
            else {"mechanism": "precompile", "summary": prescriptions[0].summary}
        )
        out.append(
            Candidate(
                plan=plan,
                finding=finding.id,
                mechanism=first["mechanism"],
                summary=first["summary"],
                predicted_saving_s_per_step=gain,
            )
        )
    return out, listing


def warm_up_after(kept: Candidate, kept_findings, kept_run_path: str, environ=None) -> Candidate | None:
    """The kept change with its cold start warmed away: the precompile that plan_fixes defers
    when another change rewrites what compiles, now from the kept arm's own run (its kernels are
    the ones the changed job compiles). An arm measured against the kept arm, judged by the
    first step; None when the kept arm compiled nothing a warm-up replays, or was one."""
    if kept.plan.precompile or kept.mechanism == "precompile":
        return None
    found = next(
        ((f, p) for f in kept_findings for p in f.prescriptions if p.automatic and _is_precompile(p)), None
    )
    if found is None:
        return None
    finding, p = found
    environ = os.environ if environ is None else environ
    plan = replace(
        kept.plan,
        env=dict(kept.plan.env),
        applied=list(kept.plan.applied),
        warnings=[],
        deferred=[],
        precompile=[kept_run_path],
        fallbacks=dict(kept.plan.fallbacks),
    )
    plan.env.update(
        {
            k: v
            for k, v in ((p.change or {}).get("env") or {}).items()
            if k in (CACHE_ENABLE_VAR, CACHE_DIR_VAR)
        }
    )
    plan.env.setdefault(CACHE_ENABLE_VAR, "1")
    plan.env.setdefault(CACHE_DIR_VAR, str(default_cache_dir(environ)))
    summary = (
        f"after the kept change: kernel-cache warm --from-run {kept_run_path}, then train "
        f"with {CACHE_ENABLE_VAR}=1 ({CACHE_DIR_VAR}={plan.env[CACHE_DIR_VAR]})"
    )
    gain = p.expected_gain_s_per_step or finding.seconds_lost_per_step
    plan.applied.append(f"[{finding.id}] {summary}")
    # the comparison is with the kept arm: the warm-up is the one change between them
    plan.changes = [
        {
            "finding": finding.id,
            "mechanism": "precompile",
            "summary": summary,
            "predicted_saving_s_per_step": gain,
            "applied": [f"kernel-cache warm --from-run {kept_run_path}"],
        }
    ]
    return Candidate(
        plan=plan,
        finding=finding.id,
        mechanism="precompile",
        summary=summary,
        predicted_saving_s_per_step=gain,
    )
