"""The op table of a traindx run folder of several ranks: the shim's spans per rank and step.

forward -> forward-compute, backward -> backward-compute, optimizer -> optimizer, a blocking
collective -> collective-<op> (a data-parallel collective: every rank of the job meets there),
data -> data, io -> io. Under DistributedDataParallel (the run holds a `ddp` event) the gradient
all-reduces run inside backward, where no wrapper sees them: each backward is split into its
compute and a grads-all-reduce that every rank meets at (`split_ddp_backward`): at the span's
grads_ready (the shim's clock at the last parameter gradient accumulated on that rank), or, in a
run recorded without it, by an estimate.
A blocking send/recv (the shim's collective spans with op send/recv and the peer's rank) is a
pipeline op: each rank's stage follows from its peers (`pipeline_coordinates`: a rank whose first
point-to-point op in a step is a receive sits one stage after the rank it receives from; one that
sends first is a first stage), a send to a later stage is a forward-send, to an earlier one a
backward-send, and likewise the receives; the forward and backward spans between them are the
micro-batches' computes. A run without send/recv is one stage of DP ranks.
Non-blocking isend/irecv (the shim records them once their Work's wait returns) read the same: a
receive spans its wait (where the rank blocks), a send its isend call (`nonblocking_sends` tells
the dependency model that such a send does not wait for its receive).

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
    ranks = sorted(steps["rank"].astype(str).unique(), key=lambda r: (len(r), r))
    rank_ix = {r: i for i, r in enumerate(ranks)}
    spans = spans[spans["optype"].notna()]
    coords = pipeline_coordinates(_in_steps(spans, steps), ranks) if "peer" in spans else None
    if coords is not None:
        spans = spans.assign(optype=_p2p_optypes(spans, coords))
        spans = _send_waits(spans[spans["optype"].notna()])
    else:
        spans = spans[~spans["optype"].astype(str).str.endswith(("send", "recv"))]
    rows = []
    for rank, own in spans.groupby(spans["rank"].astype(str)):
        windows = steps[steps["rank"].astype(str) == rank].sort_values("start_ns")
        if not len(windows) or rank not in rank_ix:
            continue
        pp, dp = coords[rank] if coords is not None else (0, rank_ix[rank])
        frame = _rank_rows(own, windows).assign(rank=rank_ix[rank], dp=dp, pp=pp)
        rows.append(_host_gaps(frame, windows) if coords is not None else frame)
    if not rows:
        return pd.DataFrame()
    table = pd.concat(rows, ignore_index=True)
    table = split_ddp_backward(table) if ddp else table.drop(columns="ready")
    # steps every rank ran (a rank's first or last partial step is not comparable)
    per_step = table.groupby("step")["rank"].nunique()
    table = table[table["step"].isin(per_step.index[per_step == len(ranks)])]
    table = _whole_steps(table)
    if table.empty:
        return table
    # the same ops on every rank of a stage: keep (stage, optype, seq) its ranks recorded in every step
    table = normalize(table)
    per_stage = table.groupby("pp")["rank"].nunique()
    counts = table.groupby(["pp", "optype", "seq"], observed=True)[["rank", "step"]].nunique()
    n_steps = table["step"].nunique()
    stage_ranks = per_stage.reindex(counts.index.get_level_values("pp")).to_numpy()
    full = counts[(counts["rank"].to_numpy() == stage_ranks) & (counts["step"] == n_steps)].index
    keys = table[["pp", "optype", "seq"]].astype({"optype": str})
    keep = pd.MultiIndex.from_frame(keys).isin([(int(p), str(o), int(s)) for p, o, s in full])
    return table[keep].reset_index(drop=True)


def _whole_steps(table: pd.DataFrame) -> pd.DataFrame:
    """The steps where every rank recorded its usual number of ops (a first step whose window
    opened after its first op, a step cut short, would shift every later op's order)."""
    counts = table.groupby(["rank", "step"]).size()
    usual = counts.groupby(level="rank").agg(lambda c: c.mode().iloc[0])
    ok = (
        (counts == usual.reindex(counts.index.get_level_values("rank")).to_numpy())
        .groupby(level="step")
        .all()
    )
    whole = ok.index[ok]
    return table[table["step"].isin(whole)] if len(whole) else table


def _rank_rows(own: pd.DataFrame, windows: pd.DataFrame) -> pd.DataFrame:
    """One rank's spans inside its steps (windows sorted by start) as op rows."""
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
    return pd.DataFrame(
        {
            "step": windows["step"].to_numpy()[k[inside]],
            "optype": own["optype"].astype(str).to_numpy(),
            "start": own["start"].to_numpy(np.int64) / 1e9,
            "duration": (own["t"].to_numpy(np.int64) - own["start"].to_numpy(np.int64)) / 1e9,
            "ready": ready,
        }
    )


def _host_gaps(frame: pd.DataFrame, windows: pd.DataFrame) -> pd.DataFrame:
    """The rank's own time between its recorded ops (from the step's start): a `host` op before
    every op (zero long where the ops touch, so that every step holds the same ops). Between
    blocking calls of one thread the gap is the thread's own work (Python, copies, the loss),
    never a wait: a replay without it would lose that time."""
    if frame.empty:
        return frame
    frame = frame.sort_values(["step", "start"], kind="stable")
    step_start = windows.set_index("step")["start_ns"].astype(np.int64) / 1e9
    ends = (frame["start"] + frame["duration"]).to_numpy()
    same = frame["step"].to_numpy()[1:] == frame["step"].to_numpy()[:-1]
    prev = np.empty(len(frame))
    prev[0] = np.nan
    prev[1:] = np.where(same, np.maximum.accumulate(ends)[:-1], np.nan)
    first = np.isnan(prev)
    prev[first] = step_start.reindex(frame["step"].to_numpy()[first]).to_numpy()
    gap = np.clip(np.nan_to_num(frame["start"].to_numpy() - prev), 0.0, None)
    host = frame.assign(optype="host", start=frame["start"].to_numpy() - gap, duration=gap, ready=np.nan)
    return pd.concat([frame, host], ignore_index=True).sort_values(["step", "start"], kind="stable")


def _in_steps(spans: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The spans that fall inside one of their rank's steps, with that step (`in_step`)."""
    step = np.full(len(spans), -1, dtype=np.int64)
    rank_of = spans["rank"].astype(str).to_numpy()
    start = spans["start"].to_numpy(np.int64)
    for rank, windows in steps.groupby(steps["rank"].astype(str)):
        mine = rank_of == rank
        w = windows.sort_values("start_ns")
        starts, ends = w["start_ns"].to_numpy(np.int64), w["end_ns"].to_numpy(np.int64)
        k = np.searchsorted(starts, start[mine], side="right") - 1
        inside = (k >= 0) & (start[mine] < ends[np.clip(k, 0, None)])
        step[mine] = np.where(inside, w["step"].to_numpy(np.int64)[np.clip(k, 0, None)], -1)
    return spans.assign(in_step=step)[step >= 0]


def pipeline_coordinates(spans: pd.DataFrame, ranks: list[str]) -> dict[str, tuple[int, int]] | None:
    """Each rank's (stage, pipeline) from its blocking send/recv spans inside steps, None when the
    run has none or they do not form whole pipelines (every pipeline with the same stages).

    A rank's first point-to-point op in a step (the most common over its steps: a step window
    may open after it) decides: a receive from rank q puts it one stage after q (GPipe, 1F1B
    and their kin all start a step by passing the first micro-batch forward), a send makes it
    a first stage. The pipeline (the DP coordinate) is the first stage it leads
    back to, numbered in rank order."""
    p2p = spans[(spans["cat"] == "collective") & spans["op"].astype(str).isin(["send", "recv"])]
    p2p = p2p[pd.to_numeric(p2p["peer"], errors="coerce").notna()]
    if p2p.empty:
        return None
    first = p2p.sort_values("start").groupby([p2p["rank"].astype(str), p2p["in_step"]]).head(1)
    kind = first["op"].astype(str) + ":" + pd.to_numeric(first["peer"]).astype(int).astype(str)
    usual = kind.groupby(first["rank"].astype(str)).agg(lambda k: k.mode().iloc[0])
    prev = {str(r): (k.split(":")[1] if k.startswith("recv:") else None) for r, k in usual.items()}
    if set(prev) != set(ranks):
        return None
    coords: dict[str, tuple[int, str]] = {}
    for rank in ranks:
        chain: list[str] = []
        r: str | None = rank
        while r is not None and r not in coords:
            if r in chain or r not in prev:
                return None  # a cycle, or a peer that ran no steps
            chain.append(r)
            r = prev[r]
        stage, root = (-1, chain[-1]) if r is None else coords[r]
        for c in reversed(chain):
            stage += 1
            coords[c] = (stage, root)
    roots = sorted({root for _, root in coords.values()}, key=lambda r: (len(r), r))
    out = {r: (stage, roots.index(root)) for r, (stage, root) in coords.items()}
    pp = max(s for s, _ in out.values()) + 1
    if pp < 2 or len(out) != pp * len(roots) or len(set(out.values())) != len(out):
        return None
    return out


def _p2p_optypes(spans: pd.DataFrame, coords: dict[str, tuple[int, int]]) -> pd.Series:
    """forward/backward-send/recv by the peer's stage (before or after the rank's); None for a
    send/recv with a peer outside the pipelines."""
    stage = {r: s for r, (s, _) in coords.items()}
    is_p2p = ((spans["cat"] == "collective") & spans["op"].astype(str).isin(["send", "recv"])).to_numpy()
    mine = spans["rank"].astype(str).map(stage).to_numpy(dtype=float)
    peer = pd.to_numeric(spans["peer"], errors="coerce")
    theirs = peer.map(lambda q: stage.get(str(int(q)), np.nan) if pd.notna(q) else np.nan).to_numpy(
        dtype=float
    )
    send = (spans["op"].astype(str) == "send").to_numpy()
    forward = (theirs > mine) == send
    named = np.where(forward, "forward-", "backward-") + np.where(send, "send", "recv")
    valid = np.isfinite(mine) & np.isfinite(theirs) & (mine != theirs)
    optype = spans["optype"].astype(object).to_numpy().copy()
    optype[is_p2p] = np.where(valid[is_p2p], named[is_p2p], None)
    return pd.Series(optype, index=spans.index)


def _send_waits(spans: pd.DataFrame) -> pd.DataFrame:
    """A non-blocking op's second half as a span of its own: a send's wait (the shim's `wait`,
    [start, end] ns) as <direction>-send-wait (the sender blocks there until its receiver has
    posted the receive), a receive's irecv call (`issue`) as <direction>-recv-post."""
    extra = []
    for field, kind, suffix in (("wait", "send", "-wait"), ("issue", "recv", "-post")):
        if field not in spans:
            continue
        has = spans[field].map(lambda w: isinstance(w, (list, tuple)) and len(w) == 2).to_numpy(dtype=bool)
        mine = spans["optype"].astype(str).str.endswith(kind).to_numpy()
        rows = spans[has & mine]
        if rows.empty:
            continue
        ends = np.array(list(rows[field]), dtype=np.int64)
        extra.append(
            rows.assign(
                start=ends[:, 0], t=ends[:, 1], optype=rows["optype"].astype(str) + suffix, op=kind + suffix
            )
        )
    return pd.concat([spans, *extra]) if extra else spans


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


def nonblocking_sends(run: RunView) -> bool:
    """Whether the run's sends were non-blocking (isend, batch_isend_irecv: the shim marks their
    spans `nonblocking`): the data leaves at the call and the sender goes on, so a send never
    waits for its receive (`Layout.oneway_sends`)."""
    spans = run.of_type("span")
    if not len(spans) or "nonblocking" not in spans or "op" not in spans:
        return False
    flagged = spans["nonblocking"].astype(object) == True  # noqa: E712
    return bool((flagged & (spans["op"].astype(str) == "send")).any())


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
