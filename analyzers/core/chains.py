"""Causes and symptoms, linked in one pass after every analyzer ran; predicted savings from the
time ledger.

A symptom is a finding whose time is another finding's time seen from elsewhere: a thread
holding the GIL *because it compiles* is the compile; a straggler rank that compiles during the
steps is the compile; a launch-bound GPU under a job that recompiles every step waits for the
compile; slow steps that hold full garbage collections are the GC. A symptom keeps its evidence
and seconds (shown under its cause) but names its cause in `cause`, carries no prescription of its
own and counts for nothing in the savings. The headline is always a root cause.

Savings: each root's prescriptions expect the seconds per step of the ledger lines its fix removes
(`Finding.removes`, set here from LEDGER_LINES where the analyzer did not); the sum over roots is
capped at the step time, so no two findings promise the same second.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core import savings, severity, stacks
from traindx.analyzers.core.declaration import catalog
from traindx.analyzers.core.findings import Prescription
from traindx.derive import ledger as ledger_mod

if TYPE_CHECKING:  # annotations only
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord

# the tables below are derived from the analyzers' declarations (analyzers/core/declaration.py)
_CATALOG = catalog()
# the symptoms some analyzer explains: no other finding is linked under a cause
SYMPTOMS = _CATALOG.symptoms
# every finding of the compile analyzer; of them, a compile or autotune paid again in the steady
# steps (the root of a compiling thread's GIL hold, of a launch-bound GPU)
COMPILE_IDS = _CATALOG.compile_ids
STEADY_JIT = _CATALOG.recompiles
# finding id -> ledger categories its fix removes (steps: the finding's steps_affected)
LEDGER_LINES = _CATALOG.ledger_lines
# recompiles of a model's frame: the model call that holds one is a fresh graph's first call,
# which costs more than its compile events (savings.fresh_graph_calls)
FRESH_GRAPH_CALLS = _CATALOG.fresh_graph_calls
# the straggler's cause (its ledger line before its late arrivals) -> the root finding of that line
STRAGGLER_ROOTS = _CATALOG.straggler_roots
# findings that name the line where time goes without knowing why it goes there
GENERIC_AT_A_LINE = _CATALOG.generic_at_line
# the ledger line an explicit call is booked in -> the findings that judge that line
LINE_OWNERS = _CATALOG.line_owners


def _lost(f: Finding) -> float:
    return f.seconds_lost_per_step or 0.0


def _is_jit(f: Finding, steady_only: bool = True) -> bool:
    if f.id not in COMPILE_IDS or f.cause is not None:
        return False
    return f.id in STEADY_JIT if steady_only else True


def _same_rank(a: Finding, b: Finding) -> bool:
    return not a.ranks or not b.ranks or bool(set(map(str, a.ranks)) & set(map(str, b.ranks)))


def _on_rank(r: Finding, rank: object) -> bool:
    """Whether finding r concerns that rank (a finding of no rank concerns every rank)."""
    return not r.ranks or str(rank) in map(str, r.ranks)


def _compiling_thread(f: Finding) -> str | None:
    """The GIL finding's thread, when py-spy saw it in compiler code."""
    if f.id != "gil.contention":
        return None
    if not any(p.kind == "precompile" for p in f.prescriptions) and not f.evidence.get("compiling"):
        return None
    return str(f.evidence.get("thread") or "")


def _line_of(f: Finding) -> tuple[str, int] | None:
    ev = f.evidence or {}
    file, line = ev.get("file") or ev.get("path"), ev.get("line")
    return (os.path.basename(str(file)), int(line)) if file and isinstance(line, int) else None


def _function_of(f: Finding) -> tuple[str, str] | None:
    """(file name, function name) a finding names, or None."""
    ev = f.evidence or {}
    file, function = ev.get("file") or ev.get("path"), ev.get("function")
    if not file or not function:
        return None
    return os.path.basename(str(file)), str(function).split(".")[-1]


def _same_line_root(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    where = _line_of(f)
    if where is None:
        return None
    same = [
        r
        for r in roots
        if r.id not in GENERIC_AT_A_LINE
        and not r.id.startswith("verdict.")
        and _line_of(r) == where
        and _same_rank(r, f)
    ]
    return max(same, key=_lost, default=None)


def _root_for(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """The root cause of finding f among the candidate roots, or None. Only the symptoms some
    analyzer declares it explains are linked; the rule of each is below."""
    if f.id not in SYMPTOMS:
        return None
    if f.id == "gil.contention":
        return _compile_holding_the_gil(f, roots)
    if f.id == "ranks.straggler":
        return _straggler_cause(f, roots)
    if f.id == "gpu_idle.exposed_communication":
        return _straggler_root(f, roots)
    if f.id == "ranks.pipeline_bubble":
        return _slow_stage_cause(f, roots)
    if f.id == "gpu.launch_bound":
        return _launch_bound_cause(f, roots)
    if f.id == "gpu.place_slow":
        # a place where the host, not the GPU, takes the time, on a launch-bound rank: where the
        # launch-bound finding's seconds go (its location, not a second price for them)
        if (f.evidence or {}).get("bound") != "host":
            return None
        bound = [r for r in roots if r.id == "gpu.launch_bound" and _same_rank(r, f)]
        return max(bound, key=_lost, default=None)
    if f.id in ("steps.periodic_slow", "steps.instability"):
        return _slow_steps_cause(f, roots)
    if f.id in STEADY_JIT and f.id not in FRESH_GRAPH_CALLS:
        return _graph_recompile_cause(f, roots)
    if f.id == "sync.host_device":
        # syncs that are cuDNN's algorithm search or a large device-to-host copy: that is the cause
        gpu = [r for r in roots if r.id in ("gpu.cudnn_retune", "gpu.dtoh_copy") and _same_rank(r, f)]
        if gpu:
            return max(gpu, key=_lost)
    # a generic finding (the GPU starved by host work, host code at a line) whose line is the
    # line of a specific finding on its rank (a pageable copy, a host sync, a GC call) is that
    # finding's symptom: one cause, one finding, the specific prescription
    root = _same_line_root(f, roots) if f.id in GENERIC_AT_A_LINE else None
    if root is None and f.id == "host_work.periodic_line":
        root = _evaluation_cause(f, roots)
    if root is None and f.id in ("host_work.code", "host_work.periodic_line"):
        root = _host_code_cause(f, roots)
    return root


def _graph_recompile_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """Kernels compiled or tuned again only in steps where torch.compile recompiled a graph of
    the same rank are that recompile's: a new shape fails the graph's guard, and the compiler
    then builds (under max-autotune: benchmarks) that graph's kernels anew. One root, the shape
    that changes; its fix (a dynamic dimension, padded or bucketed sizes) removes both."""
    steps = {int(s) for s in f.steps_affected}
    if not steps:
        return None
    graphs = [
        r
        for r in roots
        if r is not f
        and r.id in FRESH_GRAPH_CALLS
        and _same_rank(r, f)
        and steps <= {int(s) for s in r.steps_affected}
    ]
    return max(graphs, key=_lost, default=None)


def _compile_holding_the_gil(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """A thread holding the GIL because it compiles is the compile (of its thread, steady first)."""
    thread = _compiling_thread(f)
    if thread is None:
        return stacks.line_it_works_for(f, roots)  # a logger's writer thread: the line that feeds it
    jits = [r for r in roots if _is_jit(r, steady_only=False) and _same_rank(r, f)]
    by_thread = [
        r
        for r in jits
        if thread
        and any(thread == t or thread.startswith(f"{t} ") for t in (r.evidence.get("threads") or {}))
    ]
    steady = [r for r in (by_thread or jits) if _is_jit(r)]
    pick = steady or by_thread or jits
    return max(pick, key=_lost) if pick else None


def _straggler_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    straggler = str(f.evidence.get("straggler"))
    if f.evidence.get("straggler_compiles_in_steady_steps"):
        jits = [r for r in roots if _is_jit(r, steady_only=False) and _on_rank(r, straggler)]
        return max(jits, key=lambda r: (_is_jit(r), _lost(r)), default=None)
    if f.evidence.get("cause") in STRAGGLER_ROOTS:
        # the straggler is late because of its own GC pauses / data waits: the finding of that
        # line on its rank is the root (the others' waits are its cost, not a second problem)
        root_id = STRAGGLER_ROOTS[f.evidence["cause"]]
        own = [r for r in roots if r.id == root_id and _on_rank(r, straggler)]
        return max(own, key=_lost, default=None)
    return _straggler_root(f, roots)


def _slow_stage_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """The stages wait for one stage that pauses in GC / waits for data: that is the root."""
    stage = f.evidence.get("slow_stage")
    if not stage or next(iter(stage.get("ledger_beyond_per_step_s") or {}), None) not in STRAGGLER_ROOTS:
        return None
    line = next(iter(stage["ledger_beyond_per_step_s"]))
    own = [r for r in roots if r.id == STRAGGLER_ROOTS[line] and _on_rank(r, stage["rank"])]
    return max(own, key=_lost, default=None)


def _launch_bound_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    # a host sync inside the model's forward: a CUDA graph cannot capture it, and after each
    # one the GPU's queue is empty, so tiny kernels look launch-bound; the syncs go first (what
    # stays launch-bound shows on the next run)
    syncs = [
        r
        for r in roots
        if r.id == "sync.host_device"
        and _same_rank(r, f)
        and r.severity != "info"
        and ((r.evidence or {}).get("syncs_in_model_per_step") or 0) >= 1
    ]
    if syncs:
        return max(syncs, key=_lost)
    jits = [r for r in roots if _is_jit(r) and _same_rank(r, f)]
    return max(jits, key=_lost) if jits else None


def _host_code_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    # host code in the function the GPU waits for (gpu_idle.host_starved on its rank): the
    # same seconds seen from the host; the GPU's idle is what removing them saves
    starved = [
        r
        for r in roots
        if r.id == "gpu_idle.host_starved"
        and _same_rank(r, f)
        and _function_of(r) is not None
        and _function_of(r) == _function_of(f)
    ]
    if starved:
        top = max(starved, key=_lost)
        return _same_line_root(top, [r for r in roots if r is not f]) or top
    if (f.evidence or {}).get("kind") in (None, "sleep"):
        return None
    # the training thread's own code looks slow where another thread holds the GIL: its
    # samples at the line are waits for the GIL (a sleep elapses without it)
    gil = [r for r in roots if r.id == "gil.contention" and _same_rank(r, f) and _compiling_thread(r) is None]
    return max((r for r in gil if not stacks.hands_work_to(f, r, roots)), key=_lost, default=None)


# of a periodic finding's slow steps, the share an evaluation must run in to be their cause
EVAL_COVERS = 0.75


def _evaluation_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """Periodic slow steps (or a periodically longer host line) that hold an evaluation
    (forward calls without grad) are that evaluation: its price, not a cause of their own."""
    slow = {int(s) for s in f.steps_affected}
    if not slow or f.evidence.get("io_in_slow_steps"):
        return None
    evals = [
        r
        for r in roots
        if r.id in ("evaluation.in_loop", "evaluation.rollout")
        and _same_rank(r, f)
        and len(slow & {int(s) for s in r.steps_affected}) >= EVAL_COVERS * len(slow)
    ]
    return max(evals, key=_lost, default=None)


def _slow_steps_cause(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """Slow steps that hold full garbage collections (and no I/O) are the GC; slow steps that
    hold an evaluation are that evaluation (_evaluation_cause)."""
    found = _evaluation_cause(f, roots)
    if found is not None:
        return found
    if f.id == "steps.instability":
        # a step time that varies, every evaluating step among its slow ones: the variation is
        # the evaluation's (on a loaded machine other steps join the slow ones by chance)
        slow = {int(s) for s in f.steps_affected}
        evals = [
            r
            for r in roots
            if r.id in ("evaluation.in_loop", "evaluation.rollout")
            and _same_rank(r, f)
            and r.steps_affected
            and {int(s) for s in r.steps_affected} <= slow
        ]
        if evals:
            return max(evals, key=_lost)
    if not f.evidence.get("gen2_gc_in_slow_steps") or f.evidence.get("io_in_slow_steps"):
        return None
    gcs = [r for r in roots if r.id == "gc.gen2_in_step" and _same_rank(r, f)]
    return gcs[0] if gcs else None


def _straggler_root(f: Finding, roots: Sequence[Finding]) -> Finding | None:
    """A straggler whose own GPU waits for its host (gpu_idle.host_starved on that rank): that
    host work is the root. The other ranks' collectives not overlapped with compute are their
    wait for the straggler: a symptom of it (of its root, when it has one)."""
    if f.id == "ranks.straggler":
        straggler = str(f.evidence.get("straggler"))
        own = [r for r in roots if r.id == "gpu_idle.host_starved" and straggler in map(str, r.ranks)]
        return max(own, key=_lost, default=None)
    stragglers = [
        r
        for r in roots
        if r.id == "ranks.straggler" and str(r.evidence.get("straggler")) not in map(str, f.ranks)
    ]
    if not stragglers:
        return None
    return _straggler_root(stragglers[0], roots) or stragglers[0]


def _as_symptom(f: Finding, root: Finding) -> Finding:
    note = f" Symptom of: {root.title}."
    # a root judged a note (work the job asked for: a rollout) makes its symptoms notes too
    severity = "info" if root.severity == "info" else f.severity
    return replace(f, cause=root.id, prescriptions=(), summary=(f.summary or "") + note, severity=severity)


def link(findings: Sequence[Finding]) -> list[Finding]:
    """Findings with cause/symptoms set; symptoms lose their prescriptions."""
    roots = [f for f in findings if f.cause is None]
    out: list[Finding] = []
    symptoms_of: dict[int, list[str]] = {}
    for f in findings:
        root = _root_for(f, [r for r in roots if r is not f])
        if root is not None:
            out.append(_as_symptom(f, root))
            symptoms_of.setdefault(id(root), []).append(f.id)
        else:
            out.append(f)
    return [
        replace(f, symptoms=tuple(dict.fromkeys(tuple(f.symptoms) + tuple(symptoms_of[id(f)]))))
        if id(f) in symptoms_of
        else f
        for f in out
    ]


def _workers_prescribed(f: Finding) -> int | None:
    """num_workers=N of the DataLoader prescription: the batches are then made by N processes."""
    for p in f.prescriptions:
        code = p.change.get("code") or {}
        m = re.search(r"num_workers\s*=\s*(\d+)", f"{code.get('after') or ''} {p.summary}")
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return None


def _with_ledger_lines(f: Finding, run: RunRecord) -> Finding:
    if f.removes:
        return f
    if (
        f.id == "steps.periodic_slow"
        and f.evidence.get("io_in_slow_steps")
        and "io_explains_share_of_excess" not in f.evidence
    ):
        return replace(f, removes={"categories": ["io"]})  # the timed save is the slow steps' cost
    if f.id not in LEDGER_LINES:
        return f
    cats, per_step = LEDGER_LINES[f.id]
    removes: dict[str, Any] = {"categories": list(cats)}
    workers = _workers_prescribed(f) if f.id == "dataloader.starvation" else None
    if workers:
        removes["workers"] = workers
        cpus = (run.manifest.get("host") or {}).get("cpus")
        ranks = max(1, run.ledger["rank"].nunique())
        if cpus:
            removes["cpus"] = max(1, int(cpus) // ranks)
    if per_step and f.steps_affected:
        removes["steps"] = [int(s) for s in f.steps_affected]
        if f.id in FRESH_GRAPH_CALLS:
            removes["fresh_graph_calls"] = True
    return replace(f, removes=removes)


def _with_recompile_symptoms(findings: list[Finding]) -> list[Finding]:
    """A root whose symptoms are compiles or autotunes paid again in its steps (a graph
    recompile's kernels) removes their ledger lines too: its fix takes them away with it."""
    under: dict[str, list[Finding]] = {}
    for f in findings:
        if f.cause is not None and f.id in STEADY_JIT and f.removes:
            under.setdefault(f.cause, []).append(f)
    out = []
    for f in findings:
        mine = [s for s in under.get(f.id, ()) if _same_rank(s, f)]
        if f.cause is None and f.removes and mine:
            lines = [*f.removes.get("categories", ()), *(c for s in mine for c in s.removes["categories"])]
            f = replace(f, removes={**f.removes, "categories": list(dict.fromkeys(lines))})
        out.append(f)
    return out


SAVING_SHORTFALL = 0.8  # a saving under this share of the time lost is explained with it


def _saving_limit(f: Finding, removed: float | None) -> str | None:
    """Why the change saves less than the cause costs, in words, or None when it saves about
    all of it: the user sees both numbers (the finding's time lost, the verdict's saving)."""
    lost = f.seconds_lost_per_step
    if not lost or removed is None or removed >= SAVING_SHORTFALL * lost:
        return None
    removes = f.removes or {}
    workers, cpus = removes.get("workers"), removes.get("cpus")
    if workers:
        cores = f" on {cpus} core{'s' if cpus != 1 else ''} the step also uses" if cpus else ""
        return (
            f"the work moves to {workers} worker processes{cores}: they still need its CPU "
            "time, so the step keeps the part they cannot run beside it"
        )
    if removes.get("steps"):
        return "the cost falls in a few steps; the saving is spread over the steady steps"
    return "the time ledger removes only the lines this change takes away; the rest stays"


def _set_gain(f: Finding, gain: float) -> Finding:
    return replace(
        f,
        prescriptions=tuple(
            replace(p, expected_gain_s_per_step=gain if p.expected_gain_s_per_step is not None else None)
            for p in f.prescriptions
        ),
    )


def _measured(run: RunRecord, categories: Sequence[str]) -> bool:
    """Compiles and autotunes are timed in every shim run; the other lines need its spans."""
    return set(categories) <= {"compile", "autotune"} or ledger_mod.has_spans(run)


def without_losing_prescriptions(f: Finding) -> Finding:
    """No prescription promises a gain <= 0. The savings model can price a fix at or below zero
    (more DataLoader workers on cores the step already fills with other work: the machine's
    load, which comes and goes): such a prescription keeps its change but loses its price, and
    says what the model expected here and why; the finding records it in
    evidence["unpriced"]."""
    losing = [
        p
        for p in f.prescriptions
        if p.expected_gain_s_per_step is not None and p.expected_gain_s_per_step <= 0
    ]
    if not losing:
        return f
    kept = tuple(
        replace(
            p,
            expected_gain_s_per_step=None,
            summary=(
                f"{p.summary} (no gain expected on this machine as it was loaded: the "
                f"time ledger prices it at {(p.expected_gain_s_per_step or 0.0) * 1e3:+.1f} ms "
                "a step; it saves time where cores are free)"
            ),
        )
        if p in losing
        else p
        for p in f.prescriptions
    )
    evidence = dict(f.evidence)
    evidence["unpriced"] = [
        {"summary": p.summary, "expected_gain_s_per_step": p.expected_gain_s_per_step} for p in losing
    ]
    return replace(f, prescriptions=kept, evidence=evidence)


def attach_call_sites(findings: list[Finding]) -> list[Finding]:
    """The user's explicit calls that host_work saw at a line (`host_work.call_site`: a
    gc.collect(), a torch.save, an .item() in the loop) go into the finding that judges their
    ledger line on the same rank: its evidence names the line, and its first prescription is the
    edit of that line (remove it, or run it every N steps). Notes that find no such finding
    stay as they are (info)."""
    notes = [f for f in findings if f.id == "host_work.call_site"]
    if not notes:
        return findings
    out, used = [], set()
    for f in findings:
        if f.id == "host_work.call_site" or f.cause is not None:
            out.append(f)
            continue
        mine = [
            n
            for n in notes
            if f.id in LINE_OWNERS.get(n.evidence.get("ledger_line") or "", ()) and _same_rank(n, f)
        ]
        used.update(id(n) for n in mine)
        out.append(_with_call_sites(f, mine) if mine else f)
    return [f for f in out if id(f) not in used]


def _with_call_sites(f: Finding, notes: list[Finding]) -> Finding:
    """Finding f with the explicit calls of `notes` in its evidence, their edits first."""
    sites = [
        {k: n.evidence.get(k) for k in ("file", "line", "source", "function", "seconds_per_step")}
        for n in notes
    ]
    gain = next(
        (p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None),
        f.seconds_lost_per_step,
    )
    edits = [_call_site_edit(n, gain) for n in notes]
    where = ", ".join(f"{s['file']}:{s['line']}" for s in sites)
    # the analyzer's own edit of the same line (found in the source) is said once
    edited = {_edit_key(p) for p in edits} - {None}
    kept = tuple(p for p in f.prescriptions if _edit_key(p) not in edited)
    automatic = {_edit_key(p) for p in f.prescriptions if p.automatic} & edited
    edits = [replace(e, automatic=True) if _edit_key(e) in automatic else e for e in edits]
    return replace(
        f,
        evidence={**f.evidence, "call_sites": sites},
        summary=(f.summary or "") + f" Called by the job at {where}.",
        prescriptions=tuple(edits) + kept,
    )


def _call_site_edit(note: Finding, gain: float | None) -> Prescription:
    """Remove the explicit call a host_work.call_site note names (prose when its source line
    was not read)."""
    ev = note.evidence
    where = f"{ev['file']}:{ev['line']}"
    change: dict[str, Any] = {}
    if ev.get("raw") is not None:
        change = {
            "code": {"file": ev["path"], "line": ev["line"], "before": ev["raw"], "after": "", "op": "delete"}
        }
    return Prescription(
        kind="code",
        summary=f"the loop calls `{ev['source']}` itself at {where}: remove it (or call it every N steps)",
        change=change,
        expected_gain_s_per_step=gain,
        command=f"- {ev['source']}" if change else None,
    )


def _edit_key(p: Prescription) -> tuple[str, Any, Any] | None:
    """(file, line, op) of a prescription's code edit, None without one."""
    code = p.change.get("code")
    if not code or not code.get("file"):
        return None
    return os.path.realpath(str(code["file"])), code.get("line"), code.get("op")


def apply_savings(findings: list[Finding], run: RunRecord) -> list[Finding]:
    """Prescriptions' expected gains from the ledger lines each root removes; the cumulative
    gain of the roots (ranked) never exceeds the steady step time of their rank; no
    prescription is left that expects a gain <= 0; no severity above what its price is worth
    (severity.bounded_by_price)."""
    return severity.bounded_by_price([without_losing_prescriptions(f) for f in _priced(findings, run)], run)


def _priced(findings: list[Finding], run: RunRecord | None) -> list[Finding]:
    if run is None or not len(run.ledger):
        return findings
    findings = _with_recompile_symptoms([_with_ledger_lines(f, run) for f in findings])
    out = []
    for f in findings:
        if f.cause is None and f.removes and _measured(run, f.removes.get("categories", ())):
            removed = savings.removed_seconds(run, f)
            one_time = bool(f.removes.get("steps"))
            # a cost paid in given steps outside the steady window (a cold start's compiles)
            # saves nothing per steady step: the analyzer's own (amortised) gain stands
            if removed is not None and not (one_time and removed <= 0):
                f = _set_gain(f, removed)
                limit = _saving_limit(f, removed)
                if limit:
                    f = replace(f, evidence={**f.evidence, "saving_limit": limit})
        out.append(f)
    steady = ledger_mod.steady_rows(run)
    if not len(steady):
        return out
    step_s = steady.groupby("rank")["wall_s"].mean().to_dict()
    remaining = dict(step_s)
    order = sorted(range(len(out)), key=lambda i: out[i].rank_key, reverse=True)
    for i in order:
        f = out[i]
        gains = [
            p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None
        ]
        if f.cause is not None or not gains:
            continue
        ranks = [r for r in (f.ranks or step_s.keys()) if r in remaining] or list(remaining)
        room = min(remaining[r] for r in ranks)
        if max(gains) > room:
            out[i] = replace(
                f,
                # severity.py: a price capped by the roots above is that small, not unknown
                evidence={**f.evidence, "capped_by_roots_above_s": round(room, 6)},
                prescriptions=tuple(
                    replace(p, expected_gain_s_per_step=min(p.expected_gain_s_per_step, room))
                    if p.expected_gain_s_per_step is not None
                    else p
                    for p in f.prescriptions
                ),
            )
        for r in ranks:
            remaining[r] = max(0.0, remaining[r] - min(max(gains), room))
    return out
