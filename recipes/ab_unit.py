"""The unit of work an A/B compares (judge layer: recipes).

An arm whose change moves the step boundary (gradient accumulation put right: one optimizer step
per N backward passes where the baseline stepped after each) does N micro-batches of work in one
of its steps: its step time is no measure against the baseline's. Where the two arms' backward
calls per step differ, each step's time is divided by its backward calls, so both arms are judged
in seconds per micro-batch, whichever the step boundary is; and the loss per step is then no
check of the numerics (the weights are updated at another rate): analyzers/core/parity.py's `updates`
rule decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.derive.steptables import backwards_per_step

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

Arm = tuple[pd.Series, str | None, list[int]]


def _typical(counts: pd.Series) -> float | None:
    """The backward calls of a typical step (the median after step 0, which holds start-up)."""
    counts = counts[counts.index > counts.index.min()] if len(counts) > 1 else counts
    return float(counts.median()) if len(counts) else None


def per_micro_batch(
    baseline: RunRecord, candidate: RunRecord, base_arm: Arm, cand_arm: Arm
) -> tuple[Arm, Arm, dict[str, Any] | None]:
    """(baseline arm, candidate arm, the unit) with each arm's step times divided by the backward
    calls of that step where the two arms' backward calls per step differ; else the arms as they
    are and None."""
    base_counts, cand_counts = backwards_per_step(baseline), backwards_per_step(candidate)
    base_n, cand_n = _typical(base_counts), _typical(cand_counts)
    if not base_n or not cand_n or abs(base_n - cand_n) < 0.5:
        return base_arm, cand_arm, None
    unit = {
        "name": "micro-batch",
        "backward_per_step": {"baseline": base_n, "candidate": cand_n},
        "update_ratio": cand_n / base_n,
        "note": (
            f"the arms take {base_n:g} and {cand_n:g} backward passes per optimizer step: "
            "compared in seconds per micro-batch (a step's time divided by its backward passes)"
        ),
    }
    return _divided(base_arm, base_counts), _divided(cand_arm, cand_counts), unit


def _divided(arm: Arm, counts: pd.Series) -> Arm:
    series, source, profiled = arm
    per = counts.reindex(series.index).to_numpy(dtype=float)
    values = series.to_numpy(dtype=float) / np.where(per > 0, per, np.nan)
    keep = np.isfinite(values)
    kept_positions = np.flatnonzero(keep)
    new_position = {int(old): new for new, old in enumerate(kept_positions)}
    out = pd.Series(values[keep], index=series.index[keep], dtype=float)
    return out, source, [new_position[p] for p in profiled if p in new_position]
