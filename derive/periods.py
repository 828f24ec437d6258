"""The period of a series of step values (a ledger line, the step times): the shortest k (k = 2
included) whose dearest residue is larger than the other steps nearly always, beyond chance.

Derive layer (statistics, no Finding): analyzers.stability names a ledger line's period with it,
recipes.ab decides by it whether two arms' step times are compared by their means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]

LINE_PERIOD_MAX = 8  # longer periods are the slow-step search's business
LINE_MIN_EXCESS_SHARE = 0.03  # of the mean step: the dear steps' excess on that line
LINE_MIN_EXCESS_S = 0.002
LINE_MIN_AGREEMENT = 0.9  # share of (dear step, other step) pairs in that order
LINE_HALF_AGREEMENT = 0.8  # ...in each half of the window on its own
LINE_PERMUTATIONS = 199  # shuffles of a line's values for the chance level of its best period
LINE_PERMUTATION_SEED = 0  # fixed: the same run always gives the same findings
LINE_MAX_P = 0.01  # family-wise, over every period tried
LINE_REFINE_P = 0.05  # a p-value between LINE_MAX_P and this is measured again, finer:
LINE_PERMUTATIONS_REFINED = 1999  # ...with this many shuffles
LINE_MAX_STEPS = 512  # the last steps of the window are enough to see a period
LINE_MIN_REPEATS = 4  # steps of each residue in the window


def series_period(steps: Sequence[int], values: Sequence[float]) -> dict[str, Any] | None:
    """The period of one series of step times (k = 2 included), by period_of's test (the one
    analyzers.stability makes on each ledger line): {period, residue, steps, excess_s, slow_s,
    other_s, auc, p_value}, or None."""
    steps_arr = np.asarray(steps, dtype=np.int64)
    values_arr = np.asarray(values, dtype=float)
    if len(values_arr) < 6 or not np.isfinite(values_arr).all() or values_arr.mean() <= 0:
        return None
    order = steps_arr.argsort(kind="stable")
    return period_of(steps_arr[order], values_arr[order], float(values_arr.mean()))


def _auc(on: Array, off: Array) -> float:
    """Share of (dear-residue step, other step) pairs where the dear one is larger."""
    if not len(on) or not len(off):
        return 0.0
    return float((on[:, None] > off[None, :]).mean())


def _best_auc_per_period(
    ranks: Array, residues_by_period: list[Array], counts_by_period: list[Array]
) -> Array:
    """Per period: the largest rank-sum AUC of one residue against the others (Mann-Whitney),
    for each row of `ranks` (observed first, then permutations); shape (rows, periods)."""
    rows, n = ranks.shape
    out = np.empty((rows, len(residues_by_period)))
    flat = ranks.ravel()
    for j, (res, counts) in enumerate(zip(residues_by_period, counts_by_period)):
        p = len(counts)  # one bincount over every row (row r's residues offset by r * p): the
        # same sums, in the same order, as one bincount per row
        at = (res[None, :] + p * np.arange(rows)[:, None]).ravel()
        sums = np.bincount(at, weights=flat, minlength=rows * p).reshape(rows, p)
        u = sums - counts * (counts + 1) / 2
        out[:, j] = (u / (counts * (n - counts))).max(axis=1)
    return out


def _null_of_best(
    ranks: Array, res: list[Array], counts: list[Array], permutations: int
) -> tuple[Array, Array]:
    """The observed best AUC per period, and the best over every period of each of
    `permutations` seeded shuffles (the family-wise null)."""
    rng = np.random.default_rng(LINE_PERMUTATION_SEED)
    shuffled = np.stack([ranks] + [rng.permutation(ranks) for _ in range(permutations)])
    best = _best_auc_per_period(shuffled, res, counts)
    return best[0], best[1:].max(axis=1)


def period_of(steps: Array, values: Array, step_s: float) -> dict[str, Any] | None:
    """The shortest period whose dearest residue is larger than the other steps nearly always
    (rank AUC), beyond what any period reaches on the same values shuffled (a family-wise
    permutation test over every period tried: a noisy line aligns with some period by chance),
    in both halves of the window, with an excess worth naming; None when none is."""
    need = max(LINE_MIN_EXCESS_S, LINE_MIN_EXCESS_SHARE * step_s)
    steps, values = steps[-LINE_MAX_STEPS:], values[-LINE_MAX_STEPS:]
    periods = [
        p
        for p in range(2, min(LINE_PERIOD_MAX, len(steps) // LINE_MIN_REPEATS) + 1)
        if np.bincount(steps % p, minlength=p).min() >= LINE_MIN_REPEATS
    ]
    if not periods:
        return None
    order = values.argsort(kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    res = [steps % p for p in periods]
    counts = [np.bincount(r, minlength=p).astype(float) for r, p in zip(res, periods)]
    observed_auc, null_max = _null_of_best(ranks, res, counts, LINE_PERMUTATIONS)
    half = len(steps) // 2
    refined = None
    for j, period in enumerate(periods):
        observed = observed_auc[j]
        p_value = (1 + int((null_max >= observed).sum())) / (1 + LINE_PERMUTATIONS)
        if observed >= LINE_MIN_AGREEMENT and LINE_MAX_P < p_value <= LINE_REFINE_P:
            # near the threshold 199 shuffles cannot tell: a perfect alternation in 24 steps
            # was missed in 2 % of value orders, two shuffles by chance as perfect (p = 3/200)
            if refined is None:
                refined = _null_of_best(ranks, res, counts, LINE_PERMUTATIONS_REFINED)[1]
            p_value = (1 + int((refined >= observed).sum())) / (1 + LINE_PERMUTATIONS_REFINED)
        if observed < LINE_MIN_AGREEMENT or p_value > LINE_MAX_P:
            continue
        residues = res[j]
        medians = {r: float(np.median(values[residues == r])) for r in range(period)}
        top = max(medians, key=lambda r: medians[r])
        mask = residues == top
        on, off = values[mask], values[~mask]
        slow, other = float(np.median(on)), float(np.median(off))
        excess = slow - other
        if excess < need:
            continue
        if (
            min(
                _auc(values[:half][mask[:half]], values[:half][~mask[:half]]),
                _auc(values[half:][mask[half:]], values[half:][~mask[half:]]),
            )
            < LINE_HALF_AGREEMENT
        ):
            continue
        return {
            "period": period,
            "residue": int(top),
            "steps": [int(s) for s in steps[mask]],
            "excess_s": excess,
            "slow_s": slow,
            "other_s": other,
            "auc": round(float(observed), 3),
            "p_value": round(p_value, 4),
        }
    return None
