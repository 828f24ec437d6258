"""The `--fix` plan: which changes the candidate arms make, from the baseline's findings.

Judge layer (fix planning): it reads findings and the job's own files, writes no run folder and
runs nothing (traindx.fixing.run.loop runs the arms).

- `plan_fixes`: one plan from every finding's first applicable prescription (the historical
  single-arm plan; still used for a `TRAINDX_FIX_MECHANISM` choice and by tests).
- `candidate_plans`: the search. Every concrete change a prescription names (an env var, a flag,
  a code edit at file:line, a runtime patch, an overlay, a kernel-cache warm-up) becomes one
  candidate plan of its own, ordered by predicted saving; the loop measures them in turn. The
  planner also derives the job's own flag where a literal would do (traindx.fixing.plan.options).

A prescription's change is typed (traindx.analyzers.core.findings.Change): the plan dispatches on its
type; a change of no known type is refused (UnknownChange).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from traindx.analyzers.codefix.flags import (
    KNOWN_FRAMEWORKS,
    PYTHON_LAUNCHERS,
    flag_name,
    is_shell_script,
    program_args_start,
    set_flags,
)
from traindx.analyzers.core.findings import (
    CHANGE_TYPES,
    ArgChange,
    CacheWarm,
    EnvChange,
    EnvValue,
    Finding,
    FlagValue,
    PackageVersion,
    Prescription,
    RuntimePatch,
    SourceEdit,
    UnknownChange,
)
from traindx.fixing.plan import source as fix_source
from traindx.fixing.plan.derived import derived_edit_options
from traindx.fixing.plan.ladder import plan_ladder
from traindx.fixing.plan.ladder import wants as ladder_wants
from traindx.fixing.plan.options import is_concrete, less_often_options, own_flag_option
from traindx.kernel_cache.store.cache import DIR_VAR, ENABLE_VAR, default_cache_dir

# the names read here by other modules (some defined in the modules imported above)
__all__ = [
    "CACHE_DIR_VAR",
    "CACHE_ENABLE_VAR",
    "Candidate",
    "KNOWN_FRAMEWORKS",
    "PREFER_VAR",
    "PYTHON_LAUNCHERS",
    "Plan",
    "RUNTIME_PATCH_VAR",
    "candidate_plans",
    "flag_name",
    "is_concrete",
    "is_precompile",
    "is_shell_script",
    "ladder_wants",
    "less_often_options",
    "mechanism",
    "own_flag_option",
    "plan_fixes",
    "program_args_start",
    "set_flags",
    "warm_up_after",
]

# FA4's cache variables are the kernel cache's (FA4's own names)
CACHE_DIR_VAR, CACHE_ENABLE_VAR = DIR_VAR, ENABLE_VAR
RUNTIME_PATCH_VAR = "TRAINDX_RUNTIME_PATCHES"  # read by the shim (runtime_patches.py)
# which mechanism to try first for every finding: config | source | runtime | overlay
# (default: each finding's own order, strongest first; --wheels DIR prefers overlay)
PREFER_VAR = "TRAINDX_FIX_MECHANISM"
# (flag, finding id) that set each normalized flag: a lower-ranked finding keeps off it
FlagsSet = dict[str | None, tuple[FlagValue, str]]


# -- the plan -------------------------------------------------------------------------------------
@dataclass
class Plan:
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    precompile: list[str] = field(default_factory=list)  # run folders to warm the cache from
    applied: list[str] = field(default_factory=list)  # one line per applied prescription
    alternatives: list[str] = field(default_factory=list)  # automatic, not applied (see the finding)
    instructions: list[str] = field(default_factory=list)  # code changes, upgrades: by hand
    deferred: list[str] = field(default_factory=list)  # automatic, but only after this fix
    warnings: list[str] = field(default_factory=list)
    command_changed: bool = False
    source_edits: list[dict[str, Any]] = field(default_factory=list)  # resolved edits, scratch copy
    runtime_patches: list[str] = field(default_factory=list)  # names the shim applies (candidate only)
    overlays: list[str] = field(default_factory=list)  # requirements installed into an overlay
    changes: list[dict[str, Any]] = field(default_factory=list)  # per applied prescription
    ladder: list[dict[str, Any]] = field(default_factory=list)  # rungs weighed (fixing/plan/ladder.py)
    fallbacks: dict[str, Prescription] = field(default_factory=dict)  # finding id -> next one

    @property
    def changes_anything(self) -> bool:
        return bool(
            self.env
            or self.precompile
            or self.command_changed
            or self.source_edits
            or self.runtime_patches
            or self.overlays
        )

    @property
    def changes_left(self) -> bool:
        """Whether the arm still changes anything once the steps that failed to apply (a source
        patch, an overlay: prepare marks their rows failed, and adds a fallback's) are dropped."""
        live = any(not c.get("failed") for c in self.changes)
        return live or bool(self.env or self.precompile or self.command_changed or self.runtime_patches)

    def to_dict(self) -> dict[str, Any]:
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
            "ladder": self.ladder,
        }


def _known(p: Prescription) -> None:
    """Refuse a change of no known kind (built around Prescription's checks)."""
    if not isinstance(p.change, CHANGE_TYPES):
        raise UnknownChange(
            f"--fix cannot plan the change {p.change!r} of {p.summary!r}: its type "
            f"{type(p.change).__name__} is none of the change kinds (traindx.analyzers.core.findings.Change)"
        )


def _env_of(p: Prescription) -> Mapping[str, EnvValue]:
    """The environment variables a change sets: an env change's, a warm-up's cache variables."""
    change = p.change
    if isinstance(change, (EnvChange, CacheWarm)):
        return change.env or {}
    return {}


def _instruction(finding: Finding, p: Prescription) -> str:
    text = f"[{finding.id}] {p.summary}"
    change = p.change
    if isinstance(change, SourceEdit) and change.code is not None:
        c = change.code
        where = f"{c.get('file')}:{c.get('line')}" if c.get("file") else ""
        if where and c.get("after"):
            text += f" ({where}: `{c.get('before', '')}` → `{c.get('after')}`)"
        elif where:
            text += f" ({where})"
    if isinstance(change, PackageVersion) and not p.command:
        text += f" (pip install -U '{change.package}>={change.min_version}')"
    if p.command:
        text += f" — {p.command}"
    return text


def is_precompile(p: Prescription) -> bool:
    return isinstance(p.change, CacheWarm) or p.kind == "precompile"


def mechanism(p: Prescription) -> str:
    """How --fix applies a prescription: config (the framework's own flag / env var), source (a
    patch on a scratch copy), runtime (a shim patch at a library boundary), overlay (a fixed
    release shadowing the user's), precompile."""
    _known(p)
    change = p.change
    if is_precompile(p):
        return "precompile"
    if isinstance(change, RuntimePatch):
        return "runtime"
    if isinstance(change, PackageVersion) and p.kind == "upgrade":
        return "overlay"
    if isinstance(change, SourceEdit) and change.code is not None and p.kind in ("code", "source"):
        return "source"
    return "config"


def _change_row(finding: Finding, p: Prescription, applied: list[str]) -> dict[str, Any]:
    return {
        "finding": finding.id,
        "mechanism": mechanism(p),
        "summary": p.summary,
        "predicted_saving_s_per_step": p.expected_gain_s_per_step,
        "applied": applied,
    }


def _plan_finding(
    plan: Plan, finding: Finding, prefer: str | None, flags_set: FlagsSet, command: Sequence[str], cwd: str
) -> list[Prescription]:
    """Apply the finding's first applicable automatic prescription; list the others. Returns its
    warm-ups, planned once the command is known."""
    fixes = [p for p in finding.prescriptions if p.automatic and not is_precompile(p)]
    fixes.sort(key=lambda p: 0 if prefer and mechanism(p) == prefer else 1)  # stable
    chosen = None
    for p in fixes:
        applied = _apply(plan, finding, p, flags_set, command, cwd)
        if applied:
            chosen = p
            plan.applied.append(f"[{finding.id}] ({mechanism(p)}) {p.summary}: " + "; ".join(applied))
            plan.changes.append(_change_row(finding, p, applied))
            rest = [q for q in fixes if q is not p and mechanism(q) in ("runtime", "config")]
            if rest and mechanism(p) in ("overlay", "source"):
                plan.fallbacks[finding.id] = rest[0]
            break
    precompiles = []
    for p in finding.prescriptions:
        if not p.automatic:
            plan.instructions.append(_instruction(finding, p))
        elif is_precompile(p):
            precompiles.append(p)
        elif p is not chosen:
            plan.alternatives.append(
                f"[{finding.id}] ({mechanism(p)}) {_instruction(finding, p)[len(finding.id) + 3 :]}"
            )
    return precompiles


def _plan_precompile(plan: Plan, finding: Finding, p: Prescription, baseline_path: str) -> None:
    if plan.command_changed or plan.source_edits or plan.runtime_patches or plan.overlays:
        plan.deferred.append(
            f"[{finding.id}] after this fix: kernel-cache warm --from-run <the candidate "
            "run>, then train with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 (the "
            "baseline's kernels are not the ones the changed command compiles)"
        )
        return
    applied = _apply_env(plan, finding, p)
    source = (p.change.from_run if isinstance(p.change, CacheWarm) else None) or baseline_path
    if source not in plan.precompile:
        plan.precompile.append(source)
    plan.env.setdefault(CACHE_ENABLE_VAR, "1")
    applied.append(f"kernel-cache warm --from-run {source}")
    plan.applied.append(f"[{finding.id}] {p.summary}: " + "; ".join(applied))


def plan_fixes(
    command: Sequence[str],
    findings: Sequence[Finding],
    baseline_path: str,
    environ: Mapping[str, str] | None = None,
    prefer: str | None = None,
    cwd: str | None = None,
) -> Plan:
    """What `--fix` will do to the command, from the baseline's ranked findings.

    A precompile step replays the kernels the baseline compiled. When another fix rewrites the
    command, the candidate compiles other kernels (e.g. an int max_seqlen gives other compile
    keys than a tensor one), so the warm-up would be wasted: it is left for after the fix, as
    an instruction naming the candidate run.
    """
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    plan = Plan(command=list(command))
    flags_set: FlagsSet = {}
    precompiles = []  # (finding, prescription): planned once the command is known
    prefer = prefer or environ.get(PREFER_VAR) or None
    for finding in findings:
        precompiles += [(finding, p) for p in _plan_finding(plan, finding, prefer, flags_set, command, cwd)]
    if plan.runtime_patches:
        plan.env[RUNTIME_PATCH_VAR] = ",".join(plan.runtime_patches)
    for finding, p in precompiles:
        _plan_precompile(plan, finding, p, baseline_path)
    if plan.precompile and CACHE_DIR_VAR not in plan.env:
        # explicit, so the warm-up and the candidate agree and the card records it
        plan.env[CACHE_DIR_VAR] = str(default_cache_dir(environ))
    if plan.command_changed and is_shell_script(command):
        plan.warnings.append(
            "the command is a shell script: the flags were appended to the script's arguments; "
            'they take effect only if it passes them on ("$@") to the training program'
        )
    return plan


def _apply(
    plan: Plan,
    finding: Finding,
    p: Prescription,
    flags_set: FlagsSet,
    command: Sequence[str],
    cwd: str | None = None,
) -> list[str]:
    """Apply one prescription to the plan by its mechanism; [] when it cannot be applied here
    (the next one of the finding is tried)."""
    kind = mechanism(p)
    change = p.change
    if kind == "runtime" and isinstance(change, RuntimePatch):
        name = change.patch
        if name and name not in plan.runtime_patches:
            plan.runtime_patches.append(name)
        return [f"{RUNTIME_PATCH_VAR}={name} (shim patch, candidate only)"] if name else []
    if kind == "overlay" and isinstance(change, PackageVersion):
        req = change.requirement
        if req not in plan.overlays:
            plan.overlays.append(req)
        return [f"overlay install {req} (candidate's PYTHONPATH only)"]
    if kind == "source" and isinstance(change, SourceEdit):
        found = [_source_edit(code, command, plan, cwd or os.getcwd()) for code in change.edits]
        edits = [e for e in found if e is not None]
        if not edits or len(edits) < len(found):
            return []  # edits made together apply together, or not at all
        plan.source_edits.extend({**e, "finding": finding.id} for e in edits)
        return [f"source patch {os.path.relpath(e['file'])}:{e['line']} on a scratch copy" for e in edits]
    return _apply_env(plan, finding, p) + _apply_args(plan, finding, p, flags_set)


def _autotune_key_code(
    spec: Mapping[str, Any], command: Sequence[str], plan: Plan, cwd: str
) -> dict[str, Any] | None:
    """The edit of `@triton.autotune(key=[...])` an autotune-key change names, found in the
    job's tree; None (with a warning) when it is not there."""
    files = [f for f in (spec.get("files") or []) if f]
    root = (fix_source.tree_root(files[:1], command, cwd) if files else None) or cwd
    edit = fix_source.autotune_key_edit(
        spec.get("kernel"), spec.get("drop") or [], files + fix_source.python_files(root)
    )
    if edit is None:
        plan.warnings.append(
            f"no @triton.autotune(key=[...]) of {spec.get('kernel')} found "
            "in the job's tree: the key change is left to do by hand"
        )
    return edit


def _source_edit(
    code: Mapping[str, Any] | None, command: Sequence[str], plan: Plan, cwd: str
) -> dict[str, Any] | None:
    """The concrete edit of a code change, checked against the file; None when there is
    none to make automatically (a sentence, a file outside the job's tree, a moved line)."""
    code = code or {}
    if code.get("autotune_key"):
        code = _autotune_key_code(code["autotune_key"], command, plan, cwd)
        if code is None:
            return None
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
        fix_source.check_bindings(edit["file"], [edit])  # a patch never unbinds a name
        return edit
    except fix_source.PatchError as exc:
        plan.warnings.append(f"source patch not applied: {exc}")
        return None


def _apply_env(plan: Plan, finding: Finding, p: Prescription) -> list[str]:
    applied = []
    for name, value in _env_of(p).items():
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


def _apply_args(plan: Plan, finding: Finding, p: Prescription, flags_set: FlagsSet) -> list[str]:
    arg = p.change
    if not isinstance(arg, ArgChange) or not arg["arg"]:
        return []
    framework = str(arg.framework or "").lower()
    if framework not in KNOWN_FRAMEWORKS:
        plan.instructions.append(
            f"[{finding.id}] {p.summary} (flags of {framework or 'an unknown framework'}: by hand)"
        )
        return []
    wanted: dict[str, FlagValue] = {}
    for flag, value in (arg.flags or {}).items():
        key = flag_name(flag if flag.startswith("-") else "--" + flag)
        if key in flags_set and flags_set[key][0] != value:
            plan.warnings.append(
                f"[{finding.id}] wants {flag} {value}; kept {flags_set[key][0]} from [{flags_set[key][1]}]"
            )
            continue
        flags_set[key] = (value, finding.id)
        wanted[flag] = value
    for flag in arg.remove:
        wanted[flag] = None
    new = set_flags(plan.command, wanted)
    if new == plan.command:
        return []
    plan.command = new
    plan.command_changed = True
    return [" ".join(f if v is None or v is True or v is False else f"{f} {v}" for f, v in wanted.items())]


# -- the search: one candidate per concrete change -------------------------------------------------
@dataclass
class Candidate:
    """One arm to measure: the plan of exactly one change (and its fallbacks)."""

    plan: Plan
    finding: str
    mechanism: str
    summary: str
    predicted_saving_s_per_step: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "finding": self.finding,
            "mechanism": self.mechanism,
            "summary": self.summary,
            "predicted_saving_s_per_step": self.predicted_saving_s_per_step,
            "plan": self.plan.to_dict(),
        }


def _signature(plan: Plan) -> str:
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


# (sort key, finding, the prescriptions tried in that arm, predicted saving)
Option = tuple[tuple[float, int, int], Finding, list[Prescription], float]


def _options(
    rank: int, finding: Finding, command: Sequence[str], cwd: str, prefer: str | None
) -> list[Option]:
    """The finding's candidate arms: each concrete change (a derived own-flag option before the
    code edit it comes from, both before the finding's alternatives), then its warm-ups."""
    fixes = [p for p in finding.prescriptions if is_concrete(p) and not is_precompile(p)]
    fixes.sort(key=lambda p: 0 if prefer and mechanism(p) == prefer else 1)
    derived: list[Prescription] = []
    for p in fixes:
        flag = own_flag_option(p, command, cwd)
        derived += [flag, p] if flag else [p]
    derived = (
        less_often_options(finding, command, cwd) + derived_edit_options(finding, command, cwd) + derived
    )
    fallbacks = [q for q in fixes if mechanism(q) in ("runtime", "config")]
    precompile = [p for p in finding.prescriptions if is_precompile(p)]
    out: list[Option] = []
    for order, p in enumerate(derived):
        gain = p.expected_gain_s_per_step
        if gain is None:
            gain = finding.seconds_lost_per_step or 0.0
        rest = [q for q in fallbacks if q is not p] if mechanism(p) in ("source", "overlay") else []
        out.append(((-gain, rank, order), finding, [p] + rest, gain))
    for order, p in enumerate(precompile):
        gain = p.expected_gain_s_per_step or finding.seconds_lost_per_step or 0.0
        out.append(((-gain, rank, 100 + order), finding, [p], gain))
    return out


def candidate_plans(
    command: Sequence[str],
    findings: Sequence[Finding],
    baseline_path: str,
    environ: Mapping[str, str] | None = None,
    prefer: str | None = None,
    cwd: str | None = None,
) -> tuple[list[Candidate], Plan]:
    """(candidates best first, the plan of everything, for its listing): every concrete change
    of every finding as a candidate of its own, ordered by predicted saving (the finding's rank
    and the prescription's order break ties: a derived own-flag option goes before the code edit
    it comes from, which goes before the finding's alternatives)."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    prefer = prefer or environ.get(PREFER_VAR) or None
    listing = plan_fixes(command, findings, baseline_path, environ=environ, prefer=prefer, cwd=cwd)
    options = [
        o for rank, finding in enumerate(findings) for o in _options(rank, finding, command, cwd, prefer)
    ]
    ladder = plan_ladder(findings, command, cwd)  # global switches for places no rule explains
    listing.ladder = ladder.rows
    options += [
        ((-a.gain, a.rank, 300 + i), a.finding, [a.prescription], a.gain) for i, a in enumerate(ladder.arms)
    ]
    options.sort(key=lambda o: o[0])
    out: list[Candidate] = []
    seen: set[str] = set()
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


def warm_up_after(
    kept: Candidate,
    kept_findings: Sequence[Finding],
    kept_run_path: str,
    environ: Mapping[str, str] | None = None,
) -> Candidate | None:
    """The kept change with its cold start warmed away: the precompile that plan_fixes defers
    when another change rewrites what compiles, now from the kept arm's own run (its kernels are
    the ones the changed job compiles). An arm measured against the kept arm, judged by the
    first step; None when the kept arm compiled nothing a warm-up replays, or was one."""
    if kept.plan.precompile or kept.mechanism == "precompile":
        return None
    found = next(
        ((f, p) for f in kept_findings for p in f.prescriptions if p.automatic and is_precompile(p)), None
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
    # (the cache variables a warm-up sets are strings: traindx.analyzers.jit.common)
    plan.env.update({k: str(v) for k, v in _env_of(p).items() if k in (CACHE_ENABLE_VAR, CACHE_DIR_VAR)})
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
