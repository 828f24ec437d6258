"""First-use costs and Triton autotuning: the cold start of every kernel (compiles and the
first steps' autotune benchmarking, FLA's included) and a kernel that autotunes again after
warm-up because its key changes (its recompiles folded in: one cause, one finding)."""

from __future__ import annotations

import collections
import os
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.jit import autotune_advice
from traindx.analyzers.jit.common import (
    col,
    compile_severity,
    frame_where,
    key_history,
    ledger_cost,
    precompile_prescription,
    steps_after,
)

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

# Inductor's max-autotune benchmarks its templates inside the torch.compile compile: py-spy sees
# it in these files (no shim event times it)
_INDUCTOR_AUTOTUNE_FILES = (
    "torch/_inductor/select_algorithm.py",
    "torch/_inductor/autotune_process.py",
    "torch/_inductor/runtime/benchmarking.py",
)


def first_step_rows(group: pd.DataFrame) -> Any:
    """The rows of one kernel's events in the step of its first event (its cold start)."""
    first = col(next(group.itertuples()), "step")
    if first is None:
        return group.iloc[:1]
    return group[group["step"].fillna(first) <= first]


def inductor_autotune_seconds(run: RunRecord, rank: str) -> Any:
    """py-spy seconds of Inductor's max-autotune benchmarking on `rank` (any thread), or 0."""
    rec = run.pyspy.get((rank, "all")) if hasattr(run, "pyspy") else None
    total = 0.0
    for samples in (rec or {}).values():
        for stack, weight in zip(samples.stacks, samples.weights):
            if any(
                any(f in (fr.file or "").replace("\\", "/") for f in _INDUCTOR_AUTOTUNE_FILES) for fr in stack
            ):
                total += weight
    return total


def cold_start_finding(
    run: RunRecord, rank: str, firsts: pd.DataFrame, steps: pd.DataFrame, tunes: pd.DataFrame | None = None
) -> Finding | None:
    """First use of every kernel: its compiles and, for an autotuned kernel, the benchmarking of
    its first keys (Triton's and FLA's autotuners; Inductor's max-autotune as py-spy saw it).
    Paid once per process (and per rank, per restart); a warm-up before training removes it."""
    tunes = tunes if tunes is not None else pd.DataFrame(columns=["duration_s", "kind"])
    if not len(firsts) and not len(tunes):
        return None
    compile_s = float(firsts["duration_s"].sum()) if len(firsts) else 0.0
    tune_s = float(tunes["duration_s"].sum()) if len(tunes) else 0.0
    kinds = collections.Counter(firsts["kind"]) if len(firsts) else collections.Counter()
    inductor_s = inductor_autotune_seconds(run, rank) if kinds.get("dynamo") else 0.0
    total = compile_s + tune_s
    run_s = float(steps["duration_s"].sum()) if len(steps) else None
    share = (total / run_s) if run_s else None
    if share is not None:
        share = min(share, 1.0)
    both = pd.concat([firsts, tunes]) if len(tunes) else firsts
    per_kernel = [
        {
            "kernel": r.kernel,
            "kind": r.kind,
            "seconds": round(float(r.duration_s), 3),
            "step": col(r, "step"),
            "thread": col(r, "thread"),
        }
        for r in both.sort_values("duration_s", ascending=False).itertuples()
    ][:12]
    severity = "medium" if (share or 0) >= 0.25 else "low" if (share or 0) >= 0.05 else "info"
    if (
        set(kinds) == {"dynamo"}
        and not len(tunes)
        and not _inductor_caches_off(run)
        and inductor_s < 0.5 * compile_s
    ):
        # torch.compile alone, its caches on (the default): a one-time cost with no lever the
        # job has not already pulled; a short diagnose run only makes its share look large
        severity = "info"
    # a one-time cost: not "per step" (it would outrank a recompile that costs every step)
    amortized = None
    prescriptions, advice_evidence = _cold_prescriptions(run, firsts, tunes, kinds)
    n_tuned = tunes["kernel"].nunique() if len(tunes) else 0
    title, what = _cold_text(firsts, kinds, compile_s, tune_s, inductor_s, n_tuned, bool(len(tunes)))
    return Finding(
        id="jit.cold_start",
        title=title,
        severity=severity,
        analyzer="jit",
        summary=(
            f"On rank {rank}: {'; '.join(what)}"
            + (f", {share:.0%} of the {run_s:.1f} s of recorded steps" if share is not None else "")
            + ". Paid once per process, on every rank and every restart."
        ),
        steps_affected=tuple(sorted(int(s) for s in set(both["step"].dropna()))),
        seconds_lost_per_step=amortized,
        share_of_step=share,
        evidence={
            "rank": rank,
            "cold_compile_seconds": round(compile_s, 3),
            "cold_autotune_seconds": round(tune_s, 3),
            "inductor_autotune_sampled_seconds": round(inductor_s, 3),
            "cold_seconds": round(total, 3),
            "kernels": per_kernel,
            "kinds": dict(kinds),
            "recorded_step_seconds": run_s,
            **advice_evidence,
        },
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
    )


def _cold_prescriptions(
    run: RunRecord, firsts: pd.DataFrame, tunes: pd.DataFrame, kinds: collections.Counter[str]
) -> tuple[list[Prescription], dict[str, Any]]:
    """(fixes, the autotune advice's evidence) of a cold start: warm the first keys' tuning
    before training, precompile FA4, keep the compiled kernels and graphs on disk."""
    prescriptions: list[Prescription] = []
    advice_evidence: dict[str, Any] = {}
    if len(tunes):
        # the first keys' benchmarking: replayed before training by kernel-cache warm, its
        # choices and compiled kernels kept on disk (autotune_advice: the switches the installed
        # Triton / FLA read)
        advice = _advice(run, tunes)
        prescriptions.extend(advice.cold)
        advice_evidence = advice.evidence()
    fa4 = firsts[firsts["kind"] == "cute_dsl"] if len(firsts) else firsts
    if len(fa4):
        prescriptions.insert(
            0,
            precompile_prescription(
                run, None, note=f" (saves ~{float(fa4['duration_s'].sum()):.1f} s at every start)"
            ),
        )
    persistent = any("TRITON_CACHE_DIR" in (p.change.get("env") or {}) for p in prescriptions)
    if kinds.get("triton") and not persistent:
        prescriptions.append(
            Prescription(
                kind="env",
                summary="keep Triton's compiled kernels on a persistent disk "
                "(TRITON_CACHE_DIR) so later runs load them",
                change={"env": {"TRITON_CACHE_DIR": beside_runs(run, "triton-cache")}},
                automatic=True,
                expected_gain_s_per_step=None,
            )
        )
    if kinds.get("dynamo"):
        prescriptions.append(_inductor_cache_prescription(run))
    return prescriptions, advice_evidence


def _cold_text(
    firsts: pd.DataFrame,
    kinds: collections.Counter[str],
    compile_s: float,
    tune_s: float,
    inductor_s: float,
    n_tuned: int,
    tuned: bool,
) -> tuple[str, list[str]]:
    """(title, what the cold start spent) of a cold start."""
    kinds_text = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    n_compiled = firsts["kernel"].nunique() if len(firsts) else 0
    if tuned:
        title = (
            f"Cold start: {tune_s:.1f} s autotuning {n_tuned} kernel(s) and {compile_s:.1f} s "
            f"compiling {n_compiled} in the first steps"
        )
    elif inductor_s >= 0.5 * compile_s and inductor_s > 0:
        title = (
            f"Cold start: torch.compile {compile_s:.1f} s, ~{inductor_s:.1f} s of it "
            "Inductor's max-autotune benchmarking"
        )
    else:
        title = f"Cold start: {n_compiled} kernel(s) compiled on first use, {compile_s:.1f} s"
    what = []
    if tune_s:
        what.append(f"autotuning the first keys of {n_tuned} kernel(s) {tune_s:.1f} s")
    if compile_s:
        what.append(
            f"first compiles ({kinds_text}) {compile_s:.1f} s"
            + (f", of which ~{inductor_s:.1f} s Inductor max-autotune (py-spy)" if inductor_s else "")
        )
    return title, what


def _advice(run: RunRecord, rows: pd.DataFrame) -> autotune_advice.Advice:
    """autotune_advice's switches for these autotune events, as the installed Triton / FLA read them."""
    return autotune_advice.advise(
        rows.to_dict("records"),
        run.manifest.get("packages"),
        env=run.manifest.get("env") or run.manifest.get("environment"),
        run_path=run.path,
        cache_dir=beside_runs(run, "triton-cache"),
        config_dir=beside_runs(run, "fla-configs"),
    )


def _inductor_caches_off(run: RunRecord) -> Any:
    env = run.manifest.get("env") or {}
    return [
        name
        for name in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
        if str(env.get(name, "")).strip() == "0"
    ]


def _inductor_cache_prescription(run: RunRecord) -> Prescription:
    """torch.compile's cold start: its FX graph and AOTAutograd caches are on by default (torch
    2.13), so there is nothing to switch on. Never relocate a cache the user already placed (a
    fresh folder would make the next run cold); where none is set, the default folder is under
    /tmp, which restarts and new machines lose: a persistent one is worth it, but a single
    --fix run cannot show the gain (its first run fills the new folder), so it is not automatic."""
    env = run.manifest.get("env") or {}
    user_dir = env.get("TORCHINDUCTOR_CACHE_DIR")
    disabled = _inductor_caches_off(run)
    if disabled:
        return Prescription(
            kind="env",
            summary=f"torch.compile's caches are switched off here ({', '.join(n + '=0' for n in disabled)}): "
            "unset them so later runs load the compiled graphs",
            change={"env": dict.fromkeys(disabled, "1")},
            automatic=True,
        )
    if user_dir:
        return Prescription(
            kind="env",
            summary=f"torch.compile's FX graph cache is already on (the default) and kept in "
            f"{user_dir}: a later run of the same code loads the graphs from "
            "there; nothing to change",
        )
    return Prescription(
        kind="env",
        summary="torch.compile's FX graph cache is already on (the default), in a "
        "folder under /tmp: keep it on a persistent disk "
        "(TORCHINDUCTOR_CACHE_DIR) so restarts and the job's other machines "
        "reuse it",
        change={"env": {"TORCHINDUCTOR_CACHE_DIR": beside_runs(run, "inductor-cache")}},
        automatic=False,
    )


_FLA_PATH = re.compile(r"[/\\]fla[/\\]")


def beside_runs(run: RunRecord, name: Any) -> Any:
    """A persistent cache folder next to the run folders (the runs' parent)."""
    return os.path.abspath(os.path.join(run.path, os.pardir, name))


def autotune_finding(
    run: RunRecord,
    rank: str,
    kernel: str,
    group: pd.DataFrame,
    steps: pd.DataFrame,
    recompiles: pd.DataFrame | None = None,
) -> Finding | None:
    """A kernel that autotunes again after its first step; `recompiles`: the Triton compiles of
    that kernel after its first step (each new key compiles the configs it benchmarks): the same
    cause, so their seconds are this finding's, not a second finding's."""
    if len(group) < 2:
        return None
    changed, _, example, _ = key_history(group)
    first_step = int(col(next(group.itertuples()), "step") or 0)
    later = group[group["step"].fillna(-1) > first_step]
    if not len(later):
        return None
    lost, share, folded, compile_lost = _autotune_cost(run, rank, group, steps, first_step, later, recompiles)
    fields = [f for f, _ in changed.most_common()]
    key_names = next(
        (col(r, "key_names") for r in group.itertuples() if isinstance(col(r, "key_names"), list)), None
    )
    fields = [f for f in fields if not key_names or f in key_names] or fields
    prescriptions, advice_evidence = _autotune_prescriptions(run, kernel, group, fields, lost)
    return Finding(
        id="jit.autotune",
        title=f"Triton autotunes {kernel} again after warm-up "
        f"(key field(s) changing: {', '.join(fields) or '?'})",
        severity=compile_severity(share, steady=True),
        analyzer="jit",
        summary=(
            f"{kernel} autotuned {len(later)} more time(s) after step {first_step}, "
            f"{lost:.2f} s per step"
            + (
                f" (with the {len(folded)} compile(s) of the configs it benchmarked, "
                f"{compile_lost:.2f} s per step)"
                if len(folded)
                else ""
            )
            + f"; the autotune key changes: {', '.join(fields) or '?'}"
            + (f" (e.g. {example})" if example else "")
            + "."
        ),
        steps_affected=tuple(sorted(int(s) for s in set(later["step"].dropna()))),
        seconds_lost_per_step=lost,
        share_of_step=share,
        removes={
            "categories": ["autotune", "compile"] if len(folded) else ["autotune"],
            "steps": sorted(int(s) for s in set(later["step"].dropna())),
        },
        evidence={
            "rank": rank,
            "kernel": kernel,
            "autotunes": int(len(group)),
            "recompiles_while_tuning": int(len(folded)),
            "recompile_seconds_per_step": round(compile_lost, 4),
            "changing_key_fields": fields,
            "key_change_example": example,
            "seconds_each": [round(float(x), 3) for x in group["duration_s"]],
            **advice_evidence,
        },
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
    )


def _autotune_cost(
    run: RunRecord,
    rank: str,
    group: pd.DataFrame,
    steps: pd.DataFrame,
    first_step: int,
    later: pd.DataFrame,
    recompiles: pd.DataFrame | None,
) -> tuple[float, float | None, pd.DataFrame, float]:
    """(seconds lost per step, its share of a step, the compiles folded in, their seconds per
    step) of a kernel's autotuning after its first step."""
    after = steps_after(steps, first_step)
    n_after = max(len(after), 1)
    lost = float(later["duration_s"].sum()) / n_after
    median_after = float(after["duration_s"].median()) if len(after) else None
    share = min(lost / median_after, 1.0) if median_after else None
    lost, share = ledger_cost(run, rank, after, lost, share, "autotune")
    folded = (
        recompiles[recompiles["step"].fillna(-1) > first_step] if recompiles is not None else group.iloc[0:0]
    )
    compile_lost = 0.0
    if len(folded):
        compile_lost, _ = ledger_cost(
            run, rank, after, float(folded["duration_s"].sum()) / n_after, None, "compile"
        )
        lost += compile_lost
        share = min(lost / median_after, 1.0) if median_after else share
    return lost, share, folded, compile_lost


def _autotune_prescriptions(
    run: RunRecord, kernel: str, group: pd.DataFrame, fields: list[str], lost: float
) -> tuple[list[Prescription], dict[str, Any]]:
    """(fixes, the autotune advice's evidence) of a kernel that autotunes again: FLA's own
    switches for FLA's kernels, else the key field out of @triton.autotune; Triton's cache."""
    # flash-linear-attention's own switches only when its code is the kernel's (module path),
    # not because the package is installed next to a kernel of the job's own
    is_fla = any(
        _FLA_PATH.search(str(col(r, "kernel_file") or (col(r, "caller") or {}).get("file", "")))
        or str(col(r, "module") or "").startswith("fla.")
        for r in group.itertuples()
    )
    caller = (
        next((col(r, "caller") for r in group.itertuples() if isinstance(col(r, "caller"), dict)), None) or {}
    )
    kernel_file = next((col(r, "kernel_file") for r in group.itertuples() if col(r, "kernel_file")), None)
    prescriptions: list[Prescription] = []
    advice_evidence: dict[str, Any] = {}
    if is_fla:
        # FLA's own settings, only those the installed releases read and that change something
        # (checked against their source: docs/autotune.md)
        advice = _advice(run, group)
        prescriptions.extend(
            p if p.expected_gain_s_per_step is not None else replace(p, expected_gain_s_per_step=lost)
            for p in advice.steady
        )
        advice_evidence = advice.evidence()
    if not is_fla and fields:
        where = frame_where(caller, run)
        prescriptions.append(
            Prescription(
                kind="code",
                summary=f"take {', '.join(fields)} out of @triton.autotune(key=[...]) of {kernel} "
                f"(launched at {where or '?'}): every new value benchmarks all "
                f"{col(next(group.itertuples()), 'configs') or ''} configs again; or bucket "
                f"it at the launch (triton.next_power_of_2({fields[0]}))",
                change={
                    "code": {
                        "autotune_key": {
                            "kernel": kernel,
                            "drop": fields,
                            "files": [f for f in (kernel_file, caller.get("file")) if f],
                        },
                        "file": kernel_file or caller.get("file"),
                        "line": None,
                        "before": f"key={fields!r}",
                        "after": None,
                    }
                },
                expected_gain_s_per_step=lost,
                automatic=True,
            )
        )
    else:
        prescriptions.append(
            Prescription(
                kind="code",
                summary=f"take {', '.join(fields) or 'the changing argument'} out of the "
                f"autotune key of {kernel} (or bucket it): every new value tunes again",
                change={"code": {"file": None, "line": None, "before": f"key={fields}", "after": None}},
                expected_gain_s_per_step=lost,
            )
        )
    prescriptions.append(
        Prescription(
            kind="env",
            summary="keep Triton's cache on a persistent disk (TRITON_CACHE_DIR)",
            change={"env": {"TRITON_CACHE_DIR": beside_runs(run, "triton-cache")}},
            automatic=not is_fla,
            expected_gain_s_per_step=None,
        )
    )
    return prescriptions, advice_evidence
