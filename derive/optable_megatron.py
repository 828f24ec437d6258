"""The op table of Megatron's per-rank timers (`traindx.profiler.megatron_timers`, printed with
`--timing-log-level 2 --timing-log-option all`): one op per timer, rank and logged interval
(the interval's mean iteration), placed in program order on each rank.

Ranks map to (dp, pp, tp) in Megatron's default order (tensor-parallel fastest, then data, then
pipeline). Timers give each rank's totals, not its micro-batches: the replay joins the stages
only where they meet (embedding all-reduce, gradient clipping), so pipeline overlap and bubbles
are not modelled (docs/what-if.md).

Pure computation: no judgement.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from traindx.derive.optable import OpType, normalize

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
