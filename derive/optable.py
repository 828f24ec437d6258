"""The op table: every recorded op of a multi-rank job, one row each, whatever recorded it.

Columns (`COLUMNS`): rank, dp, pp, tp (the rank's data-, pipeline- and tensor-parallel
coordinates), step, mb (micro-batch, -1 where the op has none), optype (Megatron's timer names,
`OpType`), seq (the op's order among the ops of its type on its rank in its step), start and
duration (seconds; start on any axis, each step is made relative to its own first op), chunk and
gchunk (the model chunk on the stage and in the whole model under an interleaved schedule; -1
where unknown). Readers of each evidence format (`traindx.profiler.straggler_trace`,
`megatron_timers`, ...) return this table; `traindx.derive.depmodel` and `replay` read only it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

COLUMNS = ("rank", "dp", "pp", "tp", "step", "mb", "optype", "seq", "start", "duration", "chunk", "gchunk")
INT_COLUMNS = ("rank", "dp", "pp", "tp", "step", "mb", "seq", "chunk", "gchunk")


class OpType:
    """Op types, named as Megatron's timers name them."""

    FWD = "forward-compute"
    BWD = "backward-compute"
    FWD_SEND = "forward-send"
    FWD_RECV = "forward-recv"
    BWD_SEND = "backward-send"
    BWD_RECV = "backward-recv"
    FWD_SEND_WAIT = "forward-send-wait"  # an isend's Work.wait (where the sender may block)
    BWD_SEND_WAIT = "backward-send-wait"
    FWD_RECV_POST = "forward-recv-post"  # an irecv's call (the receive is posted; its wait is the recv)
    BWD_RECV_POST = "backward-recv-post"
    PARAMS_AG = "params-all-gather"
    GRADS_RS = "grads-reduce-scatter"
    GRADS_AR = "grads-all-reduce"  # plain DDP: one all-reduce of the gradients per step (or bucket)
    SEPARATE_AR = "separate-grads-all-reduce"
    LAYERNORM_AR = "layernorm-grads-all-reduce"
    EMBEDDING_AR = "embedding-grads-all-reduce"
    CLIP = "optimizer-clip-main-grad"
    OPTIMIZER = "optimizer"
    GC = "gc"

    DDP_BACKWARD = "backward-grads-all-reduce"  # DDP: backward with its all-reduces inside
    COLLECTIVE_PREFIX = "collective-"  # a blocking torch.distributed collective every rank joins

    COMPUTE = (FWD, BWD)
    P2P = (FWD_SEND, FWD_RECV, BWD_SEND, BWD_RECV)
    DP_COMM = (PARAMS_AG, GRADS_RS, GRADS_AR, SEPARATE_AR)
    # ops that move data between ranks: the ideal duration is their median, not their mean
    NONBLOCKING = (FWD_SEND_WAIT, BWD_SEND_WAIT, FWD_RECV_POST, BWD_RECV_POST)
    COMM = (*P2P, *NONBLOCKING, *DP_COMM, LAYERNORM_AR, EMBEDDING_AR, CLIP)


def is_dp_collective(optype: str) -> bool:
    """An op every data-parallel rank of the stage meets at."""
    return (
        optype in OpType.DP_COMM
        or optype == OpType.DDP_BACKWARD
        or optype.startswith(OpType.COLLECTIVE_PREFIX)
    )


def is_comm(optype: str) -> bool:
    """An op that moves data between ranks (its typical time is its median transfer)."""
    return optype in OpType.COMM or is_dp_collective(optype)


@dataclass(frozen=True)
class Layout:
    """The job's parallel layout as far as the op table shows it (TP ranks fold into a worker)."""

    dp: int
    pp: int
    tp: int
    vpp: int  # model chunks per stage (1: no interleaving)
    dp_sync: bool  # data-parallel collectives present (dp > 1, or a context-parallel split)
    serial: bool = False  # each rank's ops block one another (send/recv on the training thread)
    oneway_sends: bool = False  # serial, but a send never waits for its receive (isend + wait)

    @property
    def workers(self) -> int:
        return self.dp * self.pp


def normalize(table: pd.DataFrame) -> pd.DataFrame:
    """The table with every column of `COLUMNS`, typed, starts relative to each step's first op
    (rows in the order given). Missing optional columns get their defaults; a missing
    required one raises ValueError."""
    required = {"rank", "step", "optype", "start", "duration"}
    missing = required - set(table.columns)
    if missing:
        raise ValueError(f"op table lacks the columns {sorted(missing)}")
    out = pd.DataFrame(index=table.index)
    for col, default in (("dp", None), ("pp", 0), ("tp", 0), ("mb", -1), ("chunk", -1), ("gchunk", -1)):
        if col in table.columns:
            out[col] = table[col].to_numpy()
        elif col == "dp":
            out[col] = table["rank"].to_numpy()
        else:
            out[col] = default
    out["rank"] = table["rank"].to_numpy()
    out["step"] = table["step"].to_numpy()
    optype = table["optype"]
    out["optype"] = optype.to_numpy() if isinstance(optype.dtype, pd.CategoricalDtype) else optype.astype(str)
    out["start"] = table["start"].to_numpy(dtype=np.float64)
    out["duration"] = np.clip(table["duration"].to_numpy(dtype=np.float64), 0.0, None)
    if not np.isfinite(out["start"].to_numpy()).all() or not np.isfinite(out["duration"].to_numpy()).all():
        raise ValueError("op table holds a start or duration that is not a number")
    for col in INT_COLUMNS:  # int32: a table of 10^8 ops stays a few GiB
        if col != "seq":
            out[col] = out[col].astype(np.int32)
    steps, step_ix = np.unique(out["step"].to_numpy(), return_inverse=True)
    first = np.full(len(steps), np.inf)
    np.minimum.at(first, step_ix, out["start"].to_numpy())
    out["start"] = out["start"].to_numpy() - first[step_ix]
    if "seq" in table.columns:
        out["seq"] = table["seq"].to_numpy().astype(np.int32)
    else:
        out = out.sort_values(["step", "rank", "start"], kind="stable")
        out["seq"] = out.groupby(["step", "rank", "optype"]).cumcount().astype(np.int32)
    out["optype"] = out["optype"].astype("category")
    return out[list(COLUMNS)].reset_index(drop=True)


def layout_of(
    table: pd.DataFrame,
    vpp: int | None = None,
    dp_sync: bool | None = None,
    serial: bool = False,
    oneway_sends: bool = False,
) -> Layout:
    """The layout the table shows; `vpp` and `dp_sync` from the job's metadata when known;
    `serial`: the ops were recorded as blocking calls of one thread per rank; `oneway_sends`:
    its sends were non-blocking (isend: the data leaves at the call, the sender goes on)."""
    dp = int(table["dp"].max()) + 1
    pp = int(table["pp"].max()) + 1
    tp = int(table["tp"].max()) + 1
    if vpp is None:
        vpp = int(table["chunk"].max()) + 1 if (table["chunk"] >= 0).any() else 1
    return Layout(
        dp=dp,
        pp=pp,
        tp=tp,
        vpp=max(1, vpp),
        dp_sync=dp > 1 if dp_sync is None else dp_sync,
        serial=serial,
        oneway_sends=oneway_sends,
    )


def step_times(table: pd.DataFrame, per_rank: bool = False) -> pd.Series:
    """Recorded wall time of each step: its last op's end less its first op's start; with
    `per_rank`, the longest rank's (a pipeline's stages start a step at different times: the
    last stage's ends before the first stage's does, and the next one starts then)."""
    end = table["start"] + table["duration"]
    frame = pd.DataFrame({"step": table["step"], "start": table["start"], "end": end})
    if per_rank:
        by_rank = frame.assign(rank=table["rank"]).groupby(["step", "rank"])
        span = by_rank["end"].max() - by_rank["start"].min()
        return span.groupby(level="step").max().rename("step_time")
    grouped = frame.groupby("step")
    return (grouped["end"].max() - grouped["start"].min()).rename("step_time")


# -- Megatron's per-rank timers (traindx.profiler.megatron_timers, printed with
# `--timing-log-level 2 --timing-log-option all`): one op per timer, rank and logged interval (the
# interval's mean iteration), in program order on each rank; ranks map to (dp, pp, tp) in
# Megatron's default order (tensor-parallel fastest, then data, then pipeline). Timers give each
# rank's totals, not its micro-batches: the replay joins the stages only where they meet
# (embedding all-reduce, gradient clipping), so pipeline overlap and bubbles are not modelled
# (docs/what-if.md).
TIMER_OPTYPE = {
    "batch-generator": "data",
    "params-all-gather": OpType.PARAMS_AG,
    "forward-compute": OpType.FWD,
    "backward-compute": OpType.BWD,
    "all-grads-sync": OpType.GRADS_AR,
    "layernorm-grads-all-reduce": OpType.LAYERNORM_AR,
    "embedding-grads-all-reduce": OpType.EMBEDDING_AR,
    "optimizer-clip-main-grad": OpType.CLIP,
    "optimizer": OpType.OPTIMIZER,
}
PROGRAM = list(TIMER_OPTYPE)  # the order the timed regions run in, on every rank


def from_timers(rows: pd.DataFrame, tp: int = 1, pp: int = 1) -> pd.DataFrame:
    """rows: interval, iteration, timer, rank, ms (as read). Empty when no timer is known."""
    rows = rows[rows["timer"].isin(PROGRAM)]
    if rows.empty:
        return pd.DataFrame()
    wide = rows.pivot_table(index=["interval", "rank"], columns="timer", values="ms", aggfunc="sum")
    wide = wide.fillna(0.0) / 1000.0
    if "optimizer" in wide and "optimizer-clip-main-grad" in wide:  # clip is timed inside optimizer
        wide["optimizer"] = (wide["optimizer"] - wide["optimizer-clip-main-grad"]).clip(lower=0.0)
    iteration = rows.groupby("interval")["iteration"].max()
    world = int(rows["rank"].max()) + 1
    dp = max(1, world // max(1, tp * pp))
    parts = []
    clock = np.zeros(len(wide))
    ranks = wide.index.get_level_values("rank").to_numpy()
    intervals = wide.index.get_level_values("interval").to_numpy()
    step = np.where(
        iteration.reindex(intervals).to_numpy() >= 0, iteration.reindex(intervals).to_numpy(), intervals
    )
    for timer in PROGRAM:
        if timer not in wide:
            continue
        dur = wide[timer].to_numpy()
        parts.append(
            pd.DataFrame(
                {
                    "rank": ranks,
                    "tp": ranks % tp,
                    "dp": (ranks // tp) % dp,
                    "pp": ranks // (tp * dp),
                    "step": step,
                    "optype": TIMER_OPTYPE[timer],
                    "start": clock.copy(),
                    "duration": dur,
                }
            )
        )
        clock = clock + dur
    table = pd.concat(parts, ignore_index=True)
    table = table[table["pp"] < pp]
    return normalize(table)
