"""Quantities written for people, one way everywhere (findings' titles, terminal, report)."""

import math


def fmt_s(seconds: float | None) -> str:
    """Seconds for people: 280 s, 12.3 s, 1.23 s, 45.6 ms, 12 µs; '–' for None/NaN."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    s = float(seconds)
    if abs(s) >= 100:
        return f"{s:.0f} s"
    if abs(s) >= 10:
        return f"{s:.1f} s"
    if abs(s) >= 1:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s == 0:
        return "0 s"
    return f"{s * 1e6:.3g} µs"


def ordinal(n: int) -> str:
    """1 -> "1st", 2 -> "2nd", 11 -> "11th", 23 -> "23rd"."""
    return f"{n}{'tsnrhtdd'[(n // 10 % 10 != 1) * (n % 10 < 4) * n % 10 :: 4]}"
