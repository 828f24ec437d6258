"""ranks without meeting points (attach mode, older runs): the collective waits the torch.profiler
window and py-spy show per rank, and the straggler as the rank with the smallest wait; what a
straggler does meanwhile, from the trace or py-spy."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.findings import Finding, Prescription

if TYPE_CHECKING:  # annotations only
    from collections.abc import Sequence

    from traindx.derive.run import RunRecord
    from traindx.profiler.speedscope import Frame


COLLECTIVE_NAME = re.compile(
    r"^(?:gloo:|nccl:|c10d::|record_param_comms)|nccl.*(?:AllReduce|AllGather|ReduceScatter|Broadcast|"
    r"SendRecv|AllToAll|Reduce)|distributed_c10d\.py\(\d+\): (?:all_reduce|all_gather|"
    r"all_gather_into_tensor|reduce_scatter|reduce_scatter_tensor|broadcast|barrier|all_to_all|"
    r"all_to_all_single|send|recv|wait)$",
    re.IGNORECASE,
)
POINT_TO_POINT_NAME = re.compile(
    r"(?:^|[:_ .])(?:i?send|i?recv|SendRecv|batch_isend_irecv|P2P)\b|"
    r"nccl.*(?:Send|Recv)",
    re.IGNORECASE,
)
C10D_FILE = "torch/distributed/distributed_c10d.py"
MIN_SHARE = 0.05
MIN_WAIT_DIFF_S = 0.005


def trace_waits(run: RunRecord, ranks: list[Any]) -> Any:
    """{rank: (wait seconds per profiled step, steps, collective rows)} from the traces."""
    trace = run.torch_trace
    if not len(trace):
        return {}
    out = {}
    by_rank = dict(tuple(trace.groupby("rank", sort=False)))  # one pass, not one scan per rank
    for rank in ranks:
        steps = ev.trace_steps(run, rank)
        rows = by_rank.get(rank, trace.iloc[0:0])
        if not len(steps) or not len(rows):
            continue
        start, end = steps["start_ns"].min(), steps["end_ns"].max()
        inside = rows[(rows["start_ns"] >= start) & (rows["end_ns"] <= end)]
        named = inside["name"].fillna("")
        coll = inside[named.str.contains(COLLECTIVE_NAME) & ~named.str.contains(POINT_TO_POINT_NAME)]
        wait = ev.union_seconds(zip(coll["start_ns"], coll["end_ns"]))
        out[rank] = (wait / len(steps), len(steps), coll, inside, rows)
    return out


def in_collective(stack: Sequence[Frame]) -> Any:
    return any(f.file.endswith(C10D_FILE) for f in stack)


def pyspy_waits(run: RunRecord, ranks: list[Any]) -> Any:
    """{rank: (share of main-thread samples in torch.distributed, ThreadSamples)}."""
    out = {}
    for rank in ranks:
        rec = run.pyspy.get((rank, "all"))
        if not rec:
            continue
        main = ev.main_thread_id(rec, run.pyspy.get((rank, "gil")))
        threads = ev.merge_threads(rec)
        if main not in threads:
            continue
        samples = threads[main][1]
        total = ev.steps_seconds(run, rank) or ev.training_weight(samples)
        if total > 0:
            out[rank] = (min(1.0, ev.training_weight(samples, keep=in_collective) / total), samples)
    return out


def what_straggler_does(
    run: RunRecord, rank: str, rows: pd.DataFrame, all_rows: pd.DataFrame, coll: Any, diff_s: Any
) -> Any:
    """From the trace: the innermost Python call on the straggler that takes about as long as
    the others wait, and the job's function around it."""
    if rows is None:
        return None
    py = rows[rows["cat"] == "python_function"]
    py_all = all_rows[all_rows["cat"] == "python_function"]
    if not len(py):
        return None
    candidates = py[py["dur_s"] >= 0.5 * diff_s]
    spans = list(zip(coll["start_ns"], coll["end_ns"]))
    best = None
    for row in candidates.sort_values("dur_s").itertuples():
        if any(row.start_ns <= s and e <= row.end_ns for s, e in spans):
            continue  # it contains a collective: an outer frame, not the work itself
        if COLLECTIVE_NAME.search(row.name or ""):
            continue
        best = row
        break
    if best is None:
        return None
    mid = (best.start_ns + best.end_ns) // 2
    around = ev.enclosing_user_function(py_all, best.tid, mid)
    return {
        "call": best.name,
        "seconds": round(best.dur_s, 4),
        "in_function": None if not around else {"file": around[0], "line": around[1], "function": around[2]},
    }


def compiles_on(run: RunRecord, rank: str, steady_ids: set[int]) -> Any:
    comp = run.compiles
    if not len(comp):
        return None
    comp = comp[(comp["rank"] == rank) & comp["step"].isin(steady_ids)]
    if not len(comp):
        return None
    return {
        "compiles": int(len(comp)),
        "seconds": round(float(comp["duration_s"].sum()), 3),
        "kernels": sorted(set(map(str, comp["kernel"])))[:5],
    }


# -- 2. runs without spans: the smallest wait in the trace or in py-spy --------------------------
def by_smallest_wait(
    run: RunRecord, ranks: list[Any], sources: tuple[str, ...] = ("torch.profiler", "py-spy")
) -> list[Finding] | None:
    """[finding] or [] from the trace / py-spy waits; None when neither has them."""
    step_s = {r: ev.median_step_s(run, r) for r in ranks}
    median_step = sorted(v for v in step_s.values() if v)[len(ranks) // 2] if any(step_s.values()) else None
    waits = trace_waits(run, ranks)
    source, per_rank_wait = None, {}
    if len(waits) >= 2:
        source = "torch.profiler"
        per_rank_wait = {r: w[0] for r, w in waits.items()}
    elif "py-spy" in sources:
        spy = pyspy_waits(run, ranks)
        if len(spy) >= 2 and median_step:
            source = "py-spy"
            per_rank_wait = {r: share * median_step for r, (share, _) in spy.items()}
    if not source:
        return None
    straggler = min(per_rank_wait, key=per_rank_wait.__getitem__)
    others = [r for r in per_rank_wait if r != straggler]
    diff = sum(per_rank_wait[r] - per_rank_wait[straggler] for r in others) / len(others)
    share = diff / median_step if median_step else 0.0
    if diff < MIN_WAIT_DIFF_S or share < MIN_SHARE:
        return []
    if source == "torch.profiler":
        _, n, coll, rows, all_rows = waits[straggler]
        doing = what_straggler_does(run, straggler, rows, all_rows, coll, diff)
    else:
        samples = pyspy_waits(run, [straggler])[straggler][1]
        hot = ev.hottest_frames(samples, keep=lambda s: not in_collective(s))
        doing = {"hottest_frames": ev.frames_evidence(hot)} if hot else None
    steady_ids = {int(s) for s in ev.steady_steps(run, straggler)["step"]}
    compiles = compiles_on(run, straggler, steady_ids)
    detail: dict[str, Any] = {
        "source": source,
        "method": "the rank with the smallest wait in "
        "collectives (point-to-point ops left out); no meeting points in this run",
        "wait_in_collectives_per_step_s": {r: round(w, 4) for r, w in per_rank_wait.items()},
        "median_step_s": {r: None if v is None else round(v, 4) for r, v in step_s.items()},
        "straggler": straggler,
    }
    if doing:
        detail["straggler_does"] = doing
    if compiles:
        detail["straggler_compiles_in_steady_steps"] = compiles
    return [
        Finding(
            id="ranks.straggler",
            title=f"Rank {straggler} stalls the others: they wait {diff * 1000:.0f} ms per step "
            "in collectives",
            severity=ev.severity_for_share(share),
            analyzer="ranks",
            summary=(
                f"Per step, rank {straggler} waits {per_rank_wait[straggler] * 1000:.0f} ms "
                f"in collectives and the other ranks {diff * 1000 + per_rank_wait[straggler] * 1000:.0f} ms "
                f"on average ({source}).{_doing_text(straggler, doing, compiles)}"
            ),
            seconds_lost_per_step=diff,
            share_of_step=share,
            evidence=detail,
            prescriptions=_smallest_wait_prescriptions(run, straggler, compiles, diff),
            ranks=tuple(ranks),
        )
    ]


def _doing_text(straggler: Any, doing: dict[str, Any] | None, compiles: dict[str, Any] | None) -> str:
    """What the straggler does while the others wait, and its compiles in steady steps."""
    what = ""
    if doing and doing.get("call"):
        fn = doing.get("in_function")
        what = (
            f" Rank {straggler} spends that time in {doing['call']}"
            + (f" in {fn['function']} ({fn['file']}:{fn['line']})" if fn else "")
            + "."
        )
    elif doing and doing.get("hottest_frames"):
        what = f" Rank {straggler}'s hottest code: {doing['hottest_frames'][0]['frame']}."
    if compiles:
        what += f" It compiled {compiles['compiles']} kernels in steady steps ({compiles['seconds']} s)."
    return what


def _smallest_wait_prescriptions(
    run: RunRecord, straggler: Any, compiles: dict[str, Any] | None, diff: float
) -> tuple[Prescription, ...]:
    prescriptions = []
    if compiles:
        prescriptions.append(
            Prescription(
                kind="precompile",
                summary=f"rank {straggler} compiles kernels during the steps: precompile "
                "them (see the jit finding) so no rank compiles while others wait",
                change={"precompile": {"from_run": run.path}},
                expected_gain_s_per_step=diff,
            )
        )
    prescriptions.append(
        Prescription(
            kind="code",
            summary=f"remove the extra work on rank {straggler} or balance it across ranks "
            "(same data volume per rank, rank-0-only logging/evaluation off the step)",
            expected_gain_s_per_step=diff,
        )
    )
    return tuple(prescriptions)
