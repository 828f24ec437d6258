"""CPU threads against cores: oversubscription, contention from other processes, a loaded machine.

torch's intra-op pool spins at its barriers; with more runnable threads than cores the spinning
threads take the cores the working ones need (seen on a 2-core machine: 16 intra-op threads made
a job 3x slower; torch's default of 2 threads on a loaded 2-core machine made a healthy job 30x
slower). Per rank over the steady steps: `threads.oversubscribed` (the job's own threads exceed
its cores), `threads.contention` and `threads.machine_loaded` (info: the load is not the job's).
The cost is measured: the other threads' CPU per step and the training thread's time on a core."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.derive import sources

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="threads",
    order=130,
    ids=("threads.oversubscribed", "threads.contention", "threads.machine_loaded"),
    explains=("gpu_idle.host_starved", "host_work.code"),
)


ANALYZER = "threads"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
LOADED_OTHERS = 0.5  # other runnable tasks per core (mean at the step ends): a loaded machine
MIN_STEPS = 3


def _first(frame: pd.DataFrame, names: Any) -> Any:
    for name in names:
        if name in frame and frame[name].notna().any():
            return float(frame[name].dropna().iloc[0])
    return None


def _env_threads(run: RunRecord) -> int | None:
    env = run.manifest.get("env") or {}
    for name in THREAD_ENV:
        value = str(env.get(name) or "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def thread_facts(run: RunRecord, rank: str) -> Any:
    """What the record says about threads and cores on `rank` over its steady steps, or None
    without the shim's cpu events."""
    cpu = run.of_type("cpu")
    if not len(cpu) or "proc_cpu_s" not in cpu:
        return None
    cpu = cpu[cpu["rank"].astype(str) == str(rank)]
    steady = ev.steady_steps(run, rank)
    if not len(cpu) or not len(steady):
        return None
    wall = steady.set_index("step")["duration_s"]
    on = cpu[cpu["step"].isin(set(wall.index))]
    if len(on) < MIN_STEPS:
        return None
    walls = wall.reindex(on["step"]).to_numpy(float)
    # the shim's picture of threads and cores (cpustat's cpu_threads event: what the job may
    # use - affinity and cgroup quota - and torch's own thread counts)
    picture = (getattr(run, "cpu_threads", None) or {}).get(str(rank)) or {}
    usable = [c for c in (picture.get("cgroup_quota_cores"), picture.get("affinity_cores")) if c]
    cores = (
        (min(usable) if usable else None)
        or _first(cpu, ("cpu_quota", "cores"))
        or (run.manifest.get("host") or {}).get("cpus")
    )
    intra = picture.get("intra_op_threads") or _first(
        cpu, ("intra_op_threads", "torch_threads", "num_threads")
    )
    source = "the shim (torch.get_num_threads)" if intra is not None else None
    if intra is None:
        intra = _env_threads(run)
        source = "the environment (OMP_NUM_THREADS)" if intra is not None else None
    if intra is None and cores:
        intra = float(cores)  # torch's default: one per core
        source = "torch's default (one per core)"
    dl = ev.events_of_type(run, "dataloader")
    if len(dl) and "rank" in dl:
        dl = dl[dl["rank"].astype(str) == str(rank)]
    workers = (
        int(np.nanmax(dl["num_workers"].to_numpy(float)))
        if len(dl) and "num_workers" in dl and dl["num_workers"].notna().any()
        else 0
    )
    workers = max(workers, len(picture.get("dataloader_workers") or ()))
    host_procs = _processes_on_host(run)
    proc = float(on["proc_cpu_s"].sum()) / float(walls.sum())
    thread = (
        float(on["thread_cpu_s"].sum()) / float(walls.sum())
        if "thread_cpu_s" in on and on["thread_cpu_s"].notna().all()
        else None
    )
    running = float(on["running"].mean()) if "running" in on and on["running"].notna().any() else None
    # the other runnable tasks of the machine: what /proc/loadavg counts less this process's
    # threads that were on a core (its CPU use per wall second)
    others = max(0.0, running - proc) if running is not None else None
    if others is not None and host_procs > 1:
        others = max(0.0, others - (host_procs - 1) * proc)
    other_cpu = None
    if thread is not None:
        other_cpu = max(0.0, float((on["proc_cpu_s"] - on["thread_cpu_s"]).mean()))
    idle = None
    if "sys_idle_s" in on and "sys_total_s" in on and float(on["sys_total_s"].sum()) > 0:
        idle = float(on["sys_idle_s"].sum()) / float(on["sys_total_s"].sum())
    return {
        "rank": rank,
        "cores": int(cores) if cores else None,
        "intra_op_threads": int(intra) if intra else None,
        "threads_from": source,
        "inter_op_threads": picture.get("inter_op_threads") or _first(cpu, ("inter_op_threads",)),
        "worker_threads": [w.get("threads") for w in picture.get("dataloader_workers") or ()],
        "dataloader_workers": workers,
        "processes_on_host": host_procs,
        "process_cpu_per_s": round(proc, 3),
        "training_thread_cpu_per_s": None if thread is None else round(thread, 3),
        "other_threads_cpu_s_per_step": None if other_cpu is None else round(other_cpu, 4),
        "runnable_tasks": None if running is None else round(running, 2),
        "other_runnable_tasks": None if others is None else round(others, 2),
        "machine_idle_share": None if idle is None else round(idle, 3),
        "step_s": round(float(np.median(walls)), 5),
        "steps": int(len(on)),
    }


def machine_loaded(facts: dict[str, Any] | None) -> bool:
    """True when other processes kept the cores busy over the steady steps (facts: thread_facts):
    at least LOADED_OTHERS other runnable tasks per core. Waits measured then include the time
    the training thread waited for a core."""
    if not facts or not facts.get("cores"):
        return False
    return bool((facts.get("other_runnable_tasks") or 0.0) >= LOADED_OTHERS * facts["cores"])


def _processes_on_host(run: RunRecord) -> Any:
    """Training processes of one host: the ranks (a multi-node run's nodes each have theirs)."""
    ranks = run.manifest.get("ranks")
    n = len(ranks) if isinstance(ranks, (list, dict)) and ranks else len(run.ranks) or 1
    nodes = run.manifest.get("nodes")
    if isinstance(nodes, (list, dict)) and len(nodes) > 1:
        n = max(1, n // len(nodes))
    return max(1, n)


def _setting(threads: Any) -> str:
    return f"OMP_NUM_THREADS={threads} (or torch.set_num_threads({threads}) at the top of the script)"


def _int(value: Any) -> Any:
    text = str(value or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _job_set_threads(run: RunRecord, f: Any) -> Any:
    """True when torch's intra-op count is not what the environment or torch's default gives
    it: the job (or a library it calls) called torch.set_num_threads. torch caps
    OMP_NUM_THREADS and its default at the cores, so more threads than cores come only from
    such a call."""
    if not str(f.get("threads_from") or "").startswith("the shim"):
        return False
    picture = (getattr(run, "cpu_threads", None) or {}).get(str(f["rank"])) or {}
    env = (picture.get("thread_env") or {}) if isinstance(picture.get("thread_env"), dict) else {}
    asked = _int(env.get("OMP_NUM_THREADS")) or _env_threads(run)
    counts = {
        c
        for c in (
            picture.get("cpu_count"),
            picture.get("affinity_cores"),
            (run.manifest.get("host") or {}).get("cpus"),
        )
        if c
    }
    intra = f["intra_op_threads"]
    if asked:
        return intra not in {asked} | {min(asked, int(c)) for c in counts}
    return bool(counts) and intra > max(counts)


def _job_files(run: RunRecord) -> Any:
    """The job's files that the run shows it ran: its scripts, then the files of its tree (under a
    script's folder or its cwd) that the record's frames name (derive.sources.named_files). A
    script that merely sits beside the job is not one of them."""
    scripts = ev.job_scripts(run)
    roots = {os.path.dirname(p) for p in scripts} | {os.path.abspath(run.manifest.get("cwd") or os.getcwd())}
    rest = [
        p
        for p in sources.named_files(run)
        if p not in scripts and any(p.startswith(os.path.join(r, "")) for r in roots)
    ]
    return scripts + rest


def own_thread_call(run: RunRecord, f: Any) -> Any:
    """The job's own `torch.set_num_threads(...)` that set the thread count the record shows
    ({file, line, source, args}), or None: a call with that literal count, else (when the record
    says the job set the count itself) its first call."""
    first = None
    for path in _job_files(run):
        for call in codefix.calls_of(path, "torch.set_num_threads"):
            if len(call["args"]) != 1:
                continue
            call = dict(call, file=path)
            try:
                if int(call["args"][0]) == f["intra_op_threads"]:
                    return call
            except ValueError:
                pass
            first = first or call
    return first if _job_set_threads(run, f) else None


def _own_call_prescriptions(run: RunRecord, f: Any, threads: Any, why: Any) -> Any:
    """The job's own call set to `threads`; the environment variable would change nothing."""

    call = f.get("thread_call")
    plural = "s" if threads > 1 else ""
    ignored = (
        "OMP_NUM_THREADS would change nothing: the job's call overrides it (and torch "
        "caps the variable at the cores)"
    )
    if call is None:
        if not f.get("job_sets_threads"):
            return None
        # set elsewhere (a library, a file we cannot read): the job's own call after set-up
        # is the last word
        spot = next((s for s in (codefix.before_training_loop(p) for p in ev.job_scripts(run)) if s), None)
        where = ev.job_scripts(run)[0] if spot else None
        change = (
            codefix.code_change(
                where,
                spot[0],
                spot[2],
                f"import torch; torch.set_num_threads({threads})",
                last_line=spot[1],
                op="insert_after",
            )
            if spot and where is not None
            else None
        )
        return (
            Prescription(
                kind="code",
                summary=(
                    f"Run {threads} intra-op thread{plural} per process: call "
                    f"torch.set_num_threads({threads}) after set-up"
                    + (f" ({where}:{spot[1]})" if change and spot else "")
                    + f"; {why}. Something in the job sets {f['intra_op_threads']} "
                    f"threads itself: {ignored}"
                ),
                change={"code": change} if change else {},
                automatic=bool(change),
            ),
        )
    func = call["source"][: call["source"].index("(")]
    change = codefix.code_change(call["file"], call["line"], call["source"], f"{func}({threads})")
    code = Prescription(
        kind="code",
        summary=(
            f"Run {threads} intra-op thread{plural} per process: the job sets "
            f"the count itself at {call['file']}:{call['line']} "
            f"({call['source']}); set {threads} there; {why}. {ignored}"
        ),
        change={"code": change} if change else {},
        automatic=bool(change),
    )
    # where the call reads the job's own flag, the fix planner passes the flag instead
    # (traindx.fixing.plan.planner.own_flag_option: the judge names the line, planning decides how)
    return (code,)


def _prescriptions(run: RunRecord, f: Any, threads: Any, why: Any) -> Any:
    own = _own_call_prescriptions(run, f, threads, why)
    if own:
        return own
    return (
        Prescription(
            kind="env",
            summary=f"Run {threads} intra-op thread"
            f"{'s' if threads > 1 else ''} per process: {_setting(threads)}; {why}",
            change={"env": {"OMP_NUM_THREADS": str(threads)}},
            automatic=True,
        ),
    )


def _cost_text(f: Any) -> Any:
    parts = []
    if f["other_threads_cpu_s_per_step"] is not None:
        parts.append(
            f"the process's other threads burned {f['other_threads_cpu_s_per_step']:.3f} "
            f"CPU-s per step beside the training thread"
        )
    if f["training_thread_cpu_per_s"] is not None:
        parts.append(f"the training thread was on a core {f['training_thread_cpu_per_s']:.0%} of the step")
    if f["other_runnable_tasks"] is not None:
        parts.append(f"{f['other_runnable_tasks']:.1f} other runnable tasks on the machine")
    return "; ".join(parts)


def _analyze_rank(run: RunRecord, rank: str) -> list[Finding]:
    f = thread_facts(run, rank)
    if f is None or not f["cores"] or not f["intra_op_threads"]:
        return []
    cores, intra, procs = f["cores"], f["intra_op_threads"], f["processes_on_host"]
    workers = f["dataloader_workers"]
    demand = intra * procs + workers
    others = f["other_runnable_tasks"] or 0.0
    if demand + others > cores:  # a finding may follow: where the job sets its threads
        f["job_sets_threads"] = _job_set_threads(run, f)
        call = own_thread_call(run, f)
        f["thread_call"] = None if call is None else {k: call[k] for k in ("file", "line", "source")}
        if call is not None:
            f["threads_from"] = f"the job's own {call['source']} at {call['file']}:{call['line']}"
    per_proc = max(1, (cores - workers) // procs) if cores > workers else 1
    out = []
    common: dict[str, Any] = {
        "analyzer": ANALYZER,
        "ranks": (rank,),
        "evidence": {**f, "threads_wanted": demand},
    }
    # with other tasks runnable too, fewer threads than the job's share of the cores
    free = max(1, int(cores - others) // procs) if cores > others else 1
    if demand > cores and intra > per_proc:
        out.append(_oversubscribed(run, f, demand, min(per_proc, free), common))
    elif intra > 1 and demand + others > cores + 0.5:
        fit = free
        if fit < intra:
            out.append(_contention(run, f, others, fit, common))
    if machine_loaded(f):
        out.append(_loaded(f, others, common))
    return out


def _oversubscribed(
    run: RunRecord, f: dict[str, Any], demand: int, per_proc: int, common: dict[str, Any]
) -> Finding:
    """More of the job's CPU threads than its cores."""
    cores, intra, procs = f["cores"], f["intra_op_threads"], f["processes_on_host"]
    workers = f["dataloader_workers"]
    ratio = demand / cores
    return Finding(
        id="threads.oversubscribed",
        title=(
            f"{demand} CPU threads on {cores} cores: {intra} intra-op thread"
            f"{'s' if intra > 1 else ''} x {procs} process{'es' if procs > 1 else ''}"
            + (f" + {workers} DataLoader workers" if workers else "")
        ),
        severity="medium" if ratio >= 2 else "low",
        summary=(
            f"The job runs {intra} intra-op threads (from {f['threads_from']}) in each of "
            f"{procs} process{'es' if procs > 1 else ''}"
            + (f" beside {workers} DataLoader workers" if workers else "")
            + f" on {cores} cores it may use: torch's threads spin at their barriers and "
            f"take the cores the working ones need. Measured: {_cost_text(f)}."
        ),
        prescriptions=_prescriptions(
            run,
            f,
            per_proc,
            f"{cores} cores shared by {procs} "
            f"process{'es' if procs > 1 else ''}" + (f" and {workers} workers" if workers else ""),
        ),
        **common,
    )


def _contention(
    run: RunRecord, f: dict[str, Any], others: float, fit: int, common: dict[str, Any]
) -> Finding:
    """The job's intra-op threads and the machine's other runnable tasks, more than its cores."""
    cores, intra = f["cores"], f["intra_op_threads"]
    return Finding(
        id="threads.contention",
        title=(f"{intra} intra-op threads compete with {others:.1f} other runnable tasks for {cores} cores"),
        # info: the machine's load is not the job's, and it comes and goes (the same
        # job on a quiet machine has no such finding); the report shows it with the
        # setting that makes the job robust to it
        severity="info",
        summary=(
            f"Other processes keep the machine busy ({others:.1f} runnable tasks "
            f"beside the job on {cores} cores), so the job's {intra} intra-op threads "
            "wait for each other at every parallel op (a spinning barrier with a "
            f"thread off its core). Measured: {_cost_text(f)}."
        ),
        prescriptions=_prescriptions(run, f, fit, "fewer threads than free cores"),
        **common,
    )


def _loaded(f: dict[str, Any], others: float, common: dict[str, Any]) -> Finding:
    cores = f["cores"]
    return Finding(
        id="threads.machine_loaded",
        title=f"The machine was loaded: {others:.1f} other runnable tasks on {cores} cores",
        severity="info",
        summary=(
            f"Beside the job, {others:.1f} tasks on average were runnable on the "
            f"machine's {cores} cores"
            + (
                f" (idle {f['machine_idle_share']:.0%} of the time)"
                if f["machine_idle_share"] is not None
                else ""
            )
            + ": the step times are those of a shared machine, slower and noisier than "
            "on a quiet one."
        ),
        **common,
    )


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    ranks = sorted(set(run.ledger["rank"]), key=str) if len(run.ledger) else []
    for rank in ranks:
        findings.extend(_analyze_rank(run, rank))
    return findings
