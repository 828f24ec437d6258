"""ranks at their meeting points (the shim's collective spans matched across ranks, each backward
of a DDP job, or each step of a CUDA job): the rank that arrived last again and again, what it
cost the others, and the ledger lines that made it late."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.ranks import sync_points as sp
from traindx.analyzers.ranks.waits import (
    MIN_SHARE,
    MIN_WAIT_DIFF_S,
    compiles_on,
    in_collective,
    pyspy_waits,
    trace_waits,
    what_straggler_does,
)
from traindx.derive import ledger as ledger_mod

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

if TYPE_CHECKING:  # annotations only
    pass


# the straggler must have caused most of the waiting: in a healthy job the last arrival changes
# from one collective to the next and the costs spread over the ranks
MIN_DOMINANCE = 0.6
MIN_LATE_STEPS = 3  # steady steps in which it made the others wait ...
MIN_LATE_STEP_SHARE = MIN_SHARE  # ... at least this share of a median step (and 5 ms)


# -- 1. meeting points: who arrived last, what it cost, why -------------------------------------
CAUSES = {  # ledger line before the late arrival -> what the user reads
    "compile": "compiling",
    "autotune": "autotuning kernels",
    "gc": "garbage collection",
    "traindx": "traindx's own recording (its step-end work)",
    "io": "checkpoint/file I/O",
    "sync": "waiting for its GPU (host-device sync)",
    "data": "waiting for its data",
    "optimizer": "its optimizer step",
    "forward_backward": "compute (forward/backward)",
    "host": "its own code between measured calls",
    "unexplained": "untimed host work",
    "collective": "waiting in other communication (send/recv, another group)",
}
SLOWER_CLOCK = 0.9  # the straggler's GPU at <= 90 % of the others' SM clock: a slower GPU


def _steady_ids(run: RunRecord, ranks: list[Any]) -> Any:
    steady = ev.steady_steps(run)
    return {r: set(g.astype(int)) for r, g in steady.groupby("rank")["step"]}


def _median_steps(run: RunRecord, ranks: list[Any]) -> Any:
    """{rank: median steady step seconds} from one pass (ev.median_step_s per rank rescans)."""
    steady = ev.steady_steps(run)
    med = steady.groupby("rank")["duration_s"].median().to_dict() if len(steady) else {}
    return {r: (float(med[r]) if r in med else ev.median_step_s(run, r)) for r in ranks}


def steady_ledger(run: RunRecord) -> Any:
    """ledger_mod.steady_rows(run), by a join instead of a Python scan of the rows."""
    steady = ev.steady_steps(run)
    led = run.ledger
    if not len(steady) or not len(led):
        return led.iloc[0:0]
    keys = steady[["rank", "step"]].astype({"step": "int64"})
    return led.astype({"step": "int64"}).merge(keys, on=["rank", "step"], how="inner")


def _gpu_clocks(run: RunRecord, ranks: list[Any]) -> Any:
    """{rank: median SM clock (MHz) of its GPU while busy} when NVML sampled one GPU per rank
    (the rank's LOCAL_RANK-th of the job's GPUs, the usual one-GPU-per-rank launch)."""
    gpu = run.gpu
    chosen = (run.manifest.get("nvml") or {}).get("gpus") or []
    ev_ = run.of_type("process_start")
    if not len(gpu) or not chosen or not len(ev_) or "local_rank" not in ev_:
        return {}
    starts = ev_[ev_["rank"].isin(ranks)]
    out = {}
    for rank, local in zip(starts["rank"], starts["local_rank"]):
        try:
            index = chosen[int(local)]
        except (TypeError, ValueError, IndexError):
            continue
        rows = gpu[(gpu["gpu"] == index) & (gpu["util"] >= 50)]
        if len(rows):
            out[rank] = float(rows["sm_clock_mhz"].median())
    return out


def _late_cause(run: RunRecord, seg: pd.DataFrame, straggler: Any, late_keys: Any, n_steps: int) -> Any:
    """Seconds per step of each ledger line by which the straggler's stretch before its late
    arrivals exceeds the other ranks' stretch before the same meeting points."""
    cats = list(ledger_mod.CATEGORIES) + ["unexplained"]
    per_rank = {}
    for rank, rows in seg[seg["key"].isin(late_keys)].groupby("rank"):
        secs = sp.segment_ledger(
            run, rank, rows["seg_start_ns"].to_numpy(np.int64), rows["start_ns"].to_numpy(np.int64)
        )
        per_rank[rank] = secs.sum(axis=0)
    if straggler not in per_rank or len(per_rank) < 2:
        return {}
    others = np.mean([v for r, v in per_rank.items() if r != straggler], axis=0)
    excess = (per_rank[straggler] - others) / max(1, n_steps)
    return {c: float(x) for c, x in zip(cats, excess) if x > 0.0005}  # sub-ms: noise


def step_points(run: RunRecord) -> Any:
    """CUDA runs: NCCL collectives return to the host at once (the GPU waits, not the host), and
    the host waits later, in its next sync (.item(), synchronize). There each step is the
    meeting point and a rank's wait is its step's host-sync plus collective lines: the rank
    that waited least there was the one the others' GPUs waited for."""
    led = steady_ledger(run)
    if not len(led):
        return led
    counts = led.groupby("step")["rank"].transform("nunique")
    led = led[counts == led["rank"].nunique()]
    return pd.DataFrame(
        {
            "key": led["step"].astype("int64"),
            "rank": led["rank"],
            "op": "host sync + collectives of the step",
            "group": "step",
            "start_ns": led["start_ns"].astype("int64"),
            "end_ns": led["end_ns"].astype("int64"),
            "wait_s": led["sync_s"] + led["collective_s"],
        }
    ).reset_index(drop=True)


def _step_cause(run: RunRecord, straggler: Any, late_steps: Any, n_steps: int) -> Any:
    """By step: the straggler's ledger lines (waits left out) beyond the others' in those steps."""
    led = steady_ledger(run)
    led = led[led["step"].isin(late_steps)]
    cats = [c for c in list(ledger_mod.CATEGORIES) + ["unexplained"] if c not in ("sync", "collective")]
    sums = led.groupby("rank")[[f"{c}_s" for c in cats]].sum()
    if straggler not in sums.index or len(sums) < 2:
        return {}
    excess = (sums.loc[straggler] - sums.drop(index=straggler).mean()) / max(1, n_steps)
    return {c: float(x) for c, x in zip(cats, excess.to_numpy()) if x > 0.0005}


def syncs_every_step(run: RunRecord) -> Any:
    """CUDA runs in which every rank's host waits for its GPU in (nearly) every steady step: only
    there does a step's sync line hold the wait for the others (a rank that never syncs runs
    ahead of its GPU, and its waits land wherever its launch queue fills up)."""
    spans = run.spans
    if not len(spans) or not (spans["cat"] == "sync").any():
        return False
    led = steady_ledger(run)
    if not len(led):
        return False
    return bool(((led["sync_s"] > 0).groupby(led["rank"]).mean() >= 0.8).all())


def _core_wait_excess(run: RunRecord, straggler: Any, ranks: list[Any], steps: pd.Index) -> Any:
    """Per step (a Series over `steps`) the seconds the straggler's training thread waited for a
    core beyond the other ranks' mean in the same step (the shim's run-queue wait), or None
    when the run has no such record."""
    rows = run.steps.dropna(subset=["start_ns", "end_ns"])
    rows = rows[rows["rank"].astype(str).isin([str(r) for r in ranks])]
    if not len(rows):
        return None
    runq = ev.step_runq_s(
        run, rows["rank"], rows["step"], rows["end_ns"].to_numpy(float) / 1e9, rows["duration_s"]
    )
    if runq is None:
        return None
    table = pd.DataFrame(
        {
            "rank": rows["rank"].astype(str).to_numpy(),
            "step": rows["step"].astype("int64").to_numpy(),
            "runq": runq,
        }
    )
    wide = table.pivot_table(index="step", columns="rank", values="runq", aggfunc="first")
    mine = str(straggler)
    if mine not in wide or wide.shape[1] < 2:
        return None
    others = wide.drop(columns=mine).mean(axis=1)
    excess = (wide[mine] - others).clip(lower=0.0).fillna(0.0)
    return excess.reindex(pd.Index(steps).astype("int64")).fillna(0.0).set_axis(steps)


def _steady_last_arrivals(
    points: pd.DataFrame, steps: pd.DataFrame, steady: dict[Any, set[int]]
) -> pd.DataFrame | None:
    """The last arrival at each meeting point (sync_points.last_arrivals) with its arrival and
    its step, kept where that step is one of the late rank's steady steps; None when none is."""
    last = sp.last_arrivals(points)
    if not len(last):
        return None
    arrival = points[["key", "rank", "start_ns"]].rename(columns={"rank": "last", "start_ns": "arrival_ns"})
    last = last.merge(arrival, on=["key", "last"], how="left")
    last["step"] = -1
    for rank, rows in last.groupby("last"):
        last.loc[rows.index, "step"] = sp.step_of(steps, rank, rows["arrival_ns"].to_numpy(np.int64))
    keep = np.zeros(len(last), dtype=bool)
    for rank, rows in last.groupby("last"):
        keep[last.index.get_indexer(rows.index)] = rows["step"].isin(steady.get(rank, ())).to_numpy()
    last = last[keep]
    return last if len(last) else None


def _points_method(run: RunRecord, by_step: bool) -> str:
    return (
        "steps as meeting points (CUDA: collectives return to the host at "
        "once; the host waits in its next sync): the rank whose step has the "
        "least host-sync + collective time was the last"
        if by_step
        else "meeting points matched across ranks (collectives by process group and "
        "seq"
        + ("; each backward of the DDP job" if sp.uses_ddp(run) else "")
        + "): the rank that waited least arrived last"
    ) + "; durations only, no clock compared across ranks"


def _repeated_cost(
    run: RunRecord,
    ranks: list[Any],
    last: pd.DataFrame,
    straggler: Any,
    n_steps: int,
    cost: float,
    median_step: float | None,
    detail: dict[str, Any],
) -> tuple[float, float, int, float]:
    """(cost per step, its share of the median step, late steps, cost per step without the
    worst step) of the straggler: on one host, less its extra wait for a core."""
    # late again and again, not once: a rank descheduled for 200 ms in one step (a loaded
    # machine, a page fault storm) is no straggler; its worst step alone must not make the cost
    per_step = last[last["last"] == straggler].groupby("step")["cost_s"].sum()
    queued = _core_wait_excess(run, straggler, ranks, per_step.index)
    if queued is not None and not run.manifest.get("nodes"):
        # one host: every rank waits for the same cores, so the time the straggler's training
        # thread waited for one beyond the others in its late steps is the machine's load, not
        # the rank's (a rank on another node that waits for its cores stays a straggler)
        per_step = (per_step - queued).clip(lower=0.0)
        queued_s = float(queued.sum())
        cost = max(0.0, cost - queued_s / n_steps)
        detail["waited_for_a_core_per_step_s"] = round(queued_s / n_steps, 4)
    share = cost / median_step if median_step else 0.0
    late_steps = int((per_step >= max(MIN_WAIT_DIFF_S, MIN_LATE_STEP_SHARE * (median_step or 0))).sum())
    robust = (float(per_step.sum()) - float(per_step.max())) / n_steps if len(per_step) else 0.0
    detail.update({"late_steps": late_steps, "cost_without_worst_step_per_step_s": round(robust, 4)})
    return cost, share, late_steps, robust


def straggler_from_points(
    run: RunRecord, ranks: list[Any], points: pd.DataFrame, by_step: bool = False
) -> Finding | None:
    steps = run.steps.dropna(subset=["start_ns", "end_ns"])
    steady = _steady_ids(run, ranks)
    last = _steady_last_arrivals(points, steps, steady)
    if last is None:
        return None
    caused = last.groupby("last")["cost_s"].sum()
    total = float(caused.sum())
    straggler = caused.idxmax()
    n_steps = max(1, len(steady.get(straggler, ())))
    cost = float(caused[straggler]) / n_steps
    step_s = _median_steps(run, ranks)
    known = sorted(v for v in step_s.values() if v)
    median_step = known[len(known) // 2] if known else None
    dominance = float(caused[straggler]) / total if total > 0 else 0.0
    detail: dict[str, Any] = {
        "method": _points_method(run, by_step),
        "meeting_points": int(len(last)),
        "cost_caused_per_step_s": {r: round(float(caused.get(r, 0.0)) / n_steps, 4) for r in ranks},
        "straggler_share_of_cost": round(dominance, 3),
    }
    cost, share, late_steps, robust = _repeated_cost(
        run, ranks, last, straggler, n_steps, cost, median_step, detail
    )
    if (
        cost < MIN_WAIT_DIFF_S
        or share < MIN_SHARE
        or dominance < MIN_DOMINANCE
        or late_steps < MIN_LATE_STEPS
        or robust < MIN_WAIT_DIFF_S
        or (median_step and robust / median_step < MIN_SHARE)
    ):
        return None
    # where it came last (and mattered): the cause lies in the stretch before those arrivals
    mine = last[last["last"] == straggler]
    mine = mine[mine["cost_s"] >= 0.1 * mine["cost_s"].quantile(0.9)]  # not: one spike's tenth
    late_keys = set(mine["key"])
    if by_step:
        cause = _step_cause(run, straggler, {int(k) for k in late_keys}, n_steps)
    else:
        cause = _late_cause(run, sp.segments(points, steps), straggler, late_keys, n_steps)
    top = max(cause, key=cause.__getitem__) if cause else None
    if top == "collective" and cause[top] >= 0.5 * cost:
        return None  # it was late because it waited for someone else: a dependency, not a straggler
    late = points[points["key"].isin(late_keys)]
    others_wait = _others_wait(run, late, straggler, n_steps, by_step, detail)
    ops = Counter(late.loc[late["rank"] == straggler, "op"].astype(str))
    led = steady_ledger(run)
    detail.update(
        {
            "straggler": straggler,
            "source": "steps (host sync + collective lines)"
            if by_step
            else "matched collectives" + (" and DDP backwards" if sp.uses_ddp(run) else ""),
            "cost_per_step_s": round(cost, 4),
            "others_wait_per_step_s": others_wait,
            "late_at": {
                "points": int(len(mine)),
                "of": int((last["last"] == straggler).sum()),
                "ops": dict(ops.most_common(5)),
            },
            "late_because_per_step_s": {
                c: round(v, 4) for c, v in sorted(cause.items(), key=lambda kv: -kv[1])
            },
            "cause": top,
            "median_step_s": {r: None if v is None else round(v, 4) for r, v in step_s.items()},
            "wait_in_collectives_per_step_s": {
                r: round(float(g["collective_s"].mean()), 4) for r, g in led.groupby("rank")
            }
            if len(led)
            else {},
        }
    )
    label = _why_late(run, ranks, straggler, top, cost, steady.get(straggler, set()), detail)
    return _straggler_finding(run, ranks, straggler, cost, share, detail, top, label)


def _others_wait(
    run: RunRecord, late: pd.DataFrame, straggler: Any, n_steps: int, by_step: bool, detail: dict[str, Any]
) -> dict[Any, float]:
    """{rank: seconds per step it waited beyond the straggler at the late meeting points}; on
    one host, the arrivals' own gap goes into `detail` as a cross-check."""
    others_wait = {}
    mins = late[late["rank"] == straggler].set_index("key")["wait_s"]
    for rank, rows in late[late["rank"] != straggler].groupby("rank"):
        extra = rows["wait_s"].to_numpy() - mins.reindex(rows["key"]).to_numpy()
        others_wait[rank] = round(float(np.nansum(np.clip(extra, 0, None))) / n_steps, 4)
    if not by_step and not run.manifest.get("nodes"):
        # one host, one clock: the arrivals themselves, a cross-check of the waits' reading
        starts = late.pivot_table(index="key", columns="rank", values="start_ns", aggfunc="first")
        if straggler in starts and starts.shape[1] >= 2:
            gap = starts[straggler] - starts.drop(columns=straggler).max(axis=1)
            detail["arrival_gap_per_step_s"] = round(float(gap.clip(lower=0).sum()) / 1e9 / n_steps, 4)
    return others_wait


def _why_late(
    run: RunRecord,
    ranks: list[Any],
    straggler: Any,
    top: str | None,
    cost: float,
    steady_ids: set[int],
    detail: dict[str, Any],
) -> str:
    """What made the straggler late, as the finding's title reads it: a slower GPU clock, its
    ledger line beyond the others', its compiles; the details go into `detail`."""
    clocks = _gpu_clocks(run, ranks)
    slower_gpu = None
    if (
        clocks.get(straggler)
        and len(clocks) >= 2
        and top in ("forward_backward", "sync", "host", "unexplained", "optimizer")
    ):
        rest = [v for r, v in clocks.items() if r != straggler]
        if rest and clocks[straggler] <= SLOWER_CLOCK * float(np.median(rest)):
            slower_gpu = {"straggler_mhz": clocks[straggler], "others_mhz": float(np.median(rest))}
    if clocks:
        detail["gpu_sm_clock_mhz"] = {r: round(v) for r, v in clocks.items()}
    compiles = compiles_on(run, straggler, steady_ids)
    if compiles and top in ("compile", "autotune"):
        detail["straggler_compiles_in_steady_steps"] = compiles
    label = (
        ("a slower GPU clock" if slower_gpu else CAUSES.get(top, "unknown work"))
        if top
        else "no measured line (py-spy or the torch.profiler window name the code)"
    )
    detail["cause_label"] = label
    if slower_gpu:
        detail["slower_gpu"] = slower_gpu
    if top in ("forward_backward", "host", "unexplained"):
        doing = _trace_doing(run, straggler, cost) or _pyspy_doing(run, straggler)
        if doing:
            detail["straggler_does"] = doing
    return label


def _trace_doing(run: RunRecord, rank: str, cost: float) -> Any:
    waits = trace_waits(run, [rank])
    if rank not in waits:
        return None
    _, _, coll, rows, all_rows = waits[rank]
    return what_straggler_does(run, rank, rows, all_rows, coll, cost)


def _pyspy_doing(run: RunRecord, rank: str) -> Any:
    spy = pyspy_waits(run, [rank])
    if rank not in spy:
        return None
    hot = ev.hottest_frames(spy[rank][1], keep=lambda s: not in_collective(s))
    frames = ev.frames_evidence(hot) if hot else []
    # the job's own code first (py-spy's thread root and library frames are not what it does)
    frames = sorted(frames, key=lambda f: not f.get("file") or ev.is_library_path(f["file"]))
    return {"hottest_frames": frames} if frames else None


def _prescriptions(run: RunRecord, straggler: Any, top: Any, cost: float, slower_gpu: Any) -> Any:
    out = []
    if top in ("compile", "autotune"):
        out.append(
            Prescription(
                kind="precompile",
                summary=f"rank {straggler} compiles kernels during the steps: precompile them (see the "
                "jit finding) so no rank compiles while the others wait",
                change={"precompile": {"from_run": run.path}},
                expected_gain_s_per_step=cost,
            )
        )
    elif top == "gc":
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler} pauses in full garbage collections while the "
                "others wait: gc.collect(); gc.freeze() once after set-up (see the gc finding), or "
                "collect at the same point on every rank",
                expected_gain_s_per_step=cost,
            )
        )
    elif top == "data":
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler} waits for its batches: more DataLoader workers "
                "on it, or a faster shard/storage for it (the dataloader finding names the code)",
                expected_gain_s_per_step=cost,
            )
        )
    elif top == "io":
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler} writes files while the others wait: save "
                "asynchronously or from every rank's own shard (DCP), off the step",
                expected_gain_s_per_step=cost,
            )
        )
    elif slower_gpu:
        out.append(
            Prescription(
                kind="code",
                summary=f"rank {straggler}'s GPU runs at a lower SM clock: check it "
                "(nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER) or move the job off it",
                expected_gain_s_per_step=cost,
            )
        )
    out.append(
        Prescription(
            kind="code",
            summary=f"remove the extra work on rank {straggler} or balance it across ranks "
            "(same data volume per rank, rank-0-only logging/evaluation off the step)",
            expected_gain_s_per_step=cost,
        )
    )
    return tuple(out)


def _straggler_finding(
    run: RunRecord,
    ranks: list[Any],
    straggler: Any,
    cost: float,
    share: float,
    detail: dict[str, Any],
    top: str | None,
    label: str,
) -> Finding:
    because = detail.get("late_because_per_step_s") or {}
    why = " · ".join(
        f"{ledger_mod.LABELS.get(c, c)} +{v * 1000:.0f} ms" for c, v in list(because.items())[:3]
    )
    others = detail.get("others_wait_per_step_s") or {}
    waits = ", ".join(f"rank {r} {v * 1000:.0f} ms" for r, v in others.items())
    doing = detail.get("straggler_does") or {}
    code = f" Its hottest code: {doing['hottest_frames'][0]['frame']}." if doing.get("hottest_frames") else ""
    if detail.get("slower_gpu"):
        g = detail["slower_gpu"]
        code += (
            f" Its GPU's SM clock: {g['straggler_mhz']:.0f} MHz vs {g['others_mhz']:.0f} MHz on the others."
        )
    return Finding(
        id="ranks.straggler",
        title=f"Rank {straggler} arrives last at the collectives: the others wait "
        f"{cost * 1000:.0f} ms per step for it ({label})",
        severity=ev.severity_for_share(share),
        analyzer="ranks",
        summary=(
            f"At {detail['late_at']['points']} of {detail['meeting_points']} meeting points "
            f"in steady steps ({', '.join(detail['late_at']['ops'])}) rank {straggler} waited "
            f"least by a clear margin, so it arrived last; the others waited for it per "
            f"step: {waits}. "
            f"Before those arrivals rank {straggler}'s own ledger has, beyond the others'"
            f": {why or 'nothing measured'}.{code}"
        ),
        seconds_lost_per_step=cost,
        share_of_step=share,
        evidence=detail,
        prescriptions=_prescriptions(run, straggler, top, cost, detail.get("slower_gpu")),
        ranks=tuple(ranks),
    )
