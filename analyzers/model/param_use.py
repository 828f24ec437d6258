"""Work nobody uses: gradients no optimizer applies (`param_use.unused_grads`), and an optimizer
stepping every micro-batch where the loss is scaled for accumulation
(`param_use.step_per_microbatch`: one micro-batch's gradients, scaled for N, make a whole
update). docs/analyzers.md gives the evidence and the edits."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from traindx.analyzers.codefix import params as codefix_params
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription, RuntimePatch, SourceEdit
from traindx.derive import ledger

if TYPE_CHECKING:  # annotations only
    import pandas as pd

    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="param_use",
    order=117,
    ids=("param_use.unused_grads", "param_use.step_per_microbatch"),
    explains=("host_work.code", "gpu_idle.host_starved"),
)

FREEZE_PATCH = "freeze_unused_params"  # the shim's runtime patch (paramuse.FREEZE_PATCH)
MIN_UNUSED_SHARE = 0.02  # of the parameters with gradients: below it, nothing worth a finding
REASONS = {"lr0": "a learning rate of 0", "none": "in no optimizer's param groups"}
_FLAG = re.compile(r"^--?[\w.-]*accum[\w.-]*(?:=(\S+))?$", re.IGNORECASE)


def _last(run: RunRecord, type_: str) -> dict[str, dict[str, Any]]:
    """The last event of the type per rank, fields of later events of it merged in (the shim's
    timing of the unused modules' forward follows its check)."""
    ev_ = run.of_type(type_)
    out: dict[str, dict[str, Any]] = {}
    for row in ev_.to_dict("records") if len(ev_) else ():
        row = {k: v for k, v in row.items() if not _missing(v)}
        rank = str(row.get("rank"))
        out[rank] = {**out[rank], **row} if rank in out and "unused" not in row else row
    return out


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def _backward_s(run: RunRecord, rank: str, led: Any) -> float:
    """Seconds of backward per steady step (the shim's backward spans)."""
    spans = run.rank_rows("spans", rank)
    bwd = spans[spans["cat"] == "backward"] if len(spans) else spans
    if not len(bwd) or not len(led):
        return 0.0
    ws = led.sort_values("start_ns")
    s, e = ws["start_ns"].to_numpy(np.int64), ws["end_ns"].to_numpy(np.int64)
    start = bwd["start_ns"].to_numpy(np.int64)
    i = np.searchsorted(s, start, side="right") - 1
    inside = (i >= 0) & (start < e[np.maximum(i, 0)])
    return float((bwd["end_ns"].to_numpy(np.int64) - start)[inside].sum() / 1e9 / len(ws))


def _display(path: str, cwd: str | None) -> str:
    if cwd and path.startswith(cwd.rstrip("/") + "/"):
        return path[len(cwd.rstrip("/")) + 1 :]
    return path


def _unused_saving(
    run: RunRecord, rank: str, led: pd.DataFrame, event: dict[str, Any], fraction: float
) -> float:
    """Backward seconds a step their gradients cost: their share of the gradients, or where the
    shim timed their forward, about twice it (gradients of the weights and of the inputs; where
    they run first, of everything before their end), within the backward measured."""
    backward = _backward_s(run, rank, led)
    saving = backward * fraction
    for key in ("unused_forward_s", "unused_prefix_s"):
        fwd = event.get(key)
        if isinstance(fwd, (int, float)) and fwd > 0:
            saving = max(saving, min(2.0 * float(fwd), backward))
    return saving


def _unused_prescriptions(
    run: RunRecord, groups: list[dict[str, Any]], saving: float
) -> tuple[list[str], list[Prescription]]:
    """(the modules named, the prescriptions): the freeze where each is built, the framework's
    own freezing, the runtime freeze --fix measures."""
    cwd = run.manifest.get("cwd")
    edits: list[dict[str, Any]] = []
    named: list[str] = []
    own_freezes: list[str] = []
    for g in groups:
        name = f"{g.get('root')}.{g['module']}" if g.get("module") else str(g.get("root"))
        built = g.get("built") or {}
        where = f"{_display(str(built['file']), cwd)}:{built['line']}" if built.get("file") else None
        reason = " and ".join(REASONS.get(r, r) for r in str(g.get("reason", "")).split(",") if r)
        named.append(
            f"{name} ({g.get('cls')}, {int(g.get('numel') or 0):,} parameters, {reason}"
            + (f", built at {where})" if where else ")")
        )
        if built.get("file") and not ev.is_library_path(str(built["file"])):
            edit = codefix_params.freeze_edit(
                str(built["file"]), int(built["line"]), str(g.get("built_path") or "")
            )
            if edit:
                edits.append(edit)
                own = _own_freeze(g, edit)
                if own:
                    own_freezes.append(own)
    pres: list[Prescription] = []
    if edits:
        pres.append(
            Prescription(
                kind="code",
                summary="freeze them where they are built: "
                + "; ".join(f"{e['after']} after {_display(e['file'], cwd)}:{e['line']}" for e in edits),
                change=SourceEdit(code=edits[0], codes=tuple(edits) if len(edits) > 1 else None),
                expected_gain_s_per_step=saving,
                automatic=True,
            )
        )
    if own_freezes:
        pres.append(
            Prescription(kind="code", summary="or the framework's own freezing: " + "; ".join(own_freezes))
        )
    pres.append(
        Prescription(
            kind="runtime",
            summary="freeze the parameters no optimizer updates (requires_grad_(False)); --fix "
            "measures the step with them frozen",
            change=RuntimePatch(patch=FREEZE_PATCH),
            expected_gain_s_per_step=saving,
            automatic=True,
        )
    )
    return named, pres


def _unused_finding(run: RunRecord, rank: str, event: dict[str, Any]) -> Finding | None:
    grad, unused = float(event.get("grad_numel") or 0), float(event.get("unused_numel") or 0)
    groups = [g for g in event.get("unused") or [] if isinstance(g, dict)]
    if grad <= 0 or unused / grad < MIN_UNUSED_SHARE or not groups:
        return None
    led = ledger.steady_rows(run, rank)
    if not len(led):
        return None
    step_s = float(led["wall_s"].mean())
    fraction = unused / grad
    saving = _unused_saving(run, rank, led, event, fraction)
    share = saving / step_s if step_s > 0 else 0.0
    named, pres = _unused_prescriptions(run, groups, saving)
    return Finding(
        id="param_use.unused_grads",
        title=f"Gradients nobody uses: {named[0].split(' (')[0]}"
        + (f" and {len(named) - 1} more" if len(named) > 1 else "")
        + f" ({fraction:.0%} of the parameters with gradients) updated by no optimizer",
        severity=max(ev.severity_for_share(share), "low", key=("info", "low", "medium", "high").index),
        analyzer="param_use",
        summary=(
            f"Backward computes gradients for {int(unused):,} of {int(grad):,} parameters that no "
            f"optimizer updates: {'; '.join(named)}. Their gradients cost about {saving * 1e3:.1f} ms "
            f"of the backward a step ({share:.0%} of the step, priced as their share of the "
            "gradients); set requires_grad_(False) on them (or the framework's freeze)."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(rank,),
        evidence={"rank": rank, "unused_numel": int(unused), "grad_numel": int(grad), "modules": groups},
        prescriptions=tuple(pres),
        removes={"categories": ["forward_backward"], "fraction": _fwd_fraction(led, saving)},
    )


def _own_freeze(group: dict[str, Any], edit: dict[str, Any]) -> str | None:
    """The model's own freezing methods (`freeze_*` of the class the job's line builds: a
    framework's), on the object that line assigns, named beside the edit; None when it has none."""
    methods = [str(m) for m in group.get("freeze_methods") or []]
    target = str(edit.get("after", "")).split(".requires_grad_(")[0]
    inner = codefix_params.attribute_access(str(group.get("built_path") or ""))
    owner = target[: len(target) - len(inner)] if inner and target.endswith(inner) else target
    if not methods or not owner:
        return None
    return ", ".join(f"{owner}.{m}()" for m in methods) + f" ({group.get('built_cls')}'s own)"


def _fwd_fraction(led: Any, saving: float) -> float:
    fb = float(led["forward_backward_s"].mean())
    return min(1.0, saving / fb) if fb > 0 else 0.0


def _accumulation_flag(run: RunRecord, n: int) -> str | None:
    """A command-line flag of the job named for accumulation and set to n: `--grad-accum 4`."""
    argv = [str(a) for a in (run.manifest.get("command") or [])]
    for i, arg in enumerate(argv):
        m = _FLAG.match(arg)
        if not m:
            continue
        value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else None)
        if value is not None and value.strip().isdigit() and int(value) == n:
            return arg.split("=")[0]
    return None


def _accum_finding(run: RunRecord, rank: str, event: dict[str, Any]) -> Finding | None:
    backward = list(event.get("backward") or [])[1:]  # step 0 holds the start-up's calls
    optimizer = list(event.get("optimizer") or [])[1:]
    clip = list(event.get("clip") or [])[1:]
    scale = event.get("loss_scale")
    if not backward or not isinstance(scale, (int, float)) or scale < 2 or abs(scale - round(scale)) > 1e-6:
        return None
    if any(b != 1 for b in backward) or not all(o >= 1 for o in optimizer):
        return None
    n = int(round(scale))
    sites = event.get("sites") or {}
    step_site, clip_site, bwd_site = (
        sites.get("optimizer") or {},
        sites.get("clip") or {},
        sites.get("backward") or {},
    )
    divisor = None
    if bwd_site.get("file"):
        divisor = codefix_params.accumulation_divisor(str(bwd_site["file"]), int(bwd_site["line"]), float(n))
    flag = _accumulation_flag(run, n)
    setting = _setting(event, n)
    if divisor is None and flag is None and setting is None:
        return None
    led = ledger.steady_rows(run, rank)
    if not len(led):
        return None
    step_s = float(led["wall_s"].mean())
    lost = float(led["optimizer_s"].mean()) * (n - 1) / n
    share = lost / step_s if step_s > 0 else 0.0
    cwd = run.manifest.get("cwd")
    lines = []
    for label, site in (("optimizer.step()", step_site), ("clipping", clip_site if any(clip) else {})):
        if site.get("file"):
            where = f"{_display(str(site['file']), cwd)}:{site['line']}"
            direct = codefix_params.calls_optimizer_at(str(site["file"]), int(site["line"]))
            lines.append(f"{label} at {where}" if direct else f"{label} by the framework, from {where}")
    # where the framework steps, its own setting (of another value) is the argument to prescribe
    owned = setting or next(
        (x for x in event.get("settings") or [] if isinstance(x, dict) and x.get("module") != "__main__"),
        None,
    )
    if owned and step_site.get("file") and "line" not in owned:
        built = codefix_params.constructor_line(str(step_site["file"]), str(owned.get("owner")))
        owned = {**owned, "built": f"{_display(str(step_site['file']), cwd)}:{built}"} if built else owned
    pres = _accum_prescriptions(step_site, n, divisor or (setting or {}).get("expr"), lost, cwd, owned)
    return Finding(
        id="param_use.step_per_microbatch",
        title=f"The optimizer steps every micro-batch, the loss is scaled for {n}: " + ", ".join(lines),
        severity=max(ev.severity_for_share(share), "medium", key=("info", "low", "medium", "high").index),
        analyzer="param_use",
        summary=(
            f"Each backward is followed by an optimizer step ({', '.join(lines)}), but the loss "
            f"reaches backward divided by {divisor or n}"
            + (f" (the job's {flag} {n})" if flag else "")
            + (f" (the job's {setting['owner']}.{setting['name']} = {n})" if setting else "")
            + f": every update uses 1/{n} of the gradient it was scaled for, and the step, the "
            f"clipping and zero_grad run {n}x as often as the accumulation asks "
            f"({lost * 1e3:.1f} ms a step of optimizer work, {share:.0%})."
        ),
        seconds_lost_per_step=lost,
        share_of_step=share,
        ranks=(rank,),
        evidence={
            "rank": rank,
            "loss_scale": n,
            "divisor": divisor,
            "flag": flag,
            "setting": setting,
            "backward_per_step": backward,
            "optimizer_per_step": optimizer,
            "clip_per_step": clip,
            "sites": sites,
        },
        prescriptions=pres,
        removes={"categories": ["optimizer"], "fraction": (n - 1) / n},
    )


def _setting(event: dict[str, Any], n: int) -> dict[str, Any] | None:
    """The accumulation setting of n the shim saw on the stack at backward (a framework's
    argument or the job's config object), the one the job's code reaches by name first."""
    found = [s for s in event.get("settings") or [] if isinstance(s, dict) and s.get("value") == n]
    found.sort(key=lambda s: "expr" not in s)
    return found[0] if found else None


def _framework_prescription(setting: dict[str, Any] | None, n: int, edit: bool) -> Prescription | None:
    """The framework's own accumulation: its mechanism where the job's code reaches the object
    (`with accelerator.accumulate(model):`), else its argument (`Trainer(accumulate_grad_batches=4)`)
    where the framework steps; never an edit of its files."""
    if not setting:
        return None
    owner, name = str(setting.get("owner")), str(setting.get("name"))
    holder = str(setting.get("expr") or "").rsplit(".", 1)[0]
    mechanisms = [str(m) for m in setting.get("mechanisms") or []]
    if holder and mechanisms:
        return Prescription(
            kind="code",
            summary=f"or the framework's own accumulation ({owner}.{name} = {n}): each micro-batch's "
            f"forward, backward and step inside {' / '.join(f'{holder}.{m}(...)' for m in mechanisms)}, "
            "which steps every N-th call",
        )
    if edit:
        return None
    return Prescription(
        kind="arg",
        summary=f"the framework steps: set its own argument {owner}({name}={n}) where the job builds it"
        + (f" ({setting['built']})" if setting.get("built") else "")
        + ", and leave the loss's scaling to it (it divides the loss by that number itself)",
    )


def _accum_prescriptions(
    step_site: dict[str, Any],
    n: int,
    divisor: str | None,
    lost: float,
    cwd: str | None,
    setting: dict[str, Any] | None = None,
) -> tuple[Prescription, ...]:
    pres = []
    edit, edits = None, []
    if step_site.get("file") and not ev.is_library_path(str(step_site["file"])):
        edits = codefix_params.accumulate_edits(
            str(step_site["file"]), int(step_site["line"]), divisor or str(n), n
        )
        edit = edits[-1] if edits else None
    if edit:
        pres.append(
            Prescription(
                kind="code",
                summary=f"step, clip and zero the gradients every {n}th micro-batch "
                f"({_display(edit['file'], cwd)}:{edit['line']}"
                + (
                    f", the zero_grad at :{edits[0]['line']} at the first of each {n}"
                    if len(edits) > 1
                    else ""
                )
                + f"): the loss is scaled for {n}",
                change=SourceEdit(code=edit, codes=tuple(edits) if len(edits) > 1 else None),
                expected_gain_s_per_step=lost,
                # it changes what a step is (N micro-batches): the A/B judges it per micro-batch
                # and its loss parity by the `updates` rule (recipes/ab_unit.py, parity.py)
                automatic=True,
            )
        )
    own = _framework_prescription(setting, n, edit is not None)
    if own is not None:
        pres.append(own)
    pres.append(
        Prescription(
            kind="code",
            summary=f"call optimizer.step(), the clipping and zero_grad() once per {n} backward passes "
            f"(the loss is divided by {divisor or n}), not after every micro-batch",
        )
    )
    return tuple(pres)


def analyze(run: RunRecord) -> list[Finding]:
    if not len(run.ledger):
        return []
    findings = []
    for rank, event in sorted(_last(run, "param_use").items()):
        f = _unused_finding(run, rank, event)
        if f is not None:
            findings.append(f)
    for rank, event in sorted(_last(run, "grad_accum").items()):
        f = _accum_finding(run, rank, event)
        if f is not None:
            findings.append(f)
    return findings
