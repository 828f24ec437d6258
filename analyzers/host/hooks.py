"""The job's code that torch runs inside the model's work: module forward/backward hooks, global
module hooks and tensor hooks whose function is the job's (or a framework's) code.

The ledger books the shim's hook spans as host time, never as fwd/bwd; a hook costing MIN_SHARE
of the steady step is a finding of its own. `--fix` measures the step without it: a hook that
only observes changes no numerics, and loss parity checks that."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription, RuntimePatch
from traindx.analyzers.host.code import display_path
from traindx.derive import ledger

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="hooks",
    order=115,
    ids=("hooks.in_step",),
    explains=("steps.instability", "gpu_idle.host_starved", "host_work.code", "ranks.straggler"),
)

MIN_SHARE = 0.03
SKIP_PREFIX = "skip_hook@"  # the shim's runtime patch: hooktime.SKIP_PREFIX


def hook_sites(run: RunRecord) -> pd.DataFrame:
    """The job's hooks the shim timed: rank, id, kind, function, file, line (of its def)."""
    sites = run.of_type("hook_site")
    cols = ["rank", "id", "kind", "function", "file", "line"]
    if not len(sites):
        return pd.DataFrame(columns=cols)
    return sites[[c for c in cols if c in sites]].drop_duplicates(["rank", "id"], keep="last")


def hook_functions(run: RunRecord) -> set[tuple[str, str]]:
    """(function, file) of every hook the shim timed: host_work leaves their lines to this analyzer."""
    sites = hook_sites(run)
    return {(str(f), str(p)) for f, p in zip(sites["function"], sites["file"])}


def _per_site(run: RunRecord, rank: str, led: pd.DataFrame) -> dict[int, float]:
    """Seconds per steady step of each hook site of the rank."""
    spans = run.of_type("span")
    if not len(spans) or "site" not in spans:
        return {}
    mine = spans[(spans["cat"] == "hook") & (spans["rank"] == rank)]
    if not len(mine):
        return {}
    rows = led.sort_values("start_ns")
    ws = rows["start_ns"].to_numpy(np.int64)
    we = rows["end_ns"].to_numpy(np.int64)
    start = mine["start"].astype("int64").to_numpy()
    i = np.searchsorted(ws, start, side="right") - 1
    inside = (i >= 0) & (start < we[np.maximum(i, 0)])
    dur = (mine["t"].astype("int64").to_numpy() - start) / 1e9
    per = pd.Series(dur[inside]).groupby(mine["site"].to_numpy()[inside]).sum() / len(rows)
    return {int(k): float(v) for k, v in per.items()}


def _inner_line(
    run: RunRecord, rank: str, steps: set[int], function: str, file: str
) -> dict[str, Any] | None:
    """The dearest line inside the hook and the call it ends in (the shim's host samples)."""
    code = ledger.host_code(run)
    if not len(code):
        return None
    rows = code[
        (code["rank"] == rank)
        & code["step"].isin(steps)
        & (code["function"] == function)
        & (code["file"] == file)
    ]
    if not len(rows):
        return None
    g = rows.groupby(["line", "call"], dropna=False)["seconds"].sum().sort_values(ascending=False)
    line, call = g.index[0]
    if isinstance(call, str):  # torch's functions as users write them
        call = call.replace("torch._VariableFunctionsClass.", "torch.").replace(
            "torch._C.TensorBase.", "Tensor."
        )
    return {"line": int(line), "call": call if isinstance(call, str) else None}


def _finding(
    run: RunRecord, rank: str, site: Any, seconds: float, led: pd.DataFrame, steps: set[int]
) -> Finding:
    step_s = float(led["wall_s"].mean())
    host_s = float(led["host_s"].mean())
    cwd = run.manifest.get("cwd")
    path = display_path(str(site["file"]), cwd)
    where = f"{path}:{int(site['line'])}"
    share = seconds / step_s
    inner = _inner_line(run, rank, steps, str(site["function"]), str(site["file"]))
    inside = ""
    if inner:
        inside = f"; most of it at line {inner['line']}" + (f" ({inner['call']})" if inner["call"] else "")
    kind = str(site["kind"])
    summary = (
        f"The {kind} {site['function']}() defined at {where} runs inside the model's "
        f"{'backward' if 'backward' in kind or 'tensor' in kind else 'forward'} on every call: "
        f"{seconds * 1e3:.1f} ms a step ({share:.0%}){inside}. It is the job's code, not the "
        "model's compute."
    )
    patch = f"{SKIP_PREFIX}{os.path.realpath(str(site['file']))}:{int(site['line'])}"
    pres = (
        Prescription(
            kind="runtime",
            summary=(
                f"take the {kind} {site['function']}() at {where} out of the step, or register it only "
                "on the steps that log its result (--fix measures the step without it)"
            ),
            change=RuntimePatch(patch=patch),
            expected_gain_s_per_step=seconds,
            automatic=True,
        ),
        Prescription(
            kind="code",
            summary=(
                f"register the {kind} at {where} only for the steps that log its result (remove it "
                "with the handle register_*_hook returns), or keep its statistics on the device "
                "without .item() and host-side histograms"
            ),
        ),
    )
    return Finding(
        id="hooks.in_step",
        title=f"A {kind} in the step: {site['function']}() at {where}, {seconds * 1e3:.1f} ms a step ({share:.0%})",
        severity=ev.severity_for_share(share),
        analyzer="hooks",
        summary=summary,
        seconds_lost_per_step=seconds,
        share_of_step=share,
        ranks=(rank,),
        evidence={
            "rank": rank,
            "kind": kind,
            "function": site["function"],
            "file": path,
            "path": site["file"],
            "line": int(site["line"]),
            "inner_line": inner["line"] if inner else None,
            "call": inner["call"] if inner else None,
            "seconds_per_step": round(seconds, 5),
        },
        prescriptions=pres,
        removes={"categories": ["host"], "fraction": min(1.0, seconds / host_s) if host_s > 0 else 1.0},
    )


def analyze(run: RunRecord) -> list[Finding]:
    sites = hook_sites(run)
    if not len(sites) or not len(run.ledger):
        return []
    findings = []
    for rank in sorted(set(sites["rank"]), key=str):
        led = ledger.steady_rows(run, rank)
        if not len(led):
            continue
        step_s = float(led["wall_s"].mean())
        steps = set(led["step"].astype(int))
        mine = sites[sites["rank"] == rank].set_index("id")
        for sid, seconds in sorted(_per_site(run, rank, led).items(), key=lambda kv: -kv[1]):
            if sid not in mine.index or step_s <= 0 or seconds / step_s < MIN_SHARE:
                continue
            findings.append(_finding(run, rank, mine.loc[sid], seconds, led, steps))
    return findings
