"""Where the ranks meet, and who came last: the dependency reading of a multi-rank run.

A meeting point is one collective seen on every rank of its group, matched by (process group,
seq) with no clock at all (as PyTorch's Flight Recorder matches); in a DDP job each backward is
one too (its all-reduces run in C++, where no Python wrapper sees them). Every rank leaves a
meeting point at about the same moment, so the rank that waited least arrived last, and the gap
to the next-latest arrival is what it cost; durations on each rank's own clock, so no clock has
to agree across hosts. Why it was late lies in its `segment` since its previous meeting point
(derive/ledger.py). Point-to-point send/recv are not meeting points: a pipeline stage waiting for
its upstream stage is the schedule's bubble, not a straggler's victim."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.derive import ledger as ledger_mod

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

POINT_COLUMNS = ["key", "rank", "op", "group", "start_ns", "end_ns", "wait_s"]


def collective_spans(run: RunRecord) -> pd.DataFrame:
    """The shim's collective spans: rank, op, group, seq (None for send/recv), peer, start_ns,
    end_ns, tid. Read from the events (run.spans keeps only what the ledger needs)."""
    cols = ["rank", "op", "group", "seq", "peer", "start_ns", "end_ns", "tid"]
    ev = run.of_type("span")
    if not len(ev) or "cat" not in ev:
        return pd.DataFrame(columns=cols)
    df = ev[ev["cat"] == "collective"]
    if not len(df):
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame(
        {
            "rank": df["rank"].values,
            "op": df["op"].values if "op" in df else None,
            "group": df["group"].astype(str).values if "group" in df else "default",
            "seq": df["seq"].values if "seq" in df else np.nan,
            "peer": df["peer"].values if "peer" in df else np.nan,
            "start_ns": df["start"].astype("int64").values,
            "end_ns": df["t"].astype("int64").values,
            "tid": df["tid"].values,
        }
    )
    return out.reset_index(drop=True)


POINT_TO_POINT_OPS = ("send", "recv")


def is_point_to_point(spans: pd.DataFrame) -> pd.Series:
    """send/recv spans (older runs' collective spans carry no op: none of them is)."""
    return spans["op"].isin(POINT_TO_POINT_OPS)


def uses_ddp(run: RunRecord) -> bool:
    return bool(len(run.of_type("ddp")))


def _matched_collectives(spans: pd.DataFrame) -> Any:
    coll = spans[~is_point_to_point(spans) & spans["seq"].notna()]
    if not len(coll):
        return pd.DataFrame(columns=POINT_COLUMNS)
    coll = coll.assign(seq=coll["seq"].astype("int64"))
    # a group's members are the ranks that ever called into it; a collective is matched when all
    # of them recorded it (a rank killed mid-run leaves its last ones unmatched)
    members = coll.groupby("group")["rank"].nunique()
    seen = coll.groupby(["group", "seq"])["rank"].transform("nunique")
    coll = coll[(seen == coll["group"].map(members)) & (seen >= 2)]
    # one int64 key per (group, seq): group code in the high bits (string keys cost seconds at
    # millions of rows)
    code = pd.factorize(coll["group"])[0].astype(np.int64)
    key = (code << 40) + coll["seq"].to_numpy(np.int64)
    return pd.DataFrame(
        {
            "key": key,
            "rank": coll["rank"].values,
            "op": coll["op"].values,
            "group": coll["group"].values,
            "start_ns": coll["start_ns"].values,
            "end_ns": coll["end_ns"].values,
            "wait_s": (coll["end_ns"] - coll["start_ns"]).values / 1e9,
        }
    )


def _ddp_backwards(run: RunRecord) -> Any:
    """Each backward of a DDP job, keyed by step and its order in the step, on every rank."""
    spans = run.spans
    bwd = spans[spans["cat"] == "backward"]
    steps = run.steps.dropna(subset=["start_ns", "end_ns"])
    if not len(bwd) or not len(steps):
        return pd.DataFrame(columns=POINT_COLUMNS)
    parts = []
    for rank, rows in bwd.groupby("rank"):
        st = steps[steps["rank"] == rank].sort_values("start_ns")
        if not len(st):
            continue
        starts = rows["start_ns"].to_numpy(np.int64)
        i = np.searchsorted(st["start_ns"].to_numpy(np.int64), starts, side="right") - 1
        ok = (i >= 0) & (starts < st["end_ns"].to_numpy(np.int64)[np.maximum(i, 0)])
        rows, step = rows[ok], st["step"].to_numpy(np.int64)[i[ok]]
        order = pd.Series(step).groupby(step).cumcount().to_numpy()
        parts.append(
            pd.DataFrame(
                {
                    # negative keys: never a collective's; step and the backward's order in it
                    "key": -(step.astype(np.int64) * 1024 + order + 1),
                    "rank": rank,
                    "op": "backward",
                    "group": "ddp",
                    "start_ns": rows["start_ns"].to_numpy(np.int64),
                    "end_ns": rows["end_ns"].to_numpy(np.int64),
                }
            )
        )
    if not parts:
        return pd.DataFrame(columns=POINT_COLUMNS)
    out = pd.concat(parts, ignore_index=True)
    n_ranks = out["rank"].nunique()
    out = out[out.groupby("key")["rank"].transform("nunique") == n_ranks]
    out["wait_s"] = (out["end_ns"] - out["start_ns"]) / 1e9
    return out[POINT_COLUMNS] if n_ranks >= 2 else out.iloc[0:0][POINT_COLUMNS]


def meeting_points(run: RunRecord, spans: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (meeting point, rank): key, rank, op, group, start_ns (its arrival on that
    rank's clock), end_ns, wait_s."""
    spans = collective_spans(run) if spans is None else spans
    parts = [_matched_collectives(spans)]
    if uses_ddp(run):
        parts.append(_ddp_backwards(run))
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=POINT_COLUMNS)


def last_arrivals(points: pd.DataFrame) -> pd.DataFrame:
    """One row per meeting point: key, last (the rank that waited least), cost_s (second-smallest
    wait minus the smallest: what the others waited for it), others_wait_s (the other ranks'
    mean wait beyond its own), ranks (how many met)."""
    if not len(points):
        return pd.DataFrame(columns=["key", "last", "cost_s", "others_wait_s", "ranks"])
    p = points.sort_values(["key", "wait_s"], kind="stable")
    g = p.groupby("key", sort=False)
    first = g.nth(0).set_index("key")
    second = g.nth(1).set_index("key")
    mean_wait = g["wait_s"].mean()
    n = g["rank"].size()
    out = pd.DataFrame({"last": first["rank"], "min_wait": first["wait_s"]})
    out["cost_s"] = (second["wait_s"].reindex(out.index) - out["min_wait"]).clip(lower=0.0)
    out["ranks"] = n.reindex(out.index)
    # the mean of the others' waits beyond the last arrival's own
    out["others_wait_s"] = (
        (mean_wait.reindex(out.index) * out["ranks"] - out["min_wait"]) / (out["ranks"] - 1) - out["min_wait"]
    ).clip(lower=0.0)
    return out.drop(columns="min_wait").reset_index()


def segments(points: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Each rank's stretch before each arrival: from the end of its previous meeting point (its
    first step's start, for the first) to the arrival. Returns points with seg_start_ns added;
    the segments of one rank never overlap."""
    out = []
    for rank, rows in points.groupby("rank"):
        rows = rows.sort_values("start_ns")
        prev_end = rows["end_ns"].shift(1)
        st = steps[steps["rank"] == rank].sort_values("start_ns")
        first_start = int(st["start_ns"].min()) if len(st) else int(rows["start_ns"].min())
        seg = prev_end.fillna(first_start).astype("int64")
        seg = np.minimum(seg.to_numpy(np.int64), rows["start_ns"].to_numpy(np.int64))
        out.append(rows.assign(seg_start_ns=seg))
    return pd.concat(out, ignore_index=True) if out else points.assign(seg_start_ns=pd.Series(dtype="int64"))


def segment_ledger(run: RunRecord, rank: str, seg_start: np.ndarray, seg_end: np.ndarray) -> np.ndarray:
    """Seconds per ledger category (CATEGORIES + unexplained) in each of the rank's segments:
    an array of shape (len(seg_start), len(CATEGORIES) + 1). The same sweep and priorities as
    the step ledger, over the segments instead of the steps."""
    spans = run.spans
    spans = spans[spans["rank"] == rank]
    comp = run.compiles
    comp = comp[comp["rank"] == rank] if len(comp) else comp
    order = np.argsort(seg_start, kind="stable")
    ws, we = np.asarray(seg_start, np.int64)[order], np.asarray(seg_end, np.int64)[order]
    ns = ledger_mod.split_windows(spans, comp, ws, we)
    back = np.empty_like(ns)
    back[order] = ns
    return back / 1e9


def step_of(steps: pd.DataFrame, rank: str, t_ns: np.ndarray) -> np.ndarray:
    """The step number of each time on the rank's clock (the step whose window holds it, else
    the next step to begin; None past the last)."""
    st = steps[steps["rank"] == rank].sort_values("start_ns")
    if not len(st):
        return np.full(len(t_ns), -1)
    ends = st["end_ns"].to_numpy(np.int64)
    i = np.searchsorted(ends, np.asarray(t_ns, np.int64), side="left")
    ids = st["step"].to_numpy(np.int64)
    return np.where(i < len(ids), ids[np.minimum(i, len(ids) - 1)], -1)
