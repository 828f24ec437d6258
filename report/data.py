"""The report's data: everything the HTML report and the terminal summary show, built once from a
RunRecord and its Judgement (analyzers/judgement.py) as plain JSON-able values (pure: no I/O
beyond the record itself).

A renderer only renders: the step table and the per-step event seconds are derived
(derive/steptables.py); the findings, their order, the verdict, each step's cause and what --fix
would do are the judgement's, made once by the judge; the views below only shape them for
display. Times are seconds since the run's start (manifest start_ns), so every chart shares one
x axis. Large evidence is reduced (steps binned, samples merged into a pruned tree, metrics
downsampled) so a 10-minute run renders to a few megabytes at most.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from traindx.common import redact
from traindx.common.envvars import is_relevant_var
from traindx.common.units import fmt_s
from traindx.derive.ledger import startup_text
from traindx.derive.steptables import gaps_table, run_t0, steady_mask
from traindx.report.compiles import MAX_COMPILE_ROWS, compile_events, compile_groups
from traindx.report.findings_view import (
    comparison_view,
    finding_view,
    prescription_text,
    verdict_view,
)
from traindx.report.gpu import gpu_time_view, kernel_class_view
from traindx.report.nvml_view import gpu_util_in_windows, gpu_view
from traindx.report.pyspy_view import gil_view, thread_lanes, worst_rank_first
from traindx.report.steps_view import (
    MAX_STEP_BARS,
    bin_steps,
    ledger_view,
    losses_of,
    rows_of,
    timeline_ranks,
)
from traindx.report.text import clip

if TYPE_CHECKING:  # annotations only
    from collections.abc import Sequence

    import pandas as pd

    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord
    from traindx.judgement import Judgement, StepCauses

__all__ = ["build_report_data", "build_summary", "comparison_view", "prescription_text"]


MAX_LOG_LINES = 40


def run_meta(run: RunRecord) -> dict[str, Any]:
    m = run.manifest
    start_ns, end_ns = m.get("start_ns"), m.get("end_ns")
    env = {}
    for name, value in sorted((m.get("env") or {}).items()):
        if is_relevant_var(name):  # anything else in the (redacted) env stays out
            env[name] = redact.REDACTED if redact.secret_env(name, value) else clip(value, 400)
    command = m.get("command") or []
    return {
        "id": os.path.basename(run.path.rstrip(os.sep)),
        "path": run.path,
        "command": clip(
            shlex.join(redact.redact_argv(command)) if isinstance(command, list) else command, 4000
        ),
        "cwd": clip(m.get("cwd") or "", 400),
        "started": (
            datetime.fromtimestamp(start_ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if start_ns
            else None
        ),
        "duration_s": (end_ns - start_ns) / 1e9 if start_ns and end_ns else None,
        "exit_code": m.get("exit_code"),
        "signal": m.get("signal"),
        "status": m.get("status"),
        "host": {k: clip(v, 300) for k, v in (m.get("host") or {}).items()},
        "gpus": [_gpu_label(g) for g in m.get("gpus") or []],
        "packages": {k: v for k, v in (m.get("packages") or {}).items() if v},
        "env": env,
        "ranks": list(run.ranks),
        "options": {k: v for k, v in (m.get("options") or {}).items() if k != "extra_env"},
    }


def _gpu_label(gpu: Any) -> str:
    if isinstance(gpu, dict):
        name = gpu.get("name") or "GPU"
        mem = gpu.get("memory_total_bytes") or gpu.get("memory_bytes")
        extra = f", {mem / 2**30:.0f} GiB" if isinstance(mem, (int, float)) else ""
        return clip(f"{name}{extra}", 200)
    return clip(gpu, 200)


EVIDENCE_NAMES = {
    "nvml": "GPU metrics (NVML)",
    "gpus": "GPU inventory",
    "pyspy": "py-spy stacks",
    "shim": "in-process events (shim)",
    "trace": "torch.profiler window",
    "torch_profiler": "torch.profiler window",
}


def missing_evidence(run: RunRecord) -> list[dict[str, str]]:
    """What could not be collected, one short line each (a py-spy backtrace is cut to its gist)."""
    out = []
    for what, why in sorted((run.missing or {}).items()):
        lines = [l.strip() for l in str(why).splitlines() if l.strip()]
        gist = next((l for l in lines if not re.match(r"^\d+:", l)), lines[0] if lines else "")
        # "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found" -> the last part
        last = gist.rsplit(": ", 1)[-1]
        short = last if len(last) >= 12 else gist
        out.append(
            {
                "what": clip(what, 100),
                "name": EVIDENCE_NAMES.get(what, what.replace("_", " ")),
                "why": clip(gist, 300),
                "short": clip(short, 200),
                "full": clip(why, 2000),
            }
        )
    return out


def missing_summary(missing: list[dict[str, str]]) -> str:
    """'GPU inventory, GPU metrics (NVML) (NVML Shared Library Not Found)': one entry per reason."""
    by_reason = {}
    for m in missing:
        by_reason.setdefault(m["short"], []).append(m["name"])
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


def _core(run: RunRecord, judgement: Judgement) -> tuple[dict[str, Any], dict[str, Any]]:
    """What both the terminal summary and the HTML report need."""
    meta = run_meta(run)
    t0 = run_t0(run)
    # every step of every rank as columns (a thousand ranks: millions of steps); only the ranks
    # the charts draw become per-step dicts
    compiles = compile_events(run, t0)
    # each step's cause is the judge's (the step columns keep the wall clock the chart draws)
    steps = judgement.steps
    st = steps.table
    worst = _worst_step(st)
    causes = st["cause"][st["cause"] != "normal"] if len(st) else st.get("cause", [])
    cause_counts = {c: int(n) for c, n in causes.value_counts(sort=False).items()} if len(causes) else {}
    losses = losses_of(run)
    median = steps.median_s
    gaps = gaps_table(st, max(1.0, 2 * median)) if median else []  # shorter: not worth a mark
    shown = timeline_ranks(st, worst["rank"] if worst else None) if len(st) else []
    step_rows = rows_of(st, shown) if len(st) else {}
    # missing evidence has its own notice (from the manifest); not repeated as a finding
    findings_view = [
        finding_view(f, compiles, judgement.plans.get(f.id))
        for f in judgement.reading
        if f.id != "evidence.missing"
    ]
    drawn = {
        "t0": t0,
        "step_rows": step_rows,
        "compiles": compiles,
        "worst": worst,
        "step_table": st,
        "cause_counts": cause_counts,
        "losses": losses,
        "gaps": gaps,
    }
    stats = _step_stats(run, steps, meta, drawn)
    stats.update(_gpu_stats(run, judgement.findings))
    # what recording cost the job (the traindx.cost finding): every run states it
    own = next((f for f in judgement.findings if f.id == "traindx.cost"), None)
    stats["cost_line"] = own.title if own is not None else None
    ledger = _ledger(run, stats)
    missing = missing_evidence(run)
    core = {
        "run": meta,
        "ledger": ledger,
        "missing": missing,
        "missing_summary": missing_summary(missing),
        "verdict": verdict_view(judgement.verdict, findings_view),
        "stats": stats,
        "findings": findings_view,
        "causes": dict(judgement.causes),
    }
    return core, drawn


def _gpu_stats(run: RunRecord, findings: Sequence[Finding]) -> dict[str, Any]:
    """MFU as the judge computed it (the gpu.efficiency finding), and the slowest rank's GPU
    time by kernel class as one line (the derived table): only for a GPU run."""
    eff = next((f for f in findings if f.id == "gpu.efficiency"), None)
    out: dict[str, Any] = {"mfu": None, "mfu_note": None, "gpu_classes_line": None}
    if eff is None:
        return out
    out["mfu"] = eff.evidence.get("mfu")
    out["mfu_note"] = eff.evidence.get("mfu_note")
    classes = kernel_class_view(run)
    if classes:
        c = classes[0]
        wall = c["wall_s"] or 1.0
        parts = [
            f"{r['label']} {r['seconds'] / wall:.0%}" for r in c["rows"][:4] if r["seconds"] > 0.01 * wall
        ]
        parts.append(f"idle {c['idle_s'] / wall:.0%}")
        out["gpu_classes_line"] = f"GPU (rank {c['rank']}, per step {fmt_s(c['wall_s'])}) = " + " · ".join(
            parts
        )
    return out


def _worst_step(st: pd.DataFrame) -> dict[str, Any] | None:
    """The longest step of any rank, as the report names it; None without steps."""
    if not len(st):
        return None
    w = st.iloc[int(np.argmax(st["duration_s"].to_numpy(np.float64)))]
    return {
        "step": int(w["step"]),
        "start_s": float(w["start_s"]),
        "end_s": float(w["end_s"]),
        "duration_s": float(w["duration_s"]),
        "compile_s": float(w["compile_s"]),
        "gc_s": float(w["gc_s"]),
        "slow": bool(w["slow"]),
        "cause": w["cause"],
        "rank": w["rank"],
    }


def _step_stats(
    run: RunRecord, steps: StepCauses, meta: dict[str, Any], drawn: dict[str, Any]
) -> dict[str, Any]:
    """The headline step numbers: counts, median and spread, the judged slow steps, the worst,
    compiles, the final loss, the gaps between steps. drawn: what _core drew of the steps."""
    st, median, threshold = steps.table, steps.median_s, steps.slow_threshold_s
    worst, compiles, losses, gaps = drawn["worst"], drawn["compiles"], drawn["losses"], drawn["gaps"]
    durations = st["duration_s"].to_numpy(np.float64)
    # steady state: each rank's first step (warm-up) left out when there is more than one
    steady = durations[steady_mask(st)]
    steady_median = float(np.median(steady)) if len(steady) else None
    mean = float(steady.mean()) if len(steady) else None
    cv = float(np.sqrt(((steady - mean) ** 2).mean()) / mean) if len(steady) and mean else None
    per_rank = st.groupby("rank", sort=False).size() if len(st) else None
    first_rank = st["rank"].iloc[0] if len(st) else None
    return {
        "steps": int(per_rank.max()) if per_rank is not None else 0,
        "ranks": (len(per_rank) if per_rank is not None else 0) or len(meta["ranks"]),
        "ranks_drawn": len(drawn["step_rows"]),
        "step_source": steps.source,
        "median_step_s": median,
        "steady_median_s": steady_median,
        "p90_step_s": float(np.quantile(durations, 0.9)) if len(durations) else None,
        "max_step_s": float(durations.max()) if len(durations) else None,
        "cv": cv,
        "slow_steps": int(st["slow"].sum()) if len(st) else 0,
        "slow_threshold_s": threshold,
        "slow_factor": round(threshold / median, 2) if threshold and median else None,
        "unexplained_steps": drawn["cause_counts"].get("unexplained", 0),
        "compiles": len(compiles),
        "compile_s": sum(c["duration_s"] for c in compiles),
        "worst_step": {k: worst[k] for k in ("rank", "step", "duration_s", "cause")} if worst else None,
        "final_loss": losses[max(losses)] if losses else None,
        "startup_s": float(st["start_s"].iloc[0]) if len(st) else None,
        "gpu_util_in_steps": gpu_util_in_windows(
            run, drawn["t0"], st["start_s"].to_numpy(np.float64), st["end_s"].to_numpy(np.float64)
        ),
        "gap_s": sum(g["duration_s"] for g in gaps if g["rank"] == first_rank),
        "longest_gap": max(
            (g for g in gaps if g["rank"] == first_rank), key=lambda g: g["duration_s"], default=None
        ),
    }


def _ledger(run: RunRecord, stats: dict[str, Any]) -> dict[str, Any]:
    """The time ledger's view; its line and the start-up's (one start-up value everywhere: the
    ledger's, process start to the first step) go into `stats`."""
    try:
        ledger = ledger_view(run)
    except Exception as exc:  # the report still renders without its ledger
        ledger = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    stats["ledger_line"] = ledger.get("line")
    stats["startup_line"] = None
    if ledger.get("available") and len(run.startup_ledger):
        start = run.startup_ledger
        start = start[start["rank"] == ledger["rank"]] if (start["rank"] == ledger["rank"]).any() else start
        stats["startup_line"] = startup_text(start.iloc[0])
        stats["startup_s"] = float(start.iloc[0]["wall_s"])
    return ledger


def build_summary(run: RunRecord, judgement: Judgement) -> dict[str, Any]:
    """The verdict, headline numbers and ranked findings: what the terminal prints."""
    return _core(run, judgement)[0]


def build_report_data(
    run: RunRecord, judgement: Judgement, comparison: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Everything the HTML report shows, as plain JSON-able values."""
    data, x = _core(run, judgement)
    t0, step_rows, compiles, st = x["t0"], x["step_rows"], x["compiles"], x["step_table"]
    compile_s, compile_n = {}, {}
    for c in compiles:
        compile_s[c["rank"]] = compile_s.get(c["rank"], 0.0) + c["duration_s"]
        compile_n[c["rank"]] = compile_n.get(c["rank"], 0) + 1
    ranks_summary = []
    if len(st):
        g = st.groupby("rank", sort=False)
        table = g["duration_s"].agg(["size", "median", "max"])
        table["p90"] = g["duration_s"].quantile(0.9)
        table["slow"] = g["slow"].sum()
        for rank, r in table.iterrows():
            ranks_summary.append(
                {
                    "rank": rank,
                    "steps": int(r["size"]),
                    "median_s": float(r["median"]),
                    "p90_s": float(r["p90"]),
                    "max_s": float(r["max"]),
                    "compile_s": compile_s.get(rank, 0.0),
                    "compiles": compile_n.get(rank, 0),
                    "slow_steps": int(r["slow"]),
                }
            )
    end_s = max(
        [data["run"]["duration_s"] or 0.0]
        + ([float(st["end_s"].max())] if len(st) else [])
        + [c["end_s"] for c in compiles]
    )
    log = run.log
    log_tail = (
        [
            {"t_s": (int(r.t) - t0) / 1e9, "stream": r.stream, "text": clip(r.text, 500)}
            for r in log.tail(MAX_LOG_LINES).itertuples()
        ]
        if len(log)
        else []
    )
    data.update(
        {
            "timeline": {
                "end_s": end_s,
                "ranks": {r: bin_steps(rows) for r, rows in step_rows.items()},
                "ranks_total": data["stats"]["ranks"],
                "cause_counts": x["cause_counts"],
                "gaps": x["gaps"][:200],
                # start-up and gaps taking most of the run squeeze the steps: show them by step
                "default_view": "step"
                if end_s and ((data["stats"]["startup_s"] or 0) + data["stats"]["gap_s"]) > 0.5 * end_s
                else "time",
                "bin_size": max((math.ceil(len(r) / MAX_STEP_BARS) for r in step_rows.values()), default=1),
                "losses": x["losses"] if len(x["losses"]) <= MAX_STEP_BARS else {},
            },
            "compiles": compiles[:MAX_COMPILE_ROWS],
            "compiles_total": len(compiles),
            "compile_groups": compile_groups(compiles),
            "gil": worst_rank_first(gil_view(run), x["worst"]),
            "lanes": thread_lanes(run, t0, x["worst"], compiles, step_rows),
            "gpu": gpu_view(run, t0),
            "gpu_time": gpu_time_view(run),
            "ranks_summary": ranks_summary,
            "log_tail": log_tail,
            "comparison": comparison_view(comparison),
        }
    )
    return data
