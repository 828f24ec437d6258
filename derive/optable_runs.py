"""The op table of a traindx run folder of several ranks: the shim's spans per rank and step.

forward -> forward-compute, backward -> backward-compute, optimizer -> optimizer, a blocking
collective -> collective-<op> (a data-parallel collective: every rank of the job meets there),
data -> data, io -> io. Under DistributedDataParallel (the run holds a `ddp` event) the gradient
all-reduces run inside backward, where no wrapper sees them: each backward is split into its
compute and a grads-all-reduce that every rank meets at (`split_ddp_backward`): at the span's
grads_ready (the shim's clock at the last parameter gradient accumulated on that rank), or, in a
run recorded without it, by an estimate.
Every rank is a DP rank of one pipeline stage (our spans name no stage).

Pure computation: no judgement.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from traindx.derive.optable import OpType, normalize
from traindx.derive.runview import RunView

SPAN_OPTYPE = {
    "forward": OpType.FWD,
    "backward": OpType.BWD,
    "optimizer": OpType.OPTIMIZER,
    "data": "data",
    "io": "io",
}
DDP_BACKWARD = "backward-grads-all-reduce"


def from_run(run: RunView) -> pd.DataFrame:
    """The normalised op table of the run's steps (empty when no spans fall in a step)."""
    spans = run.of_type("span")
    steps = run.steps
    if not len(spans) or not len(steps) or "cat" not in spans:
        return pd.DataFrame()
    ddp = len(run.of_type("ddp")) > 0
    spans = spans[spans["cat"].isin([*SPAN_OPTYPE, "collective"])].copy()
    if "grad" in spans:  # a forward under no_grad (evaluation) is not a training op
        spans = spans[~((spans["cat"] == "forward") & (spans["grad"].astype(object) == False))]  # noqa: E712
    optype = spans["cat"].map(SPAN_OPTYPE)
    if "op" in spans:
        coll = spans["cat"] == "collective"
        optype = optype.where(~coll, "collective-" + spans["op"].astype(str))
    if ddp:
        optype = optype.replace({OpType.BWD: DDP_BACKWARD})
    spans["optype"] = optype
    spans = spans[spans["optype"].notna() & ~spans["optype"].astype(str).str.endswith(("send", "recv"))]
    ranks = sorted(steps["rank"].astype(str).unique(), key=lambda r: (len(r), r))
    rank_ix = {r: i for i, r in enumerate(ranks)}
    rows = []
    for rank, own in spans.groupby(spans["rank"].astype(str)):
        windows = steps[steps["rank"].astype(str) == rank].sort_values("start_ns")
        if not len(windows) or rank not in rank_ix:
            continue
        starts = windows["start_ns"].to_numpy(np.int64)
        ends = windows["end_ns"].to_numpy(np.int64)
        s = own["start"].to_numpy(np.int64)
        k = np.searchsorted(starts, s, side="right") - 1
        inside = (k >= 0) & (s < ends[np.clip(k, 0, None)])
        own = own[inside]
        ready = (
            pd.to_numeric(own["grads_ready"], errors="coerce").to_numpy(dtype=float) / 1e9
            if "grads_ready" in own
            else np.full(len(own), np.nan)
        )
        rows.append(
            pd.DataFrame(
                {
                    "rank": rank_ix[rank],
                    "dp": rank_ix[rank],
                    "step": windows["step"].to_numpy()[k[inside]],
                    "optype": own["optype"].astype(str).to_numpy(),
                    "start": own["start"].to_numpy(np.int64) / 1e9,
                    "duration": (own["t"].to_numpy(np.int64) - own["start"].to_numpy(np.int64)) / 1e9,
                    "ready": ready,
                }
            )
        )
    if not rows:
        return pd.DataFrame()
    table = pd.concat(rows, ignore_index=True)
    table = split_ddp_backward(table) if ddp else table.drop(columns="ready")
    # steps every rank ran (a rank's first or last partial step is not comparable)
    per_step = table.groupby("step")["rank"].nunique()
    table = table[table["step"].isin(per_step.index[per_step == len(ranks)])]
    if table.empty:
        return table
    # the same ops on every rank: keep (optype, seq) pairs every rank recorded in every step
    table = normalize(table)
    counts = table.groupby(["optype", "seq"], observed=True)[["rank", "step"]].nunique()
    n_steps = table["step"].nunique()
    full = counts[(counts["rank"] == len(ranks)) & (counts["step"] == n_steps)].index
    keep = pd.MultiIndex.from_frame(table[["optype", "seq"]].astype({"optype": str})).isin(
        [(str(o), int(s)) for o, s in full]
    )
    return table[keep].reset_index(drop=True)


def split_ddp_backward(table: pd.DataFrame) -> pd.DataFrame:
    """Each DDP backward as its own compute, then the wait for the gradients' all-reduce.

    Measured where the span holds its rank's grads_ready (compute: start to the last gradient
    accumulated; the rest: the all-reduce, i.e. the wait for the other ranks and the last
    bucket's transfer). Else estimated (`_estimated_compute`)."""
    is_bwd = (table["optype"] == DDP_BACKWARD).to_numpy()
    if not is_bwd.any():
        return table.drop(columns="ready")
    b = table[is_bwd].sort_values(["rank", "step", "start"])
    span = b["duration"].to_numpy(dtype=float)
    measured = b["ready"].to_numpy(dtype=float) - b["start"].to_numpy(dtype=float)
    compute = np.where(np.isfinite(measured), measured, np.nan)
    if np.isnan(compute).any():
        compute = np.where(np.isnan(compute), _estimated_compute(table, b), compute)
    compute = np.clip(compute, 0.0, span)
    comp = b.assign(optype=OpType.BWD, duration=compute)
    reduce = b.assign(optype=OpType.GRADS_AR, start=b["start"].to_numpy() + compute, duration=span - compute)
    return pd.concat([table[~is_bwd], comp, reduce], ignore_index=True).drop(columns="ready")


def _estimated_compute(table: pd.DataFrame, b: pd.DataFrame) -> np.ndarray:
    """Backward compute without grads_ready (an older recording), per row of b (sorted by rank,
    step, start). The rank that reached a backward last waited least: its backward over its
    forward is the job's backward-per-forward ratio in that step; every rank's backward compute
    is that ratio times its own forward (the span where unknown). Holds when a rank's backward
    grows with its forward (more data, a slower device); a rank slow by a fixed amount (host
    work, a delay in every layer) gets the others' backward underestimated."""
    k_ix = b.groupby(["rank", "step"]).cumcount().to_numpy()
    per = b.groupby(["rank", "step"])["start"].transform("size").to_numpy()
    fwd = table[table["optype"] == OpType.FWD].groupby(["rank", "step"])["duration"].sum()
    fwd_each = fwd.reindex(pd.MultiIndex.from_frame(b[["rank", "step"]])).to_numpy(dtype=float) / per
    frame = pd.DataFrame({"step": b["step"].to_numpy(), "k": k_ix, "start": b["start"].to_numpy()})
    last = frame.groupby(["step", "k"])["start"].idxmax().to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_last = b["duration"].to_numpy()[last] / fwd_each[last]
    ratio = pd.Series(
        ratio_last, index=pd.MultiIndex.from_arrays([frame["step"].to_numpy()[last], k_ix[last]])
    )
    k = ratio.reindex(pd.MultiIndex.from_arrays([frame["step"].to_numpy(), k_ix])).to_numpy(dtype=float)
    guess = k * fwd_each
    span = b["duration"].to_numpy(dtype=float)
    out: np.ndarray = np.where(np.isfinite(guess), guess, span)
    return out


def runq_share(run: RunView) -> float | None:
    """The share of the ranks' step time their training thread spent runnable but waiting for
    a CPU (the shim's per-step `cpu` events: thread_runq_s), None when not recorded."""
    cpu = run.of_type("cpu")
    steps = run.steps
    if not len(cpu) or "thread_runq_s" not in cpu or not len(steps):
        return None
    waited = pd.to_numeric(cpu["thread_runq_s"], errors="coerce").fillna(0.0).sum()
    total = float(steps["duration_s"].sum()) if "duration_s" in steps else 0.0
    return float(waited / total) if total > 0 else None
