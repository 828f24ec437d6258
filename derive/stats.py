"""A/B statistics: the steady window, medians, a bootstrap interval on the speedup, and a loss
curve's trend and noise (what the loss-parity judge, traindx.analyzers.core.parity, reads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# the fewest steps an arm needs in the window for the mean's bootstrap interval (mean_speedup)
MIN_STEPS_FOR_MEAN = 5


def steady_window(n_steps: int, window: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """(first, last) step indices, inclusive, of the steady part of a run of n_steps.

    Default: skip the first quarter (at least one step, the warm-up step that compiles and
    allocates), as the recipe cards do (steps 5-19 of 20). `window` overrides it.
    """
    if n_steps <= 0:
        return None
    if window is not None:
        first, last = window
        last = min(last, n_steps - 1)
        if first > last:
            raise ValueError(f"window {first}:{window[1]} holds no step of a {n_steps}-step run")
        return first, last
    skip = min(max(1, n_steps // 4), n_steps - 1)
    return skip, n_steps - 1


def parse_window(text: str) -> tuple[int, int]:
    """'5:19' -> (5, 19); both ends inclusive, 0-based step numbers."""
    try:
        first, last = (int(x) for x in str(text).split(":"))
    except ValueError:
        raise ValueError(f"window {text!r} is not FIRST:LAST (e.g. 5:19)") from None
    if first < 0 or last < first:
        raise ValueError(f"window {text!r}: need 0 <= FIRST <= LAST")
    return first, last


def coefficient_of_variation(values: Sequence[float] | np.ndarray) -> float | None:
    """Sample standard deviation / mean (a fraction, not percent); None for fewer than 2."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2 or values.mean() == 0:
        return None
    return float(values.std(ddof=1) / values.mean())


STATISTICS: dict[str, Callable[..., Any]] = {"median": np.median, "mean": np.mean}


def bootstrap_speedup(
    baseline_s: Sequence[float] | np.ndarray,
    candidate_s: Sequence[float] | np.ndarray,
    n_resamples: int = 5000,
    confidence: float = 0.95,
    seed: int = 0,
    statistic: str = "median",
) -> tuple[float, float, float]:
    """Speedup = median(baseline) / median(candidate) (or the means: statistic="mean", for step
    times with a period, where the median sits in one mode), with a percentile bootstrap
    interval (each arm resampled with replacement, independently). Seeded: the same runs give
    the same interval."""
    base = np.asarray(baseline_s, dtype=float)
    cand = np.asarray(candidate_s, dtype=float)
    if not len(base) or not len(cand):
        raise ValueError("both arms need at least one step in the window")
    of = STATISTICS[statistic]
    point = float(of(base) / of(cand))
    rng = np.random.default_rng(seed)
    base_values = of(rng.choice(base, size=(n_resamples, len(base))), axis=1)
    cand_values = of(rng.choice(cand, size=(n_resamples, len(cand))), axis=1)
    ratios = base_values / cand_values
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    return point, float(low), float(high)


def mean_speedup(
    baseline_s: Sequence[float] | np.ndarray,
    candidate_s: Sequence[float] | np.ndarray,
    n_resamples: int = 5000,
    seed: int = 0,
) -> tuple[float, list[float]] | tuple[None, None]:
    """(mean(baseline) / mean(candidate), 95 % bootstrap interval) over an A/B comparison's window
    values, or (None, None) under MIN_STEPS_FOR_MEAN steps an arm. For a periodic cost (a
    checkpoint every k steps) the median of the step series sits in one of its modes, so the
    median ratio misses the saving (or flips between modes, k = 2); the mean is what the cost
    adds per step."""
    base = np.asarray(baseline_s, dtype=float)
    cand = np.asarray(candidate_s, dtype=float)
    if len(base) < MIN_STEPS_FOR_MEAN or len(cand) < MIN_STEPS_FOR_MEAN or cand.mean() <= 0:
        return None, None
    point, low, high = bootstrap_speedup(base, cand, n_resamples=n_resamples, seed=seed, statistic="mean")
    return point, [low, high]


def trend_and_noise(values: Sequence[float] | np.ndarray) -> tuple[float, float | None]:
    """(trend, noise) of a curve: the change a straight line fitted to it makes over its points
    (absolute), and the standard deviation of the points around that line (None under 3 points:
    a line through 2 points leaves nothing to measure the noise by)."""
    y = np.asarray(values, dtype=float)
    n = len(y)
    if n < 2:
        return 0.0, None
    x = np.arange(n, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    trend = float(abs(slope) * (n - 1))
    if n < 3:
        return trend, None
    residuals = y - (slope * x + intercept)
    return trend, float(np.sqrt(np.sum(residuals**2) / (n - 2)))


@dataclass
class ArmSummary:
    steps: int  # steps recorded
    window: tuple[int, int] | None  # (first, last) step, inclusive
    window_steps: int
    median_step_s: float | None
    mean_step_s: float | None
    step_time_cv: float | None  # fraction
    tokens_per_step: float | None
    tokens_per_s: float | None  # of the whole job, over the window

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window_values(
    step_times: Sequence[float] | np.ndarray,
    window: tuple[int, int] | None = None,
    exclude: Iterable[int] = (),
) -> tuple[np.ndarray, tuple[int, int] | None]:
    """(the step times inside the steady window, minus the positions in `exclude`; bounds).
    Nothing is excluded when that would leave the window empty."""
    times = np.asarray(step_times, dtype=float)
    positions, bounds = window_positions(len(times), window, exclude)
    if bounds is None:
        return times[:0], None
    w = times[positions]
    return w[np.isfinite(w)], bounds


def window_positions(
    n_steps: int, window: tuple[int, int] | None = None, exclude: Iterable[int] = ()
) -> tuple[list[int], tuple[int, int] | None]:
    """(the positions window_values keeps, the window's bounds)."""
    bounds = steady_window(n_steps, window)
    if bounds is None:
        return [], None
    left_out = set(exclude)
    positions = [i for i in range(bounds[0], bounds[1] + 1) if i not in left_out]
    return positions or list(range(bounds[0], bounds[1] + 1)), bounds


def summarize_arm(
    step_times: Sequence[float] | np.ndarray,
    window: tuple[int, int] | None = None,
    tokens_per_step: float | None = None,
    exclude: Iterable[int] = (),
) -> tuple[ArmSummary, np.ndarray]:
    """Median / mean / CV of the steady window of one arm's step times (seconds, in order);
    `exclude`: positions left out of the window (steps slowed by a profiler on purpose)."""
    times = np.asarray(step_times, dtype=float)
    w, bounds = window_values(times, window, exclude)
    if bounds is None:
        return ArmSummary(0, None, 0, None, None, None, tokens_per_step, None), w
    median = float(np.median(w)) if len(w) else None
    mean = float(np.mean(w)) if len(w) else None
    tokens_per_s = (tokens_per_step / mean) if (tokens_per_step and mean) else None
    return (
        ArmSummary(
            len(times),
            bounds,
            len(w),
            median,
            mean,
            coefficient_of_variation(w),
            tokens_per_step,
            tokens_per_s,
        ),
        w,
    )
