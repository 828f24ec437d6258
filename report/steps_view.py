"""The step chart's and the time ledger's data: the ranks drawn step by step, bars binned beyond
MAX_STEP_BARS, the loss curve. Step causes come from the judge (analyzers/core/step_causes.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from traindx.derive import ledger as L
from traindx.report.text import median, num

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

MAX_STEP_BARS = 800  # more steps than this are binned (about one bar per pixel)

MAX_TIMELINE_RANKS = 32  # ranks drawn per-step (timeline, heatmap); the rest in ranks_summary


def timeline_ranks(st: Any, worst_rank: str | None) -> list[str]:
    """The ranks drawn step by step: all of them up to MAX_TIMELINE_RANKS; beyond, the first
    rank, the worst step's rank and the ranks with the slowest median step (in rank order)."""
    ranks = list(dict.fromkeys(st["rank"]))
    if len(ranks) <= MAX_TIMELINE_RANKS:
        return ranks
    medians = (
        st.groupby("rank", sort=False)["duration_s"].median().sort_values(ascending=False, kind="stable")
    )
    keep = {ranks[0]} | ({worst_rank} if worst_rank is not None else set())
    for r in medians.index:
        if len(keep) >= MAX_TIMELINE_RANKS:
            break
        keep.add(r)
    return [r for r in ranks if r in keep]


def rows_of(st: Any, ranks: list[str]) -> dict[str, list[dict[str, Any]]]:
    """{rank: [step dicts]} of the given ranks (what the charts draw)."""
    sub = st[st["rank"].isin(ranks)]
    out: dict[str, list[dict[str, Any]]] = {r: [] for r in ranks}
    cols = ["step", "start_s", "end_s", "duration_s", "compile_s", "gc_s", "slow", "cause"]
    for rank, group in sub.groupby("rank", sort=False):
        rows = zip(*(group[c].tolist() for c in cols))
        out[rank] = [{**dict(zip(cols, row)), "step": int(row[0]), "slow": bool(row[6])} for row in rows]
    return {r: rows for r, rows in out.items() if rows}


def bin_steps(rows: list[dict[str, Any]], limit: int = MAX_STEP_BARS) -> list[dict[str, Any]]:
    """At most `limit` bars: consecutive steps are merged; a bin's bar is its median step, and its
    slowest step (with the most common slow cause) rides on top, so outliers stay visible."""
    if len(rows) <= limit:
        return rows
    size = math.ceil(len(rows) / limit)
    out = []
    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        slow = [s for s in chunk if s["slow"]]
        causes: dict[str, int] = {}
        for s in slow:
            causes[s["cause"]] = causes.get(s["cause"], 0) + 1
        out.append(
            {
                "step": chunk[0]["step"],
                "start_s": chunk[0]["start_s"],
                "end_s": chunk[-1]["end_s"],
                "duration_s": median([s["duration_s"] for s in chunk]),
                "max_s": max(s["duration_s"] for s in chunk),
                "cause": max(causes, key=lambda c: causes[c]) if causes else "normal",
                "slow": bool(slow),
                "slow_count": len(slow),
                "binned": len(chunk),
                "compile_s": sum(s.get("compile_s", 0.0) for s in chunk),
                "gc_s": sum(s.get("gc_s", 0.0) for s in chunk),
                "label": f"steps {chunk[0]['step']}–{chunk[-1]['step']}",
            }
        )
    return out


def losses_of(run: RunRecord) -> dict[int, float]:
    ls = run.log_steps
    if not len(ls) or "loss" not in ls:
        return {}
    # a line without a step or a loss (a log format that carries only one) is no point of the curve
    return {
        int(s.step): float(s.loss)
        for s in ls.itertuples()
        if num(s.loss) is not None and num(s.step) is not None
    }


def _mean_labelled(line: str | None) -> str | None:
    """The ledger's 'step 1.23 s = …' is a mean (its parts add up only as means): say so, so it
    never reads as a second step time beside the median."""
    return f"mean {line}" if line and line.startswith("step ") else line


def ledger_view(run: RunRecord, rank: str | None = None) -> dict[str, Any]:
    """The time ledger of one rank (the given one, else the slowest by mean step): per-step
    stacked parts (binned beyond MAX_STEP_BARS), the run total per category, start-up, and the
    one-line breakdown of the steady steps."""
    led = run.ledger
    if not len(led):
        return {"available": False}
    if rank is None:
        means = led.groupby("rank")["wall_s"].mean()
        rank = means.idxmax()
    mine = run.rank_rows("ledger", rank).sort_values("step")
    cats = [c for c in L.CATEGORIES + ("unexplained",) if float(mine[f"{c}_s"].sum()) > 0]
    bin_size = max(1, math.ceil(len(mine) / MAX_STEP_BARS))
    bars = []
    for i in range(0, len(mine), bin_size):
        chunk = mine.iloc[i : i + bin_size]
        bars.append(
            {
                "step": int(chunk["step"].iloc[0]),
                "last_step": int(chunk["step"].iloc[-1]),
                "wall_s": float(chunk["wall_s"].mean()),
                "parts": {c: float(chunk[f"{c}_s"].mean()) for c in cats},
            }
        )
    total = {c: float(mine[f"{c}_s"].sum()) for c in cats}
    startup = run.startup_ledger
    startup = startup[startup["rank"] == rank]
    start = None
    if len(startup):
        row = startup.iloc[0]
        start = {
            "wall_s": float(row["wall_s"]),
            "parts": {
                c: float(row[f"{c}_s"]) for c in L.CATEGORIES + ("unexplained",) if float(row[f"{c}_s"]) > 0
            },
        }
    steady = L.steady_rows(run, rank)
    return {
        "available": True,
        "rank": str(rank),
        "categories": cats,
        "labels": {c: L.LABELS[c] for c in L.CATEGORIES + ("unexplained",)},
        "bars": bars,
        "bin_size": bin_size,
        "total": total,
        "total_wall_s": float(mine["wall_s"].sum()),
        "startup": start,
        "line": _mean_labelled(L.breakdown_text(steady if len(steady) else mine)),
        "ranks": int(led["rank"].nunique()),
    }
