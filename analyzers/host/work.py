"""A cause for any slow line: code the training thread runs between its measured calls.

No specialised analyzer knows this work (a blocking read, an image encoded per step, a numpy
transform), so each code line of it costing >= MIN_SHARE of the steady step is a finding of its
own, with the generic fixes that fit and a concrete edit where one exists. The code comes from
the ledger's host intervals (`traindx.derive.ledger.host_code`), else from py-spy's samples
outside every measured call; a line dear every k-th step is named with its period
(stability.line_periods). docs/analyzers.md (`host_work.*`) gives the rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.host import hooks
from traindx.analyzers.host.code import MIN_SAMPLES as MIN_SAMPLES  # re-exported: the tests read it here
from traindx.analyzers.host.code import (
    Group,
    ancestor_lines,
    claimed_line,
    display_path,
    groups_from_ledger,
    groups_from_pyspy,
    ledger_host_code,
    own_step_s,
    source_line,
    without_runqueue_wait,
)
from traindx.analyzers.host.prescriptions import async_edit as async_edit  # re-exported: the tests
from traindx.analyzers.host.prescriptions import (
    call_name,
    call_of_kind,
    callback_dispatch,
    callback_prescription,
    host_code_summary,
    kind_of,
    line_prescriptions,
)
from traindx.analyzers.model import stability
from traindx.common.units import ordinal
from traindx.derive import gpu_efficiency as G
from traindx.derive import ledger
from traindx.derive.sources import source_line as job_source_line

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="host_work",
    order=120,
    ids=("host_work.call_site", "host_work.code", "host_work.framework_loop", "host_work.periodic_line"),
    live_categories=("io", "other"),
    explains=("ranks.straggler", "ranks.pipeline_bubble", "gpu_idle.host_starved", "host_work.code"),
    straggler_lines={"host": "host_work.code"},
    generic_at_line=("host_work.code",),
)

MIN_SHARE = 0.03  # of the steady step: a line below this is not worth a finding
MIN_SECONDS = 0.001  # ...nor one under a millisecond a step (nothing measurable to gain)
ANALYZER = "host_work"

KIND_TEXT = {
    "sleep": "a blocking sleep",
    "wait": "a blocking wait",
    "image": "image encoding",
    "file": "a file read/write",
    "numpy": "numpy",
    "logging": "logging",
    "tensor": "a tensor op on the CPU",
    "python": "Python code",
}


# -- the analysis ------------------------------------------------------------------------------
# work on the CPU itself: on a CPU-only job it is the job's compute as much as the model's (the
# batch built with tensor ops, the loss outside the module), competing for the same cores
# wherever it runs; named from COMPUTE_MIN_SHARE there, as info below it (a CPU job's batch
# built with tensor ops takes 8-12 % of its step by itself: no cause, the job's own work)
COMPUTE_KINDS = ("python", "tensor", "numpy")
COMPUTE_MIN_SHARE = 0.15


def _severity(kind: str | None, share: float, has_gpu: bool) -> str:
    if kind in COMPUTE_KINDS and not has_gpu and share < COMPUTE_MIN_SHARE:
        return "info"
    return ev.severity_for_share(share)


def _call_site_note(
    run: RunRecord,
    rank: str,
    g: Any,
    src: str | None,
    line_name: Any,
    seconds: float,
    share: float | None,
    cwd: str | None,
) -> Finding:
    """An info note: the user's explicit call of something the shim books in `line_name`."""
    path = display_path(g["file"], cwd)
    raw = job_source_line(g["file"], g["line"], cwd)
    return Finding(
        id="host_work.call_site",
        title=f"{src} at {path}:{g['line']} ({line_name} line)",
        severity="info",
        analyzer=ANALYZER,
        summary=(
            f"The loop calls `{src}` itself at {path}:{g['line']}, {seconds:.3f} s a step "
            f"({share:.0%}) on the ledger's {line_name} line."
        ),
        seconds_lost_per_step=seconds,
        share_of_step=share,
        ranks=(rank,),
        evidence={
            "rank": rank,
            "file": path,
            "path": g["file"],
            "line": g["line"],
            "source": src,
            "raw": raw,
            "function": g["function"],
            "ledger_line": line_name,
            "seconds_per_step": round(seconds, 5),
        },
    )


def _call_sites_from_pyspy(
    run: RunRecord, rank: str, led: pd.DataFrame, step_s: float | None, cwd: str | None, noted: Any
) -> Any:
    """The call-site notes py-spy's samples show that the ledger's host samples cannot: an
    explicit call booked in another line (a gc.collect() in the loop) runs inside that line's
    span, outside every host interval, and holds the GIL, so the shim's own sampler thread
    takes no sample there; py-spy, outside the process, sees the thread at the user's line."""
    out = []
    for g in groups_from_pyspy(run, rank, led):
        if (g["file"], g["line"]) in noted or not g["file"] or ev.is_library_path(g["file"]):
            continue
        src = source_line(g["file"], g["line"], cwd)
        claimed = claimed_line(src, led)
        if not claimed or g.get("few_samples"):
            continue
        # the line's own cost is its ledger line's (a GC span less its wait for a core)
        booked = min(g["seconds_sampled"], float(led[f"{claimed}_s"].mean()))
        if booked / step_s >= MIN_SHARE:
            out.append(_call_site_note(run, rank, g, src, claimed, booked, booked / step_s, cwd))
            noted.add((g["file"], g["line"]))
    return out


@dataclass(frozen=True)
class _Rank:
    """What every finding of one rank reads: its steady ledger rows and step, where the job ran,
    its framework's lines and the periods its ledger lines show."""

    run: RunRecord
    rank: str
    led: pd.DataFrame
    step_s: float
    cwd: str | None
    has_gpu: bool
    framework_lines: set[tuple[str, int]]
    periods: list[dict[str, Any]]
    # the GPU's idle seconds per step in the torch.profiler window (None: no window): host work
    # done while the GPU runs the queued kernels costs the step nothing, so a line's price is
    # at most this (gpu_idle names what the GPU waits for)
    gpu_idle_s: float | None = None


def _period_key(period: dict[str, Any]) -> str:
    return f"{period['line']}:{period['period']}"


def _ambiguous_periods(groups: list[Group], periods: list[dict[str, Any]]) -> dict[str, list[Group]]:
    """The periods several lines fit by their cost alone: py-spy has no steps, so a period goes
    to a line by its cost only when one line fits it."""
    fits: dict[str, list[Group]] = {}
    for g in groups:
        if g.get("per_step") is None:
            p = _matching_period(g, periods, g["seconds"])
            if p is not None:
                fits.setdefault(_period_key(p), []).append(g)
    return {k: v for k, v in fits.items() if len(v) > 1}


def _gpu_idle_s(run: RunRecord, rank: str) -> float | None:
    view = G.cached_rank_views(run).get(str(rank)) if run.manifest.get("gpus") else None
    return None if view is None else max(0.0, view.wall_s - view.busy_s)


def _analyze_rank(run: RunRecord, rank: str) -> list[Finding]:
    led = ledger.steady_rows(run, rank)
    if not len(led):
        return []
    step_s = float(led["wall_s"].mean())
    if step_s <= 0:
        return []
    table = ledger_host_code(run)
    groups = groups_from_ledger(table, rank, led) if table is not None else []
    from_ledger = bool(groups)
    if not groups:
        groups = groups_from_pyspy(run, rank, led)
    in_hooks = hooks.hook_functions(run)  # the hooks analyzer names the lines of the job's hooks
    groups = [g for g in groups if (str(g["function"]), str(g["file"])) not in in_hooks]
    ctx = _Rank(
        run=run,
        rank=rank,
        led=led,
        step_s=step_s,
        cwd=run.manifest.get("cwd"),
        has_gpu=bool(run.manifest.get("gpus")),
        framework_lines=ancestor_lines(run, rank) if run.pyspy.get((rank, "all")) else set(),
        periods=stability.line_periods(led, step_s),
        gpu_idle_s=_gpu_idle_s(run, rank),
    )
    ambiguous = _ambiguous_periods(groups, ctx.periods)
    own_step = own_step_s(run, rank, led)
    for g in groups:
        if own_step is not None and g.get("runq_s") is not None:
            without_runqueue_wait(g, own_step, step_s)
    findings, candidates, used_periods, noted = _line_findings(ctx, groups, ambiguous)
    if from_ledger:
        findings.extend(_call_sites_from_pyspy(run, rank, led, step_s, ctx.cwd, noted))
    # a line that differs with a period and no code named for it: the line itself, with the
    # host code py-spy saw most of as the likely one
    for p in ctx.periods:
        if _period_key(p) in used_periods or p["line"] not in UNCLAIMED_LINES:
            continue
        lost = p["excess_s"] / p["period"]
        share = lost / step_s
        if share < MIN_SHARE:
            continue
        finding, candidates = _periodic_line_finding(
            ctx, p, lost, share, ambiguous.get(_period_key(p)) or [], candidates
        )
        findings.append(finding)
    return findings


def _line_findings(
    ctx: _Rank, groups: list[Group], ambiguous: dict[str, list[Group]]
) -> tuple[list[Finding], list[tuple[Group, str | None]], set[str], set[tuple[str, int]]]:
    """(findings, candidates, periods used, call sites noted) of the rank's host lines, the
    dearest first: a finding per line worth one, a call-site note per call another ledger line
    books; the candidates are the host lines (framework lines left out) for the periodic lines,
    those py-spy saw too seldom to name alone included."""
    findings: list[Finding] = []
    candidates: list[tuple[Group, str | None]] = []
    used_periods: set[str] = set()
    noted: set[tuple[str, int]] = set()  # (file, line) of the call-site notes made
    priced_lines: set[tuple[str, int]] = set()  # lines priced by their period
    for g in sorted(groups, key=lambda g: -g["seconds"]):
        seconds = g["seconds"]
        share = g.get("share", seconds / ctx.step_s)
        src = source_line(g["file"], g["line"], ctx.cwd)
        claimed = claimed_line(src, ctx.led)
        if claimed:
            # its time is another ledger line's and that line's analyzer judges it; the call
            # site goes to that finding (chains.attach_call_sites), not a finding of its own
            booked = min(
                cast(float, g.get("seconds_sampled", seconds)),
                float(ctx.led[f"{claimed}_s"].mean()),
            )
            if booked / ctx.step_s >= MIN_SHARE and g["file"] and not ev.is_library_path(g["file"]):
                findings.append(
                    _call_site_note(ctx.run, ctx.rank, g, src, claimed, booked, booked / ctx.step_s, ctx.cwd)
                )
                noted.add((g["file"], g["line"]))
            continue
        if (g["file"], g["line"]) not in ctx.framework_lines:
            candidates.append((g, src))
        period = _matching_period(g, ctx.periods, seconds)
        if period and _period_key(period) in ambiguous:
            period = None
        if (g["file"], g["line"]) in priced_lines:
            continue  # another call of a line priced by its period: that price covers the line
        if period and g.get("per_step") is not None:
            g = _priced_by_period(g, period, ctx.step_s)
            seconds, share = g["seconds"], g["share"]
            if g.get("priced_by"):
                priced_lines.add((g["file"], g["line"]))
        if ctx.gpu_idle_s is not None and not period and seconds > ctx.gpu_idle_s:
            g = _overlapped_by_gpu(g, ctx.gpu_idle_s, ctx.step_s)
            seconds, share = g["seconds"], g["share"]
        if share < MIN_SHARE or seconds < MIN_SECONDS or g.get("few_samples"):
            continue
        if period:
            used_periods.add(_period_key(period))
        findings.append(_line_finding(ctx, g, src, share, period))
    return findings, candidates, used_periods, noted


def _overlapped_by_gpu(g: Group, gpu_idle_s: float, step_s: float) -> Group:
    """A line of every step on a GPU job priced at the GPU's idle at most: the rest of its host
    time ran while the GPU worked through the kernels already queued (an H200 twin's 1 ms of
    host work at 52 % MFU was called medium)."""
    return {
        **g,
        "seconds": gpu_idle_s,
        "share": gpu_idle_s / step_s,
        "priced_by": {
            "method": "the GPU's idle in the profiled steps (the rest overlaps its work)",
            "line_seconds": round(float(g["seconds"]), 5),
            "gpu_idle_s": round(gpu_idle_s, 5),
        },
    }


def _priced_by_period(g: Group, period: dict[str, Any], step_s: float) -> Group:
    """A line whose own steps show the ledger's period is priced as that period's excess spread
    over its steps (+100 ms every 2nd step is 50 ms a step): the dear steps' excess is what its
    removal saves, the run-queue wait of a loaded machine included (the thread waits for a core
    only because it has the work to do); the line's sampled time (its calls split into groups,
    and on a loaded machine without its wait) under-prices it."""
    mean = float(period["excess_s"]) / int(period["period"])
    if mean <= g["seconds"]:
        return g
    return {
        **g,
        "seconds": mean,
        "share": mean / step_s,
        "few_samples": False,
        "priced_by": {
            "method": "the period's excess over its steps",
            "excess_s": round(float(period["excess_s"]), 5),
            "every": int(period["period"]),
            "line_seconds": round(float(g["seconds"]), 5),
        },
    }


def _line_finding(
    ctx: _Rank, g: Group, src: str | None, share: float, period: dict[str, Any] | None
) -> Finding:
    """The finding of one host line: the framework's loop between its calls (info), or host
    work of the loop body with its fixes."""
    seconds = g["seconds"]
    kind = kind_of(g["call"], src, g.get("lib_file"))
    # a group without a library call holds NaN there (pandas), which is truthy
    call = (g["call"] if isinstance(g["call"], str) else None) or call_of_kind(src, kind)
    path = display_path(g["file"], ctx.cwd)
    where = f"{path}:{g['line']}"
    framework = (g["file"], g["line"]) in ctx.framework_lines
    pres: tuple[Prescription, ...]
    if framework:
        title = (
            f"The framework's loop between its measured calls: {seconds * 1e3:.0f} ms a "
            f"step under {g['function']}() ({where})"
        )
        severity = "info"
        summary = (
            f"{share:.0%} of the step runs in library code called from {where} "
            f"({call or 'the framework'}) between the model's forward/backward, the "
            "optimizer step and the data wait: the framework's own per-step work "
            "(logging, callbacks, progress bars). Not a line of your loop body."
        )
        pres = ()
    else:
        every = f" on every {ordinal(period['period'])} step" if period else ""
        callback = callback_dispatch(g)
        title = (
            f"{'A framework callback' if callback else 'Host work in the training loop'}{every}: "
            f"{g['function']}() at {where}, {seconds * 1e3:.0f} ms a step ({share:.0%})"
        )
        severity = _severity(kind, share, ctx.has_gpu)
        what = KIND_TEXT[kind] + (f" ({call})" if call else "")
        summary = host_code_summary(g, src, where, what, share, period)
        pres = tuple(
            line_prescriptions(
                kind,
                where,
                src,
                g["file"],
                g["line"],
                seconds,
                ctx.has_gpu,
                ctx.cwd,
                period["period"] if period else None,
            )
        )
        if callback:
            summary, pres = _as_callback(g, where, callback, summary, pres, share)
    return Finding(
        id="host_work.framework_loop" if framework else "host_work.code",
        title=title,
        severity=severity,
        analyzer=ANALYZER,
        summary=summary,
        steps_affected=tuple(period["steps"]) if period else (),
        seconds_lost_per_step=seconds,
        share_of_step=share,
        evidence=_line_evidence(ctx, g, path, call, kind, src, period),
        prescriptions=pres,
        ranks=(ctx.rank,),
    )


def _line_evidence(
    ctx: _Rank,
    g: Group,
    path: str,
    call: str | None,
    kind: str,
    src: str | None,
    period: dict[str, Any] | None,
) -> dict[str, Any]:
    """A host line's evidence: where it is, what it calls, how it was priced."""
    evidence: dict[str, Any] = {
        "rank": ctx.rank,
        "function": g["function"],
        "file": path,
        "line": g["line"],
        "call": call,
        "kind": kind,
        "source": src,
        "seconds_per_step": round(g["seconds"], 5),
        "method": g["method"],
        "step_s": round(ctx.step_s, 5),
    }
    if g.get("via"):
        evidence["called_by"] = g["via"]
    for k in ("samples", "share_of_loop_samples", "runqueue_wait", "priced_by"):
        if g.get(k) is not None:
            evidence[k] = g[k]
    if period:
        evidence["period"] = period
    return evidence


def _as_callback(
    g: Group, where: str, callback: str, summary: str, pres: tuple[Prescription, ...], share: float
) -> tuple[str, tuple[Prescription, ...]]:
    """A framework's per-step callback: said so, and its own fix first (no DataLoader workers)."""
    summary += (
        f" The framework calls it back on every step ({callback}): it is the job's callback, "
        "not the data or the model."
    )
    rest = tuple(p for p in pres if "DataLoader" not in p.summary)
    return summary, tuple(callback_prescription(g, where, callback, g["seconds"], share)) + rest


def _periodic_line_finding(
    ctx: _Rank,
    p: dict[str, Any],
    lost: float,
    share: float,
    tied: list[Group],
    candidates: list[tuple[Group, str | None]],
) -> tuple[Finding, list[tuple[Group, str | None]]]:
    """The finding of a ledger line that differs with a period and no code named for it, and
    the candidates in the order the next such line reads them (the tied lines first)."""
    evidence: dict[str, Any] = {"rank": ctx.rank, "period": p}
    code_text = " The record names no code for it."
    pres: tuple[Prescription, ...] = ()
    if tied:
        # several lines cost what the excess spreads over the period: name them all, the
        # one most sampled first (py-spy cannot say which one runs only on those steps)
        order = [(g, src) for g, src in candidates if any(g is t for t in tied)]
        candidates = order + [c for c in candidates if c not in order]
        evidence["candidates"] = [
            {
                "function": g["function"],
                "file": display_path(g["file"], ctx.cwd),
                "line": g["line"],
                "seconds_per_step": round(g["seconds"], 5),
            }
            for g in tied
        ]
    if candidates:
        code_text, pres = _likely_code(ctx, p, lost, tied, candidates[0], evidence)
    finding = Finding(
        id="host_work.periodic_line",
        title=(
            f"Every {ordinal(p['period'])} step the {p['label']} line is "
            f"{p['excess_s'] * 1e3:.0f} ms longer on rank {ctx.rank}"
        ),
        severity=_severity(evidence.get("kind"), share, ctx.has_gpu),
        analyzer=ANALYZER,
        summary=(
            f"Steps ≡ {p['residue']} mod {p['period']} spend {p['slow_s']:.3f} s in "
            f"{p['label']} against {p['other_s']:.3f} s for the others." + code_text
        ),
        steps_affected=tuple(p["steps"]),
        seconds_lost_per_step=lost,
        share_of_step=share,
        evidence=evidence,
        prescriptions=pres,
        ranks=(ctx.rank,),
    )
    return finding, candidates


def _likely_code(
    ctx: _Rank,
    p: dict[str, Any],
    lost: float,
    tied: list[Group],
    candidate: tuple[Group, str | None],
    evidence: dict[str, Any],
) -> tuple[str, tuple[Prescription, ...]]:
    """(text, fixes) naming the host code py-spy saw most of as the periodic line's likely
    code; its details go into `evidence`."""
    g, src = candidate
    path = display_path(g["file"], ctx.cwd)
    where = f"{path}:{g['line']}"
    call = (g["call"] if isinstance(g["call"], str) else None) or call_name(None, src)
    kind = kind_of(call, src, g.get("lib_file"))
    code_text = (
        f" The host code py-spy saw most of in the loop is {g['function']}() at "
        f"{where}" + (f": `{src}`" if src else "") + f" ({KIND_TEXT[kind]})."
    )
    if len(tied) > 1:
        code_text += (
            " Lines that cost what the excess spreads over the period: "
            + ", ".join(f"{c['file']}:{c['line']}" for c in evidence["candidates"])
            + " (py-spy has no steps: one of them runs on these steps only)."
        )
    evidence.update(
        function=g["function"],
        file=path,
        line=g["line"],
        call=call,
        kind=kind,
        source=src,
        samples=g.get("samples"),
    )
    pres = tuple(
        line_prescriptions(kind, where, src, g["file"], g["line"], lost, ctx.has_gpu, ctx.cwd, p["period"])
    )
    return code_text, pres


# the ledger lines no specialised analyzer owns (host work is booked in them; the optimizer line
# holds a closure's code: Lightning's training_step)
UNCLAIMED_LINES = ("host", "forward_backward", "unexplained", "optimizer")


def _matching_period(group: Group, periods: list[dict[str, Any]], seconds: float) -> Any:
    """The period found in the ledger lines this code's time is booked in, when the code's
    own steps show it (ledger.host_code per step), or - py-spy has no steps - when its cost is
    the excess spread over the period (the caller keeps that only when one line fits)."""
    per_step = group.get("per_step")
    for p in periods:
        if p["line"] not in UNCLAIMED_LINES:
            continue
        if per_step is not None and len(per_step):
            on = per_step[per_step.index.isin(p["steps"])]
            off = per_step[~per_step.index.isin(p["steps"])]
            if len(on) and len(off) and float(on.median()) - float(off.median()) >= 0.5 * p["excess_s"]:
                return p
            continue
        expected = p["excess_s"] / p["period"]
        if expected > 0 and 0.5 <= seconds / expected <= 2.0:
            return p
    return None


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    if not len(run.ledger):
        return findings
    for rank in sorted(set(run.ledger["rank"]), key=str):
        findings.extend(_analyze_rank(run, rank))
    return findings
