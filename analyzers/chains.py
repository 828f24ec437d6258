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
import re
from dataclasses import replace

from traindx import ledger as ledger_mod

STEADY_JIT = ("jit.fa4_steady_recompile", "jit.steady_recompile", "jit.autotune",
              "jit.dynamo_recompile")
# finding id -> ledger categories its fix removes (steps: the finding's steps_affected)
LEDGER_LINES = {
    "dataloader.starvation": (("data",), False),
    "gc.gen2_in_step": (("gc",), False),
    "jit.fa4_steady_recompile": (("compile",), True),
    "jit.steady_recompile": (("compile",), True),
    "jit.dynamo_recompile": (("compile",), True),
    "jit.autotune": (("autotune",), True),
    # not sync.host_device: the time the host blocks in a sync is mostly the GPU finishing
    # queued work, which stays after the fix; its cost is the GPU idle after it (host_sync.py)
}


# the straggler's cause (its ledger line before its late arrivals) -> the root finding of that line
STRAGGLER_ROOTS = {"gc": "gc.gen2_in_step", "data": "dataloader.starvation"}


def _is_jit(f, steady_only=True):
    if not f.id.startswith("jit.") or f.cause is not None:
        return False
    return (f.id in STEADY_JIT or "recompile" in f.id or "autotune" in f.id) if steady_only else True


def _same_rank(a, b):
    return not a.ranks or not b.ranks or bool(set(map(str, a.ranks)) & set(map(str, b.ranks)))


def _compiling_thread(f):
    """The GIL finding's thread, when py-spy saw it in compiler code."""
    if f.id != "gil.contention":
        return None
    if not any(p.kind == "precompile" for p in f.prescriptions) and not f.evidence.get("compiling"):
        return None
    return str(f.evidence.get("thread") or "")


def _root_for(f, roots):
    """The root cause of finding f among the candidate roots, or None."""
    thread = _compiling_thread(f)
    if thread is not None:
        jits = [r for r in roots if _is_jit(r, steady_only=False) and _same_rank(r, f)]
        by_thread = [r for r in jits if thread and any(
            thread == t or thread.startswith(f"{t} ") for t in (r.evidence.get("threads") or {}))]
        steady = [r for r in (by_thread or jits) if _is_jit(r)]
        pick = steady or by_thread or jits
        return max(pick, key=lambda r: r.seconds_lost_per_step or 0.0) if pick else None
    if f.id == "ranks.straggler" and f.evidence.get("straggler_compiles_in_steady_steps"):
        straggler = str(f.evidence.get("straggler"))
        jits = [r for r in roots if _is_jit(r, steady_only=False)
                and (not r.ranks or straggler in map(str, r.ranks))]
        return max(jits, key=lambda r: (_is_jit(r), r.seconds_lost_per_step or 0.0), default=None)
    if f.id == "ranks.straggler" and f.evidence.get("cause") in STRAGGLER_ROOTS:
        # the straggler is late because of its own GC pauses / data waits: the finding of that
        # line on its rank is the root (the others' waits are its cost, not a second problem)
        straggler = str(f.evidence.get("straggler"))
        own = [r for r in roots if r.id == STRAGGLER_ROOTS[f.evidence["cause"]]
               and (not r.ranks or straggler in map(str, r.ranks))]
        return max(own, key=lambda r: r.seconds_lost_per_step or 0.0, default=None)
    stage = f.evidence.get("slow_stage") if f.id == "ranks.pipeline_bubble" else None
    if stage and next(iter(stage.get("ledger_beyond_per_step_s") or {}), None) in STRAGGLER_ROOTS:
        # the stages wait for one stage that pauses in GC / waits for data: that is the root
        line = next(iter(stage["ledger_beyond_per_step_s"]))
        own = [r for r in roots if r.id == STRAGGLER_ROOTS[line]
               and (not r.ranks or str(stage["rank"]) in map(str, r.ranks))]
        return max(own, key=lambda r: r.seconds_lost_per_step or 0.0, default=None)
    if f.id == "gpu.launch_bound":
        jits = [r for r in roots if _is_jit(r) and _same_rank(r, f)]
        return max(jits, key=lambda r: r.seconds_lost_per_step or 0.0) if jits else None
    gc_steps = f.evidence.get("gen2_gc_in_slow_steps") and not f.evidence.get("io_in_slow_steps")
    if f.id in ("steps.periodic_slow", "steps.instability") and gc_steps:
        gcs = [r for r in roots if r.id == "gc.gen2_in_step" and _same_rank(r, f)]
        return gcs[0] if gcs else None
    return None


def _as_symptom(f, root):
    note = f" Symptom of: {root.title}."
    return replace(f, cause=root.id, prescriptions=(), summary=(f.summary or "") + note)


def link(findings):
    """Findings with cause/symptoms set; symptoms lose their prescriptions."""
    roots = [f for f in findings if f.cause is None]
    out, symptoms_of = [], {}
    for f in findings:
        root = _root_for(f, [r for r in roots if r is not f])
        if root is not None:
            out.append(_as_symptom(f, root))
            symptoms_of.setdefault(id(root), []).append(f.id)
        else:
            out.append(f)
    return [replace(f, symptoms=tuple(dict.fromkeys(tuple(f.symptoms) + tuple(symptoms_of[id(f)]))))
            if id(f) in symptoms_of else f for f in out]


def _workers_prescribed(f):
    """num_workers=N of the DataLoader prescription: the batches are then made by N processes."""
    for p in f.prescriptions:
        code = (p.change or {}).get("code") or {}
        m = re.search(r"num_workers\s*=\s*(\d+)", f"{code.get('after') or ''} {p.summary}")
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    return None


def _with_ledger_lines(f, run):
    if f.removes:
        return f
    if f.id == "steps.periodic_slow" and f.evidence.get("io_in_slow_steps") \
            and "io_explains_share_of_excess" not in f.evidence:
        return replace(f, removes={"categories": ["io"]})  # the timed save is the slow steps' cost
    if f.id not in LEDGER_LINES:
        return f
    cats, per_step = LEDGER_LINES[f.id]
    removes = {"categories": list(cats)}
    workers = _workers_prescribed(f) if f.id == "dataloader.starvation" else None
    if workers:
        removes["workers"] = workers
        cpus = (run.manifest.get("host") or {}).get("cpus")
        ranks = max(1, run.ledger["rank"].nunique())
        if cpus:
            removes["cpus"] = max(1, int(cpus) // ranks)
    if per_step and f.steps_affected:
        removes["steps"] = [int(s) for s in f.steps_affected]
    return replace(f, removes=removes)


def _set_gain(f, gain):
    return replace(f, prescriptions=tuple(
        replace(p, expected_gain_s_per_step=gain if p.expected_gain_s_per_step is not None
                else None) for p in f.prescriptions))


def _measured(run, categories):
    """Compiles and autotunes are timed in every shim run; the other lines need its spans."""
    return set(categories) <= {"compile", "autotune"} or ledger_mod.has_spans(run)


def apply_savings(findings, run):
    """Prescriptions' expected gains from the ledger lines each root removes; the cumulative
    gain of the roots (ranked) never exceeds the steady step time of their rank."""
    if run is None or not len(run.ledger):
        return findings
    findings = [_with_ledger_lines(f, run) for f in findings]
    out = []
    for f in findings:
        if f.cause is None and f.removes and _measured(run, f.removes.get("categories", ())):
            removed = ledger_mod.removed_seconds(run, f)
            if removed is not None:
                f = _set_gain(f, removed)
        out.append(f)
    steady = ledger_mod.steady_rows(run)
    if not len(steady):
        return out
    step_s = steady.groupby("rank")["wall_s"].mean().to_dict()
    remaining = dict(step_s)
    order = sorted(range(len(out)), key=lambda i: out[i].rank_key, reverse=True)
    for i in order:
        f = out[i]
        gains = [p.expected_gain_s_per_step for p in f.prescriptions
                 if p.expected_gain_s_per_step is not None]
        if f.cause is not None or not gains:
            continue
        ranks = [r for r in (f.ranks or step_s.keys()) if r in remaining] or list(remaining)
        room = min(remaining[r] for r in ranks)
        if max(gains) > room:
            out[i] = replace(f, prescriptions=tuple(
                replace(p, expected_gain_s_per_step=min(p.expected_gain_s_per_step, room))
                if p.expected_gain_s_per_step is not None else p for p in f.prescriptions))
        for r in ranks:
            remaining[r] = max(0.0, remaining[r] - min(max(gains), room))
    return out
