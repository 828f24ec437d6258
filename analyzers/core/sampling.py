"""Which ranks the per-rank analyzers read on a large job.

Per-rank analyzers cost tens of milliseconds per rank and write a finding per rank: minutes and a
thousand near-identical findings on a thousand ranks. Past MAX_ANALYZED_RANKS they read the first
and last rank and the ranks at both extremes of every step-time and ledger measure (vectorised),
so any rank that differs in what the ledger measures is read. Cross-rank analyzers read all."""

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
