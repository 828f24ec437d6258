"""Values as the report shows them: every string clipped and redacted, numbers that may be NaN
read as None, step numbers as ranges, frames as file:line (function)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from traindx.common import redact

MAX_TEXT = 2000

redact_text = redact.redact_text  # every string shown goes through clip: log lines included


def clip(text: object, limit: int = MAX_TEXT) -> str:
    shown: str = redact_text(str(text))
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def num(value: object) -> float | None:
    """A float, or None for missing/NaN (pandas hands both)."""
    if value is None:
        return None
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def text_of(value: object) -> str:
    """A string column's value: '' for None and pandas' NaN."""
    return value if isinstance(value, str) else ("" if value is None or num(value) is None else str(value))


def median(values: Iterable[float | None]) -> float | None:
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ranges(numbers: Iterable[Any]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0–2, 5, 7–8' (short for long runs)."""
    ordered = sorted({int(n) for n in numbers})
    if not ordered:
        return ""
    parts: list[str] = []
    start = prev = ordered[0]
    for n in [*ordered[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if n is not None:
            start = prev = n
    if len(parts) > 12:
        parts = parts[:10] + [f"… ({len(ordered)} steps)"]
    return ", ".join(parts)


def frame_label(frame: object) -> str:
    if not isinstance(frame, dict):
        return clip(frame, 300) if frame else ""
    where = frame.get("file") or frame.get("filename") or ""
    line = frame.get("line")
    func = frame.get("function") or frame.get("name") or ""
    loc = f"{where}:{line}" if where and line else where
    return clip(f"{loc} ({func})" if func and loc else (loc or func), 400)
