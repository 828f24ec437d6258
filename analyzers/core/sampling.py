"""Which ranks the per-rank analyzers read on a large job.

Per-rank analyzers (stability, GC, allocator, compiles, data loading...) write one finding per
rank and cost a few tens of milliseconds per rank in pandas; on a thousand-rank job that is
minutes of analysis and a thousand near-identical findings. Past MAX_ANALYZED_RANKS ranks they
read a sample instead, chosen from every rank's numbers at once (vectorised, O(rank-steps)):
the first and last rank, and for each measure the ranks at both of its extremes - median, p90
and max step time, and the mean of every time-ledger line (compile, GC, data, I/O, sync,
collective, optimizer, fwd/bwd, unexplained) - so any rank that differs from the others in
what the ledger measures is read. Cross-rank analyzers (the straggler) read every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

MAX_ANALYZED_RANKS = 64
PER_MEASURE = 2  # ranks taken at each end of each measure


def representative_ranks(run: RunRecord) -> list[str]:
    """The ranks to analyze one by one (all of them on a job of MAX_ANALYZED_RANKS or fewer)."""
    ranks = list(run.ranks)
    if len(ranks) <= MAX_ANALYZED_RANKS:
        return ranks
    measures = []
    steps = run.steps.dropna(subset=["duration_s"])
    if len(steps):
        d = steps.groupby("rank", sort=False)["duration_s"]
        measures += [d.median(), d.quantile(0.9), d.max(), d.size()]
    led = run.ledger
    if len(led):
        cols = [c for c in led.columns if c.endswith("_s")]
        means = led.groupby("rank", sort=False)[cols].mean()
        measures += [means[c] for c in cols]
    compiles = run.compiles
    if len(compiles):
        measures.append(compiles.groupby("rank", sort=False).size())
    chosen = [ranks[0], ranks[-1]]
    for m in measures:
        m = m[np.isfinite(m.to_numpy(np.float64))]
        if m.nunique() <= 1:
            continue  # every rank alike on this measure
        order = m.sort_values(kind="stable").index.tolist()
        chosen += order[-PER_MEASURE:][::-1] + order[:PER_MEASURE]
    picked = list(dict.fromkeys(r for r in chosen if r in set(ranks)))[:MAX_ANALYZED_RANKS]
    keep = set(picked)
    return [r for r in ranks if r in keep]
