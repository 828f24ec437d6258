"""Changes the `--fix` planner derives from a finding and the job's own files, where the
analyzer's prescription is an edit or a measured period (judge layer, fix planning):

- `own_flag_option`: a code edit whose changed keyword reads the job's own flag
  (`num_workers=args.workers`) becomes that flag (`--workers 4`): the user keeps a command.
- `less_often_options`: a cost under `if step % args.save_every == 0`, or a frequency flag of the
  command whose value is the finding's measured period, made LESS_OFTEN times rarer.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Sequence
from typing import Any

from traindx.analyzers.codefix import code_change
from traindx.analyzers.codefix.flags import flag_name, flag_value, frequency_flags, program_args_start
from traindx.analyzers.core.findings import ArgChange, Finding, Prescription, SourceEdit
from traindx.analyzers.model.stability import LESS_OFTEN  # a periodic cost made this many times rarer
from traindx.fixing.plan import source as fix_source
from traindx.fixing.plan.source import FlagSpec
from traindx.fixing.plan.source import job_script_files as _script_files
from traindx.fixing.plan.source import named_sites as _sites


def code_edit(p: Prescription) -> dict[str, Any]:
    """The prescription's (first) code edit, {} when it has none."""
    change = p.change
    return dict(change.code or {}) if isinstance(change, SourceEdit) else {}


def is_concrete(p: Prescription) -> bool:
    """A prescription --fix can apply by one of its mechanisms: marked automatic, or a code
    edit at a file:line of the job's own code (measured on a scratch copy, never in place)."""
    code = code_edit(p)
    return p.automatic or bool(code.get("file") and ("before" in code or "before_line" in code))


def _flags_of(files: Sequence[str]) -> dict[str, FlagSpec]:
    flags: dict[str, FlagSpec] = {}
    for path in files:
        for dest, spec in fix_source.argparse_flags(path).items():
            flags.setdefault(dest, spec)
    return flags


def _literal(text: str | None) -> int | float | str | bool | None:
    try:
        value = ast.literal_eval(text or "")
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, (int, float, str, bool)) else None


def own_flag_option(p: Prescription, command: Sequence[str], cwd: str) -> Prescription | None:
    """A code edit whose changed keywords or arguments read the job's own flags
    (`num_workers=a.workers`, `dataloader_num_workers=args.workers`,
    `torch.set_num_threads(a.threads)`): the same setting through the job's flags
    (`--workers 4`), so the user keeps a command, not a patch. None when no changed keyword
    or argument reads a flag."""
    code = code_edit(p)
    if not code.get("file") or not code.get("before") or not code.get("after"):
        return None
    flags = _flags_of([code["file"]] + _script_files(command, cwd))
    before = fix_source.keyword_sources(code["before"])
    after = fix_source.keyword_sources(code["after"])
    wanted: dict[str, str] = {}
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
        change=ArgChange(framework="argparse", flags=wanted),
        expected_gain_s_per_step=p.expected_gain_s_per_step,
        automatic=True,
    )


def _command_flag_of(expression: str | None, command: Sequence[str]) -> FlagSpec | None:
    """The command-line flag a config attribute comes from, for config systems that take dotted
    overrides (`num_workers=config.num_workers` with `--trainer.num_workers=0` on the command
    line: minGPT's CfgNode, jsonargparse/LightningCLI, Hydra-style `--a.b.c`): the flag whose last
    dotted part names the attribute. None when the command has no such flag."""
    try:
        node = ast.parse((expression or "").strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if not isinstance(node, ast.Attribute):
        return None
    wanted = node.attr.replace("_", "-")
    for token in command[program_args_start(command) :]:
        name = flag_name(token)
        if name and name.rsplit(".", 1)[-1] == wanted:
            return {"flag": token.split("=", 1)[0], "default": None}
    return None


def _guard_flags(finding: Finding, command: Sequence[str], cwd: str) -> list[tuple[str, str | None, str]]:
    """(flag, its value, why) for every costly line of the job's own files (the finding's sites,
    its edits' lines) that sits under `if step % args.k == ...:`."""
    scripts = _script_files(command, cwd)
    sites = _sites(finding.evidence) + [
        (code["file"], code.get("line")) if code.get("file") else None
        for code in map(code_edit, finding.prescriptions)
    ]
    out = []
    for site in sites:
        if not site or not site[0] or not isinstance(site[1], int):
            continue
        path = os.path.abspath(os.path.join(cwd, site[0]))
        if not os.path.isfile(path) or fix_source.tree_root([path], command, cwd) is None:
            continue
        spec = fix_source.periodic_flag(path, site[1], _flags_of([path] + scripts))
        if spec:
            value = flag_value(command, spec["flag"]) or spec["default"]
            out.append((spec["flag"], value, f"the guard over {os.path.basename(path)}:{site[1]}"))
    return out


def less_often_options(finding: Finding, command: Sequence[str], cwd: str) -> list[Prescription]:
    """A cost that runs every k steps, where k is the job's flag: the flag raised tenfold.
    Found two ways, both generic: the costly line sits under `if step % args.k == ...:` in the
    job's file; or a frequency flag on the command line (`--recovery-interval 2`, a framework's
    own) equals the finding's measured period."""
    lost = finding.seconds_lost_per_step
    if not lost:
        return []
    out: list[Prescription] = []
    seen: set[str] = set()
    option = _less_often_option(lost, out, seen)
    for flag, value, why in _guard_flags(finding, command, cwd):
        option(flag, value, why)
    out.extend(_literal_guard_options(finding, command, cwd, lost, seen))
    period = (finding.evidence or {}).get("period")
    if isinstance(period, int) and period > 0:
        for flag, value in frequency_flags(command):
            if value == str(period):
                option(flag, value, f"the command's frequency flag equals the measured period {period}")
    return out


def _literal_guard_options(
    finding: Finding, command: Sequence[str], cwd: str, lost: float, seen: set[str]
) -> list[Prescription]:
    """A costly line of the job's own files under `if <expr> % k == ...:` with a literal k: k
    raised tenfold in that line (a code edit; the line's file is the job's, never site-packages)."""
    out = []
    for site in _sites(finding.evidence):
        path = os.path.abspath(os.path.join(cwd, site[0]))
        if not os.path.isfile(path) or fix_source.tree_root([path], command, cwd) is None:
            continue
        guard = fix_source.periodic_literal(path, site[1])
        if guard is None or f"{path}:{guard[0]}" in seen:
            continue
        seen.add(f"{path}:{guard[0]}")
        line, text, k = guard
        after = text[: text.rfind("%")] + f"% {k * LESS_OFTEN}"
        change = code_change(path, line, text, after)
        if change:
            out.append(
                Prescription(
                    kind="code",
                    summary=f"do it {LESS_OFTEN}x less often: `{after}` at {site[0]}:{line} (was `{text}`)",
                    change=SourceEdit(code=change),
                    expected_gain_s_per_step=lost * (1 - 1 / LESS_OFTEN),
                    automatic=True,
                )
            )
    return out


def _less_often_option(
    lost: float, out: list[Prescription], seen: set[str]
) -> Callable[[str, Any, str], None]:
    def option(flag: str, current: Any, why: str) -> None:
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
                change=ArgChange(framework="argparse", flags={flag: str(new)}),
                expected_gain_s_per_step=lost * (1 - 1 / LESS_OFTEN),
                automatic=True,
            )
        )

    return option
