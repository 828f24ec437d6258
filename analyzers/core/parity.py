"""Loss parity: whether a candidate arm's loss curve says its numerics are the baseline's.

The thresholds are Megatron-Bridge's `validate_convergence` (reference/FACTS.md §6). Which rule
decides depends on what the curve can show, and the comparison names it (docs/fix.md): `trend`
(a long curve whose trend stands above its noise: the correlation counts), `pointwise` (few
points or a flat curve, where the correlation of noise with noise says nothing), `level` (a flat
curve as noisy as the tolerance: a change of data order moves each point within that noise, so
the curves' levels decide) and `updates` (arms that update the weights at different rates differ
per step by design: finite and not diverging passes)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from traindx.derive.stats import trend_and_noise

MIN_CORRELATION = 0.95
MAX_FAILED_POINT_SHARE = 0.10
MAX_FINAL_LOSS_DIFFERENCE = 0.05
SKIP_FIRST_SHARE = 0.20
# the correlation decides only on a curve of this many points (after the skip) ...
MIN_TREND_POINTS = 8
# ... whose fitted trend is this many times its noise
TREND_OVER_NOISE = 3.0
# a flat curve whose noise reaches this share of the pointwise tolerance: a data order moves points
NOISE_OVER_TOLERANCE = 0.5
LEVEL_STANDARD_ERRORS = 2.0
MAX_NOISE_RATIO = 2.0

TREND, POINTWISE, LEVEL, UPDATES, UNCHECKED = "trend", "pointwise", "level", "updates", "unchecked"
RULE_TEXT = {
    TREND: "trend: correlation, pointwise tolerance and final loss (a curve with a trend above its noise)",
    POINTWISE: "pointwise tolerance and final loss (few or flat points: correlation not used)",
    LEVEL: "level within noise (a flat noisy curve: a different data order moves points, not the level)",
    UPDATES: (
        "updates: the arms update the weights at different rates (one update per N micro-batches), "
        "so loss per step is no numerics check; finite losses and no divergence decide"
    ),
    UNCHECKED: "no comparable curve",
}


def pointwise_tolerance(golden_loss: float) -> float:
    """Relative tolerance for one point, by the golden (reference) loss level."""
    if golden_loss > 2.0:
        return 0.10
    if golden_loss > 0.5:
        return 0.05
    return 0.02


@dataclass
class LossParity:
    passed: bool
    points: int  # aligned points compared (after the skip)
    skipped: int  # leading points skipped
    correlation: float | None
    correlation_passed: bool  # True where the correlation was not used to decide
    pointwise_failures: int
    pointwise_failed_share: float
    pointwise_passed: bool
    final_loss_difference: float | None
    final_loss_passed: bool
    reasons: list[str] = field(default_factory=list)  # why it failed, one line each
    note: str = ""
    decided_by: str = UNCHECKED  # trend | pointwise | level | updates | unchecked
    rule: str = RULE_TEXT[UNCHECKED]  # the rule that decided, in words
    trend: float | None = None  # the baseline's fitted change over the window
    noise: float | None = None  # its points' deviation from that line
    level_difference: float | None = None  # |mean(candidate) - mean(baseline)| / |mean(baseline)|

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _unchecked(points: int, skipped: int, failures: int, failed_share: float, reason: str) -> LossParity:
    """A failed parity whose thresholds could not be computed (too few or non-finite points)."""
    return LossParity(
        False, points, skipped, None, False, failures, failed_share, False, None, False, [reason]
    )


def _has_trend(points: int, trend: float, noise: float | None) -> bool:
    if points < MIN_TREND_POINTS or noise is None:
        return False
    return trend > 0 and trend >= TREND_OVER_NOISE * noise


def _correlation(g: np.ndarray, c: np.ndarray) -> tuple[float | None, bool, str]:
    """(Pearson correlation, whether it reaches MIN_CORRELATION, a note): undefined on a flat curve,
    where the points must then agree exactly to pass."""
    if np.std(g) == 0 or np.std(c) == 0:
        return None, bool(np.allclose(g, c, rtol=1e-6, atol=0)), "a flat loss curve: correlation undefined"
    correlation = float(np.corrcoef(g, c)[0, 1])
    return correlation, correlation >= MIN_CORRELATION, ""


def _noise_explains(failures: int, points: int, level: float, noise: float, cand_noise: float) -> str:
    """Why not, where more points leave the tolerance than the two curves' noise explains: two
    independent draws differ by N(0, sqrt(noise^2 + cand_noise^2)) at a point, so a share p of
    the points leaves the tolerance by chance; more than p*n plus two binomial standard errors is
    no data order (10 of 10 points outside with a p of one half happens 1 time in 1000). A noise
    that would put most points outside (p over one half) leaves the tolerance no meaning: parity
    is not shown, whatever the levels, so more than half the points outside never passes."""
    spread = math.sqrt(noise**2 + cand_noise**2)
    share = math.erfc(pointwise_tolerance(level) * abs(level) / (spread * math.sqrt(2))) if spread else 0.0
    allowed = min(
        points * share + LEVEL_STANDARD_ERRORS * math.sqrt(points * share * (1 - share)), points / 2
    )
    if failures > allowed:
        return (
            f"{failures} of {points} points outside the pointwise tolerance, more than the noise "
            f"explains (about {points * share:.1f})"
        )
    return ""


def _same_level(g: np.ndarray, c: np.ndarray, noise: float, failures: int) -> tuple[bool, float, str]:
    """(the levels agree within the noise and the points leave the tolerance no more often than
    that noise explains, their relative difference, why not)."""
    level = float(np.mean(g))
    difference = float(abs(np.mean(c) - level))
    relative = difference / max(abs(level), 1e-12)
    _, cand_noise = trend_and_noise(c)
    se = math.sqrt(noise**2 / len(g) + (cand_noise or 0.0) ** 2 / len(c))
    allowed = max(pointwise_tolerance(level) * abs(level), LEVEL_STANDARD_ERRORS * se)
    if cand_noise is not None and cand_noise > MAX_NOISE_RATIO * noise:
        return (
            False,
            relative,
            f"the candidate's noise {cand_noise:.3g} > {MAX_NOISE_RATIO:g}× the baseline's",
        )
    if difference > allowed:
        return False, relative, f"the mean loss differs by {relative:.1%}, beyond the noise and the tolerance"
    too_many = _noise_explains(failures, len(g), level, noise, cand_noise or 0.0)
    return not too_many, relative, too_many


def _decide(
    g: np.ndarray,
    c: np.ndarray,
    update_ratio: float | None,
    passed: bool,
    correlation: float | None,
    correlation_ok: bool,
    trend: float,
    noise: float | None,
    failures: int,
) -> tuple[bool, str, bool, list[str], float | None]:
    """Which rule decides and its answer: (passed, decided_by, correlation_ok, reasons, level
    difference). `passed` comes in as the pointwise and final-loss answer."""
    reasons: list[str] = []
    level_difference = None
    if update_ratio is not None and abs(update_ratio - 1.0) > 1e-9:
        decided_by = UPDATES
        correlation_ok = True  # reported, not used
        ceiling = float(np.max(g)) * (1.0 + pointwise_tolerance(float(np.max(g))))
        passed = bool(c[-1] <= ceiling)
        if not passed:
            reasons.append(f"the candidate diverged: its last loss {c[-1]:.4g} > {ceiling:.4g}")
    elif _has_trend(len(g), trend, noise):
        decided_by = TREND
        passed = passed and correlation_ok
        if not correlation_ok:
            shown = correlation if correlation is None else round(correlation, 4)
            reasons.append(f"correlation {shown} < {MIN_CORRELATION}")
    else:
        decided_by = POINTWISE
        correlation_ok = True  # reported, not used
        level = abs(float(np.mean(g)))
        noisy = noise is not None and noise >= NOISE_OVER_TOLERANCE * pointwise_tolerance(level) * level
        if noisy and noise is not None and not passed:
            decided_by = LEVEL
            passed, level_difference, why = _same_level(g, c, noise, failures)
            reasons += [why] if why else []
    return passed, decided_by, correlation_ok, reasons, level_difference


def loss_parity(golden: Any, candidate: Any, update_ratio: float | None = None) -> LossParity:
    """Compare two loss curves, aligned point by point (same steps); golden = the reference arm.
    `update_ratio`: the candidate's micro-batches per weight update over the baseline's, where
    they differ (the `updates` rule decides).

    Returns a LossParity whose `decided_by` names the rule that decided (module docstring). Too
    few points, or a NaN/inf loss in either arm, fail.
    """
    golden = np.asarray(golden, dtype=float)
    candidate = np.asarray(candidate, dtype=float)
    if golden.shape != candidate.shape:
        raise ValueError("loss curves must be aligned (same steps)")
    n = len(golden)
    skip = int(math.floor(n * SKIP_FIRST_SHARE))
    g, c = golden[skip:], candidate[skip:]
    if not np.all(np.isfinite(c)) or not np.all(np.isfinite(g)):
        bad = "candidate" if not np.all(np.isfinite(c)) else "reference"
        return _unchecked(len(g), skip, len(g), 1.0, f"the {bad} arm has NaN/inf losses")
    if len(g) < 2:
        return _unchecked(len(g), skip, 0, 0.0, f"only {len(g)} comparable loss point(s): need at least 2")

    trend, noise = trend_and_noise(g)
    correlation, correlation_ok, note = _correlation(g, c)
    tolerance = np.array([pointwise_tolerance(x) for x in g])
    relative = np.abs(c - g) / np.maximum(np.abs(g), 1e-12)
    failures = int(np.sum(relative > tolerance))
    failed_share = failures / len(g)
    pointwise_ok = failed_share <= MAX_FAILED_POINT_SHARE
    final_difference = float(abs(c[-1] - g[-1]) / max(abs(g[-1]), 1e-12))
    final_ok = final_difference <= MAX_FINAL_LOSS_DIFFERENCE

    passed, decided_by, correlation_ok, reasons, level_difference = _decide(
        g, c, update_ratio, pointwise_ok and final_ok, correlation, correlation_ok, trend, noise, failures
    )
    if decided_by not in (LEVEL, UPDATES):
        if not pointwise_ok:
            reasons.append(
                f"{failures} of {len(g)} points outside the pointwise tolerance (> {MAX_FAILED_POINT_SHARE:.0%})"
            )
        if not final_ok:
            reasons.append(
                f"final loss differs by {final_difference:.1%} (> {MAX_FINAL_LOSS_DIFFERENCE:.0%})"
            )
    return LossParity(
        passed,
        len(g),
        skip,
        correlation,
        correlation_ok,
        failures,
        failed_share,
        pointwise_ok,
        final_difference,
        final_ok,
        reasons,
        note,
        decided_by,
        RULE_TEXT[decided_by],
        trend,
        noise,
        level_difference,
    )


def thresholds() -> dict[str, Any]:
    """The thresholds, as comparison.json lists them."""
    return {
        "min_correlation": MIN_CORRELATION,
        "correlation_decides_from": {"points": MIN_TREND_POINTS, "trend_over_noise": TREND_OVER_NOISE},
        "pointwise_tolerance": {"golden > 2.0": 0.10, "golden > 0.5": 0.05, "else": 0.02},
        "max_failed_point_share": MAX_FAILED_POINT_SHARE,
        "max_final_loss_difference": MAX_FINAL_LOSS_DIFFERENCE,
        "skip_first_share": SKIP_FIRST_SHARE,
    }
